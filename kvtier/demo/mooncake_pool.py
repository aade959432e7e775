"""Two ``kvtier server`` nodes over one Mooncake Store pool: a prefix stored through one is a
hit through the other, with the same greedy answers.

Run: ``kvtier demo-mooncake [--json PATH]`` (or ``python -m kvtier.demo.mooncake_pool``).

Set-up, all on loopback: a ``mooncake_master`` (no metadata server), a ``mooncake_client``
that owns the pool's memory (1 GiB segment), and two ``kvtier server`` processes, A and B,
each with its own CPU tier and ``remote_url = mooncake://...?segment_bytes=0`` (they
contribute no pool memory, so restarting one loses nothing in the pool).

Steps (each engine run is a fresh vLLM process on the real model, SmolLM2-135M on the CPU):
1. engine 1 on server A answers one question per document twice: the first answer is cold
   and fills A's CPU tier, which writes the chunks behind to Mooncake; the second is a hit
   in vLLM's own prefix cache and is the reference (kvtier's chunk size equals vLLM's block
   size, so a kvtier hit splits the prefill exactly where an engine hit does);
2. the demo waits until A has written every chunk to the pool, then restarts server B
   (its own tiers start empty: cleared);
3. engine 2 on server B answers the same prompts: its hits come from the pool (tier
   ``remote``), and its answers must equal the reference;
4. server A is restarted too (its CPU tier cleared) and engine 3 on A answers again: hits
   from the pool, identical answers.
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

from kvtier.demo.two_engines import _run_engine
from kvtier.ports import PortPicker
from kvtier.processes import stop_processes

POOL_BYTES = 1 << 30


def _metric(port: int, name: str) -> float:
    """Sum of every sample of metric ``name`` on a server's /metrics (0 if absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _start_server(sock: str, metrics_port: int, remote_url: str) -> subprocess.Popen:
    env = dict(os.environ, KVTIER_REMOTE_URL=remote_url, KVTIER_REMOTE_TIMEOUT_S="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "server", "--socket", sock, "--cpu-capacity", "1GiB",
         "--metrics-port", str(metrics_port)], env=env,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtier server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kvtier server did not start")


def _wait_written(port: int, limit_s: float = 120.0) -> float:
    """Wait until the server's write-behind to the remote tier is idle with chunks stored; returns them."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ok = _metric(port, "kvtier_remote_put_ok_chunks_total")
        if ok > 0 and _metric(port, "kvtier_remote_write_pending") == 0:
            return ok
        time.sleep(0.5)
    raise RuntimeError("server A did not write its chunks to the Mooncake pool")


def run(json_path: Path | None = None, documents: int = 4) -> int:
    """The demo (see the module doc) over the first ``documents`` (1..4) documents; exit code 0
    when every check passes.

    Raises:
        ValueError: ``documents`` outside 1..4.
    """
    if isinstance(documents, bool) or not isinstance(documents, int) or not 1 <= documents <= 4:
        raise ValueError(f"documents must be an integer 1..4, got {documents!r}")
    from transformers import AutoTokenizer

    from kvtier.demo.model import prepare_model
    from kvtier.demo.workload import load_documents, prompt_token_ids
    from kvtier.testing.mooncake_master import MooncakeMasterProcess, SegmentOwnerProcess, mooncake_missing

    why = mooncake_missing()
    if why:
        print(f"kvtier demo-mooncake: {why}", file=sys.stderr)
        return 2
    model = str(prepare_model().path)
    tok = AutoTokenizer.from_pretrained(model)
    docs = load_documents()[:documents]
    prompts = [prompt_token_ids(tok, d, d.questions[0]) for d in docs]
    work = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-demo-"))
    prompts_path = str(work / "prompts.json")
    Path(prompts_path).write_text(json.dumps(prompts))
    rows: list[dict[str, Any]] = []
    master = MooncakeMasterProcess()
    owner = SegmentOwnerProcess(master.address, POOL_BYTES)
    url = f"{master.url}?segment_bytes=0"
    socks = {n: str(work / f"server-{n}.sock") for n in "AB"}
    picker = PortPicker()
    ports = {n: picker.pick() for n in "AB"}
    servers: dict[str, subprocess.Popen] = {}
    try:
        for n in "AB":
            servers[n] = _start_server(socks[n], ports[n], url)
        (cold, reference), _ = _run_engine(model, socks["A"], "engine-1", prompts_path, work, "1", repeat=True)
        rows.append({"run": "engine 1 on A, cold (+ engine-hit reference)", "hits": {}, "answers_identical": True})
        written = _wait_written(ports["A"])
        print(f"server A wrote {written:.0f} chunks to the Mooncake pool")
        for n, eid, label in [("B", "engine-2", "engine 2 on B (B's tiers cleared)"),
                              ("A", "engine-3", "engine 3 on A (A's tiers cleared)")]:
            stop_processes([servers[n]], 60.0)  # a restart empties the server's own tiers; the pool keeps its chunks
            servers[n] = _start_server(socks[n], ports[n], url)
            # What "cleared" means, measured: the restarted server's own tiers hold nothing. (Its hits
            # may still name ``cpu``: a chunk the engine loaded from the pool is promoted into the
            # CPU tier, and a prompt sharing that prefix, scheduled after it, hits it there.)
            own_chunks = _metric(ports[n], "kvtier_cpu_chunks") + _metric(ports[n], "kvtier_disk_chunks")
            (answers,), hits = _run_engine(model, socks[n], eid, prompts_path, work, eid)
            rows.append({"run": label, "hits": hits, "answers_identical": answers == reference,
                         "own_chunks_at_start": own_chunks,
                         "equal_to_cold": sum(a == c for a, c in zip(answers, cold))})
    finally:
        for proc in servers.values():
            stop_processes([proc], 60.0)
        owner.stop()
        master.stop()
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        extra = f"  (equal to cold: {r['equal_to_cold']}/{len(prompts)})" if "equal_to_cold" in r else ""
        print(f"{r['run']:<46} hit tokens {r['hits']}  identical answers: {r['answers_identical']}{extra}")
    ok = (all(r["answers_identical"] for r in rows) and all(r["hits"].get("remote", 0) > 0 for r in rows[1:])
          and all(r["own_chunks_at_start"] == 0 for r in rows[1:]))
    if json_path:
        json_path.write_text(json.dumps({"runs": rows, "passed": ok}, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--documents", type=int, default=4, choices=range(1, 5), metavar="1..4",
                    help="how many of the 4 documents the engines ask about")
    args = ap.parse_args(argv)
    return run(args.json, args.documents)


if __name__ == "__main__":
    from kvtier.integrations.vllm_engine import engine_env

    os.environ.update(engine_env(os.environ))
    sys.exit(main())
