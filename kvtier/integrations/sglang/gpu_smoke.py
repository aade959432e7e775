"""A real SGLang run with kvtier as its HiCache storage backend (GPU machines; step 5 of ``scripts/gpu-check.sh``).

**Never run here**: SGLang needs a CUDA GPU and none was available where this was written;
the flow itself is tested against a stub HTTP server (``tests/test_sglang_gpu_smoke.py``).

What it checks, on one model and one long prompt (greedy, ``max_new_tokens`` tokens):

1. ``cold``: SGLang started with ``--enable-hierarchical-cache``, the ``dynamic`` storage
   backend naming :class:`~kvtier.integrations.sglang.KVTierHiCacheStorage` (kvtier's disk tier
   in ``work_dir``), ``--hicache-write-policy write_through`` and
   ``--hicache-storage-prefetch-policy wait_complete``, ``--enable-cache-report``; the prompt
   is generated once; then, after kvtier's disk tier holds records, ``/flush_cache`` empties
   SGLang's GPU (L1) and host (L2) caches.
2. ``from_storage``: the same prompt again: its prefix can only come from kvtier (L3), so
   ``meta_info.cached_tokens`` must be at least one page, and the text identical to ``cold``.
3. ``after_restart``: SGLang restarted on the same disk directory: a fresh process finds the
   prefix in kvtier's disk tier (cached tokens >= one page, identical text).

Output: one JSON document (``passed`` and the figures of each step, TTFT proxies as the
request latency of ``max_new_tokens=1`` requests). Exit status 0 passed, 1 a check failed,
2 SGLang missing or did not start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

#: SGLang page size used here (tokens); one page is one kvtier chunk.
PAGE = 64


@dataclass
class Step:
    """One generate call: its text, SGLang's reported cached prefix (tokens) and latency (seconds)."""

    name: str
    text: str
    cached_tokens: int
    latency_s: float


@dataclass
class SmokeResult:
    """The run's outcome (``passed`` is the conjunction of ``checks``)."""

    steps: list[Step] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    disk_records: int = 0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": self.checks, "disk_records": self.disk_records,
                "steps": [asdict(s) for s in self.steps]}


def prompt_text(words: int = 1500) -> str:
    """A long, deterministic document-QA prompt (about ``words`` tokens for a 49k-vocabulary tokenizer)."""
    body = " ".join(f"Clause {i}: the licensee keeps record {i * 7 % 101} for audit." for i in range(words // 10))
    return body + "\nQuestion: which record does clause 42 keep? Answer:"


def extra_config(disk_path: Path, cpu_capacity: str = "2GiB") -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` loading kvtier with a disk tier at ``disk_path``."""
    return {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierHiCacheStorage",
            "kvtier": {"cpu_capacity": cpu_capacity, "disk_path": str(disk_path)}}


def server_command(model: str, port: int, disk_path: Path, python: str = sys.executable) -> list[str]:
    """The ``sglang.launch_server`` command line of this check."""
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
            "--page-size", str(PAGE), "--context-length", "4096", "--enable-hierarchical-cache",
            "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra_config(disk_path)), "--enable-cache-report"]


def generate(client: httpx.Client, name: str, prompt: str, max_new_tokens: int) -> Step:
    """One greedy ``/generate`` call.

    Raises:
        httpx.HTTPError: the server failed or did not answer.
    """
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    t0 = time.perf_counter()
    r = client.post("/generate", json=body)
    r.raise_for_status()
    out = r.json()
    return Step(name, str(out["text"]), int(out.get("meta_info", {}).get("cached_tokens", 0)), time.perf_counter() - t0)


def count_records(disk_path: Path) -> int:
    """Chunk record files under kvtier's disk tier directory (``*.kvc``; in-flight ``.tmp`` files not counted)."""
    return sum(1 for p in disk_path.rglob("*.kvc") if p.is_file() and not p.name.startswith("."))


def wait_for(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> bool:
    """Poll ``pred`` until true or ``timeout_s`` seconds passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def check_server(base_url: str, disk_path: Path, restart: Callable[[], None], max_new_tokens: int = 16,
                 timeout_s: float = 120.0) -> SmokeResult:
    """Run steps 1-3 against the SGLang server at ``base_url`` (``restart`` restarts it in place)."""
    res = SmokeResult()
    prompt = prompt_text()
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        cold = generate(client, "cold", prompt, max_new_tokens)
        res.steps.append(cold)
        res.checks["kvtier_disk_holds_records"] = wait_for(lambda: count_records(disk_path) > 0, 30.0)
        client.post("/flush_cache").raise_for_status()
        again = generate(client, "from_storage", prompt, max_new_tokens)
        res.steps.append(again)
    res.checks["from_storage_hit"] = again.cached_tokens >= PAGE
    res.checks["from_storage_identical"] = again.text == cold.text
    restart()
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        after = generate(client, "after_restart", prompt, max_new_tokens)
        res.steps.append(after)
    res.checks["after_restart_hit"] = after.cached_tokens >= PAGE
    res.checks["after_restart_identical"] = after.text == cold.text
    res.disk_records = count_records(disk_path)
    return res


class SGLangProcess:
    """``sglang.launch_server`` in its own process group, started and stopped by this check."""

    def __init__(self, cmd: list[str], base_url: str, log_path: Path):
        self.cmd, self.base_url, self.log_path = cmd, base_url, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        """Start and wait for ``/health``.

        Raises:
            RuntimeError: the process exited or did not answer within ``timeout_s`` seconds.
        """
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def healthy() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.proc.returncode}; log {self.log_path}")
            try:
                return httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_for(healthy, timeout_s, 1.0):
            self.stop()
            raise RuntimeError(f"SGLang did not answer /health within {timeout_s:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model folder or hub id SGLang can load")
    ap.add_argument("--port", type=int, default=30333)
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    try:
        import sglang  # noqa: F401
    except Exception as exc:  # not installed, or broken without CUDA
        print(json.dumps({"passed": False, "skipped": f"sglang not importable: {exc}"}))
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvtier-sglang-"))
    base = f"http://127.0.0.1:{args.port}"
    server = SGLangProcess(server_command(args.model, args.port, work / "disk"), base, work / "sglang.log")

    def restart() -> None:
        server.stop()
        server.start()

    try:
        server.start()
        res = check_server(base, work / "disk", restart)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(json.dumps({"passed": False, "error": str(exc), "log": str(work / "sglang.log")}))
        return 2
    finally:
        server.stop()
    doc = res.to_json()
    print(json.dumps(doc, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if res.passed else 1


if __name__ == "__main__":
    sys.exit(main())
