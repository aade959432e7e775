"""End-to-end scenarios on the real model (SmolLM2-135M-Instruct) in vLLM.

Each scenario runs in its own process (vLLM binds threads and installs signal
handlers, so it stays out of the pytest process) and prints one JSON line
prefixed with ``RESULT ``. Used by tests/test_vllm_e2e.py.

    python tests/vllm_scenarios.py SCENARIO DISK_DIR [EXPECTED_JSON]
"""

from __future__ import annotations

import json
import os
import sys

from kvtier.integrations.vllm_engine import engine_env  # noqa: E402  (no vLLM import)

os.environ.update(engine_env(os.environ, in_process=False))

QUESTION = "\n\nQuestion: Under this license, what must you give recipients when you redistribute the Work?\nAnswer:"
MAX_TOKENS = 24


def _prompt() -> list[int]:
    from kvtier.demo.model import prepare_model

    from transformers import AutoTokenizer

    path = prepare_model().path
    tok = AutoTokenizer.from_pretrained(str(path))
    text = open("/usr/share/common-licenses/Apache-2.0").read()
    if not text:
        raise SystemExit("missing document")
    return tok(text + QUESTION)["input_ids"]


def _llm(disk_dir: str, extra: dict | None = None):
    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm_engine import build_llm

    cfg = {"disk_path": disk_dir, "cpu_capacity": "256MiB", **(extra or {})}
    return build_llm(str(prepare_model().path), cfg, max_model_len=4096, num_gpu_blocks_override=40)


def _generate(llm, tokens: list[int]) -> tuple[list[int], int, str]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        use_tqdm=False,
    )[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), out.request_id


def _hits(request_id: str) -> dict | None:
    from kvtier.integrations.vllm import request_hits

    return request_hits(request_id)


def scenario_inprocess(disk_dir: str) -> dict:
    """Cold run, then (engine prefix cache reset) a kvtier hit, then a hit on corrupted KV."""
    from kvtier.integrations.vllm import flush_all, stats_all
    from kvtier.storage import registry

    tokens = _prompt()
    llm = _llm(disk_dir)
    cold, cold_cached, rid = _generate(llm, tokens)
    cold_hits = _hits(rid)
    flush_all()
    llm.reset_prefix_cache()
    warm, warm_cached, rid = _generate(llm, tokens)
    warm_hits = _hits(rid)
    # Negative control: scribble over every stored chunk in the CPU tier, keep the
    # disk copies out of reach, and load again. The answer must change.
    (manager,) = registry.active_managers()
    for key in list(manager.cpu._entries):
        buf = manager.cpu.acquire(key)
        if buf is not None:
            buf[::2] = 0x3F  # bf16 ~0.75 in every high byte: wrong, finite KV
            manager.cpu.release(key)
    llm.reset_prefix_cache()
    bad, _, rid = _generate(llm, tokens)
    bad_hits = _hits(rid)
    return {
        "prompt_tokens": len(tokens),
        "cold": cold,
        "cold_hits": cold_hits,
        "warm": warm,
        "warm_hits": warm_hits,
        "warm_cached": warm_cached,
        "bad": bad,
        "bad_hits": bad_hits,
        "stats": stats_all()[0],
    }


def scenario_restart(disk_dir: str) -> dict:
    """A fresh engine process on the same disk tier: hits come from disk."""
    tokens = _prompt()
    llm = _llm(disk_dir)
    out, cached, rid = _generate(llm, tokens)
    return {"tokens": out, "hits": _hits(rid), "cached": cached}


def scenario_multiprocess(disk_dir: str) -> dict:
    """vLLM's default multi-process engine core: cold, reset engine cache, hit."""
    tokens = _prompt()
    llm = _llm(disk_dir)
    cold, _, _ = _generate(llm, tokens)
    llm.reset_prefix_cache()
    warm, warm_cached, _ = _generate(llm, tokens)
    return {"cold": cold, "warm": warm, "warm_cached": warm_cached, "prompt_tokens": len(tokens)}


SCENARIOS = {
    "inprocess": scenario_inprocess,
    "restart": scenario_restart,
    "multiprocess": scenario_multiprocess,
}

if __name__ == "__main__":
    name, disk = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](disk)
    print("RESULT " + json.dumps(result), flush=True)
