"""``kvtier bench peers``: kvtier's tiers against LMCache's storage backends, side by side, in one run.

Each round runs, for every figure, LMCache's side (kvtier's own driver,
:mod:`kvtier.bench.lmcache_driver`, run by the Python of LMCache's virtual
environment, ``--lmcache-python``, default ``~/lmc-venv/bin/python``) and kvtier's
side (:mod:`kvtier.bench.peers_side`), each in a fresh subprocess, in an order that
alternates between rounds; then the physical baselines in their own subprocess.
Same KV shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, bf16), same
prompt (2,048 tokens, 8 chunks of 256), same repetitions (median per round).
Before every timed put each side flushes dirty pages (``os.sync``) and frees the
same amount of freshly touched memory (``--free-mb``), LMCache's child included.

Which levels are compared: CPU at engine level (LMCache ``store()``/``retrieve()``
vs kvtier hash + ``open_write``/copy/``commit`` and ``lookup_keys``/``open_read``/
copy), disk and Redis at storage level (LMCache ``batched_submit_put_task`` until
every write completed / ``batched_get_blocking`` vs kvtier ``put_many`` /
``get_many_into``; kvtier verifies a checksum on every read, LMCache does not).

Per figure the report gives each side's GB/s (median of the round medians), the
ratio kvtier / LMCache (median and min-max over rounds) and each side's ratio to
the physical baseline of that round: memcpy for CPU, ``io_threads`` threads of
plain ``pwrite``/``preadv`` files (buffered: the faster of one call per file and
1 MiB writes / 256 KiB reads, see :mod:`.peers_baseline`; or O_DIRECT) for disk,
redis-py pipelined ``SET``/``GET`` for Redis. The buffered disk figures' target
applies to the same plain files plus an xxh3-64 of every chunk (``file_xxh3``: the
checksum kvtier stores and verifies, LMCache does not); the ratio to the plain
files is reported beside it. Each side's get writes into the memory its put just
read from (see :mod:`.peers_side`). What each side does is in the JSON (``sides``,
``timing``) and printed under the table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.bench.common import BenchUsageError, write_json
from kvtier.bench.peers_report import FIGURES, UNVERIFIED_GROUPS, build_report, print_report
from kvtier.bench.memory_state import free_fresh_memory

#: kvtier's LMCache driver: a script LMCache's interpreter runs by path (it never imports kvtier).
DRIVER = Path(__file__).resolve().with_name("lmcache_driver.py")
#: Where the LMCache environment is expected by default (README's recipe).
DEFAULT_LMCACHE_PYTHON = Path("~/lmc-venv/bin/python").expanduser()

#: LMCache driver figure, result level and O_DIRECT behind each figure group.
_LMC_CHILD = {"cpu": ("cpu", "engine", False), "disk": ("disk", "storage", False),
              "disk_direct": ("disk", "storage", True), "redis": ("redis", "storage", False)}


@dataclass(frozen=True)
class PeerSizes:
    """Shape and repetitions of one run (defaults: SmolLM2-135M, a 2,048-token prompt)."""

    tokens: int = 2048
    layers: int = 30
    kv_heads: int = 3
    head_dim: int = 64
    chunk: int = 256
    reps: int = 5
    io_threads: int = 4
    free_mb: int = 256
    child_timeout_s: int = 300

    @classmethod
    def tiny(cls) -> "PeerSizes":
        """Smoke tests: seconds; figures meaningless."""
        return cls(tokens=512, layers=2, reps=1, free_mb=4, child_timeout_s=120)

    def args(self) -> list[str]:
        return ["--tokens", str(self.tokens), "--layers", str(self.layers), "--kv-heads", str(self.kv_heads),
                "--head-dim", str(self.head_dim), "--chunk", str(self.chunk), "--reps", str(self.reps)]


def _result_line(out: subprocess.CompletedProcess[str], prefix: str) -> dict[str, Any] | None:
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(prefix)]
    return json.loads(lines[-1][len(prefix):]) if lines else None


def _run(cmd: list[str], env: dict[str, str], timeout: int, prefix: str = "RESULT ") -> tuple[dict[str, Any] | None, str]:
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    res = _result_line(out, prefix)
    return res, "" if res is not None else f"rc={out.returncode}: {out.stderr.strip()[-600:]}"


def lmcache_available(python: Path) -> str:
    """Empty if LMCache can run under ``python``; else why not (one line)."""
    if not Path(python).exists():
        return (f"LMCache environment not found: {python} does not exist (pass --lmcache-python; "
                "benchmarks/README.md has the recipe)")
    try:
        out = subprocess.run([str(python), "-I", str(DRIVER), "--probe"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"LMCache environment at {python} does not start: {exc}"
    if out.returncode or not any(ln.startswith("PROBE ") for ln in out.stdout.splitlines()):
        why = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE_ERROR")] or out.stderr.strip().splitlines()
        return f"LMCache is not importable with {python}: {(why or ['no answer'])[-1]}"
    return ""


def run_peers_bench(
    lmcache_python: Path | None = None,
    rounds: int = 3,
    odirect: bool = False,
    redis_url: str = "127.0.0.1:6399",
    sizes: PeerSizes | None = None,
    work_dir: Path | None = None,
    log: Callable[[str], None] = print,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run every round; returns the JSON document (see the module doc and :mod:`.peers_report`).

    ``only``: figure groups to run (``cpu``, ``disk``, ``disk_direct``, ``redis``; default all,
    ``disk_direct`` with ``odirect``).

    Raises:
        BenchUsageError: ``rounds`` < 1 or an unknown group in ``only``.
    """
    if rounds < 1:
        raise BenchUsageError(f"--rounds must be >= 1, got {rounds}")
    unknown = sorted(set(only or ()) - set(_LMC_CHILD))
    if unknown:
        raise BenchUsageError(f"unknown figure groups {unknown}; known: {sorted(_LMC_CHILD)}")
    sizes = sizes or PeerSizes()
    python = Path(lmcache_python or DEFAULT_LMCACHE_PYTHON)
    skip = lmcache_available(python)
    if skip:
        log(f"LMCache skipped: {skip}; kvtier figures are still measured")
    groups = ["cpu", "disk"] + (["disk_direct"] if odirect else []) + ["redis"]
    if only:
        groups = [g for g in _LMC_CHILD if g in only]
    cache = Path.home() / ".cache" / "kvtier"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=work_dir or cache))  # not tmpfs: O_DIRECT works
    free = sizes.free_mb << 20
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_LOG_LEVEL="ERROR")
    common = sizes.args()
    side_args = common + ["--redis-url", redis_url, "--work-dir", str(tmp), "--io-threads", str(sizes.io_threads),
                          "--free-bytes", str(free)]
    raw_rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        for r in range(rounds):
            log(f"round {r + 1}/{rounds}")
            rd: dict[str, Any] = {"kvtier": {}, "kvtier_unverified": {}, "lmcache": {}, "baseline": None}
            for g in groups:
                sides = ["lmcache", "kvtier"] + (["kvtier_unverified"] if g in UNVERIFIED_GROUPS else [])
                if r % 2:
                    sides.reverse()
                for side in sides:
                    if side == "lmcache" and skip:
                        continue
                    free_fresh_memory(free)  # the same memory state before each side
                    if side.startswith("kvtier"):
                        cmd = [sys.executable, "-m", "kvtier.bench.peers_side", g] + side_args + (
                            ["--no-verify"] if side == "kvtier_unverified" else [])
                    else:
                        figure, _, direct = _LMC_CHILD[g]
                        cmd = [str(python), "-I", str(DRIVER), figure] + common + [
                            "--redis-url", redis_url, "--disk-dir", str(tmp / "lmc-disk"), "--free-bytes", str(free),
                            "--child-timeout", str(sizes.child_timeout_s)] + (["--odirect"] if direct else [])
                    res, err = _run(cmd, env, sizes.child_timeout_s + 30)
                    if res is None:
                        errors.append(f"round {r + 1} {side} {g}: {err}")
                        log(f"  {side} {g}: FAILED {err}")
                    else:
                        rd[side][g] = res
                    shutil.rmtree(tmp / "lmc-disk", ignore_errors=True)
            free_fresh_memory(free)
            base, err = _run([sys.executable, "-m", "kvtier.bench.peers_side", "baseline"] + side_args, env,
                             sizes.child_timeout_s + 30)
            if base is None:
                errors.append(f"round {r + 1} baseline: {err}")
            rd["baseline"] = base
            raw_rounds.append(rd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = build_report(raw_rounds, groups, _LMC_CHILD)
    doc.update(lmcache_skipped=skip, lmcache_python=str(python), lmcache_driver=str(DRIVER), rounds=rounds,
               odirect=odirect, sizes=sizes.__dict__, errors=errors, raw_rounds=raw_rounds)
    return doc


def run_peers(
    lmcache_python: Path | None = None,
    rounds: int = 3,
    json_path: Path | None = None,
    odirect: bool = False,
    redis_url: str = "127.0.0.1:6399",
    sizes: PeerSizes | None = None,
    enforce: bool = False,
) -> int:
    """``kvtier bench peers``: run, print the table, write JSON. Returns 1 if ``enforce`` and a target is missed."""
    from rich.console import Console

    console = Console(stderr=True)
    doc = run_peers_bench(lmcache_python, rounds, odirect, redis_url, sizes,
                          log=lambda m: console.print(f"[dim]{m}[/dim]"))
    print_report(doc)
    write_json(json_path, doc)
    return 1 if enforce and not doc["all_targets_met"] else 0


__all__ = ["FIGURES", "PeerSizes", "run_peers", "run_peers_bench", "lmcache_available"]
