"""Two vLLM engine processes sharing one ``kvtier server`` (DRAFT: finish once the connector is wired).

Run: ``python -m kvtier.service.demo_two_engines [--json PATH]``

Needs the vLLM connector to accept ``kv_connector_extra_config={"server": "unix:///path.sock"}``
(the lead wires it into kvtier/integrations/vllm.py and kvtier/config.py); until then
the engines run embedded tiers and the cross-engine checks below fail.

Steps (each engine run is a fresh process, so nothing survives in engine memory):
1. start ``kvtier server`` with a disk tier and metrics on a free loopback port;
2. engine A answers one question per document (cold: fills the server);
3. engine B answers the same prompts: expects kvtier hits on documents only A has seen;
4. engine A runs again (a restarted engine): still hits;
5. the server is restarted (SIGTERM, then started on the same disk directory) and engine B
   runs again: hits served from the disk tier.
Every run's greedy answers must equal run 2's (cold) answers. Hit tokens come from the
server's Prometheus counter ``kvtier_lookup_hit_tokens_total{tier=...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

MAX_TOKENS = 16
NUM_BLOCKS = 96
BLOCK_SIZE = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hit_tokens(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvtier_lookup_hit_tokens_total{"):
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out


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


def engine_main(model: str, sock: str, engine_id: str, prompts_path: str, out_path: str) -> None:
    """One engine process: greedy answers for every prompt, written as JSON."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(prompts_path).read_text())
    llm = LLM(
        model=model, dtype="bfloat16", enforce_eager=True, block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=True, seed=0, max_model_len=8192,
        kv_transfer_config={
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_connector_extra_config": {"server": f"unix://{sock}"},
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    answers = []
    for ids in prompts:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        answers.append(out.outputs[0].text)
    Path(out_path).write_text(json.dumps(answers))


def _run_engine(model: str, sock: str, engine_id: str, prompts_path: str, work: Path, tag: str) -> list[str]:
    out = work / f"answers-{tag}.json"
    subprocess.run(
        [sys.executable, "-m", "kvtier.service.demo_two_engines", "--engine", model, sock, engine_id,
         prompts_path, str(out)],
        check=True,
    )
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--engine", nargs=5, metavar=("MODEL", "SOCK", "ID", "PROMPTS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        engine_main(*args.engine)
        return 0

    from transformers import AutoTokenizer

    from kvtier.demo.model import prepare_model
    from kvtier.demo.workload import load_documents, prompt_token_ids

    model = str(prepare_model().path)
    tok = AutoTokenizer.from_pretrained(model)
    docs = load_documents()[:4]
    prompts = [prompt_token_ids(tok, d, d.questions[0]) for d in docs]
    work = Path(tempfile.mkdtemp(prefix="kvtier-two-engines-"))
    prompts_path = work / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    sock, disk, port = str(work / "kvtier.sock"), str(work / "disk"), _free_port()

    rows: list[dict[str, Any]] = []
    server = _start_server(sock, disk, port)
    try:
        plan = [("A cold", "engine-a"), ("B (A's documents)", "engine-b"), ("A restarted", "engine-a")]
        reference: list[str] | None = None
        for label, eid in plan:
            before = _hit_tokens(port)
            answers = _run_engine(model, sock, eid, str(prompts_path), work, label.split()[0] + str(len(rows)))
            after = _hit_tokens(port)
            reference = reference or answers
            rows.append({"run": label, "hits": {t: after.get(t, 0) - before.get(t, 0) for t in after},
                         "answers_identical": answers == reference})
        server.terminate()
        server.wait(timeout=60)
        server = _start_server(sock, disk, port)
        answers = _run_engine(model, sock, "engine-b", str(prompts_path), work, "B-after-restart")
        rows.append({"run": "B after server restart", "hits": _hit_tokens(port),
                     "answers_identical": answers == reference})
    finally:
        server.terminate()
        server.wait(timeout=60)
    for r in rows:
        print(f"{r['run']:<26} hit tokens {r['hits']}  identical answers: {r['answers_identical']}")
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
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
