"""Two vLLM engine processes sharing one ``kvtier server``: cross-engine and cross-restart hits.

Run: ``kvtier demo-server [--json PATH]`` (or ``python -m kvtier.demo.two_engines``).

Steps (each engine run is a fresh process, so nothing survives in engine memory):
1. start ``kvtier server`` with a disk tier and metrics on a free loopback port;
2. engine A answers one question per document twice in a row: the first answer is
   cold and fills the server; the second is a hit in vLLM's own prefix cache and is
   the reference (kvtier's chunk size equals vLLM's block size here, so a kvtier hit
   splits the prefill exactly where an engine hit does);
3. engine B answers the same prompts: kvtier hits on documents only A has seen;
4. engine A runs again (a restarted engine): still hits;
5. the server is restarted (SIGTERM, then started on the same disk directory) and
   engine B runs again: hits served from the disk tier.
Every hit run's greedy token ids must equal the reference. (A cold prefill in bf16
may differ from any prefix-cache hit, vLLM's own included, because the split
changes the floating-point reduction order; the report says how many equal the
cold answers too.) Hit tokens are the tokens kvtier loaded into each engine, by
tier, as that engine's connector accounted them (``request_hits``: engines run
in-process in their child, which reports its totals to this parent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.ports import free_port

MAX_TOKENS = 24
NUM_BLOCKS = 40
BLOCK_SIZE = 128


def _start_server(sock: str, disk: str, metrics_port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "server", "--socket", sock, "--cpu-capacity", "1GiB",
         "--disk-path", disk, "--disk-capacity", "8GiB", "--metrics-port", str(metrics_port)],
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kvtier server did not start")


def engine_main(model: str, sock: str, engine_id: str, prompts_path: str, out_path: str, repeat: str = "0") -> None:
    """One engine process: greedy token ids for every prompt (twice each if ``repeat``) and the
    tokens kvtier loaded into this engine by tier (first pass), as JSON ``{"answers", "hits"}``."""
    from vllm import SamplingParams

    from kvtier.integrations.vllm import request_hits
    from kvtier.integrations.vllm_engine import build_llm, kv_transfer_config

    prompts = json.loads(Path(prompts_path).read_text())
    llm = build_llm(
        model, block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=True,
        max_model_len=(NUM_BLOCKS - 1) * BLOCK_SIZE,
        kv_transfer_config=kv_transfer_config(
            {"server": f"unix://{sock}", "chunk_size": BLOCK_SIZE}, engine_id=engine_id
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    runs: list[list[list[int]]] = [[], []] if repeat == "1" else [[]]
    hits: dict[str, int] = {}
    for ids in prompts:
        for i, answers in enumerate(runs):  # the second pass of a prompt hits vLLM's own prefix cache
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            answers.append(list(out.outputs[0].token_ids))
            info = request_hits(out.request_id) if i == 0 else None
            for tier, n in ((info or {}).get("tiers") or {}).items():
                hits[tier] = hits.get(tier, 0) + int(n)
    Path(out_path).write_text(json.dumps({"answers": runs, "hits": hits}))


def _run_engine(
    model: str, sock: str, engine_id: str, prompts_path: str, work: Path, tag: str, repeat: bool = False
) -> tuple[list[list[list[int]]], dict[str, int]]:
    """Run one engine process: (answers per pass, tokens kvtier loaded into it by tier)."""
    out = work / f"answers-{tag}.json"
    subprocess.run(
        [sys.executable, "-m", "kvtier.demo.two_engines", "--engine", model, sock, engine_id,
         prompts_path, str(out), "1" if repeat else "0"],
        check=True,
    )
    doc = json.loads(out.read_text())
    return doc["answers"], {str(t): int(n) for t, n in doc["hits"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--documents", type=int, default=4, choices=range(1, 5), metavar="1..4",
                    help="how many of the 4 documents the engines ask about")
    ap.add_argument("--engine", nargs=6, metavar=("MODEL", "SOCK", "ID", "PROMPTS", "OUT", "REPEAT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        engine_main(*args.engine)
        return 0

    from transformers import AutoTokenizer

    from kvtier.demo.model import prepare_model
    from kvtier.demo.workload import load_documents, prompt_token_ids

    model = str(prepare_model().path)
    tok = AutoTokenizer.from_pretrained(model)
    docs = load_documents()[: args.documents]
    prompts = [prompt_token_ids(tok, d, d.questions[0]) for d in docs]
    work = Path(tempfile.mkdtemp(prefix="kvtier-two-engines-"))
    prompts_path = work / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    sock, disk, port = str(work / "kvtier.sock"), str(work / "disk"), free_port()

    rows: list[dict[str, Any]] = []
    server = _start_server(sock, disk, port)
    try:
        (cold, reference), _ = _run_engine(model, sock, "engine-a", str(prompts_path), work, "A-cold", repeat=True)
        rows.append({"run": "A cold (+ engine-hit reference)", "hits": {}, "answers_identical": True})
        plan = [("B (A's documents)", "engine-b"), ("A restarted", "engine-a")]
        for label, eid in plan:
            (answers,), hits = _run_engine(model, sock, eid, str(prompts_path), work, eid + str(len(rows)))
            rows.append({"run": label, "hits": hits,
                         "answers_identical": answers == reference, "equal_to_cold": sum(
                             a == c for a, c in zip(answers, cold))})
        server.terminate()
        server.wait(timeout=60)
        server = _start_server(sock, disk, port)
        (answers,), hits = _run_engine(model, sock, "engine-b", str(prompts_path), work, "B-after-restart")
        rows.append({"run": "B after server restart", "hits": hits,
                     "answers_identical": answers == reference,
                     "equal_to_cold": sum(a == c for a, c in zip(answers, cold))})
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)  # the server's disk tier: ~285 MB of chunk files
    for r in rows:
        extra = f"  (equal to cold: {r['equal_to_cold']}/{len(prompts)})" if "equal_to_cold" in r else ""
        print(f"{r['run']:<32} hit tokens {r['hits']}  identical answers: {r['answers_identical']}{extra}")
    ok = (
        all(r["answers_identical"] for r in rows)
        and sum(rows[1]["hits"].values()) > 0
        and sum(rows[2]["hits"].values()) > 0
        and rows[3]["hits"].get("disk", 0) > 0
    )
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "passed": ok}, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    from kvtier.integrations.vllm_engine import engine_env

    os.environ.update(engine_env(os.environ))
    sys.exit(main())
