"""Randomised request mixes on the scheduler harness (tests/sched_harness.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from sched_harness import Engine, EngineSpec, tokens

@dataclass
class MixResult:
    """What one mix did and saw (every field is summed over mixes by the randomised test)."""

    seed: int
    async_scheduling: bool
    requests: int = 0
    failed_reads: int = 0
    wrong_reads: int = 0
    preemptions: int = 0
    aborts: int = 0
    commits: int = 0
    kvtier_hit_tokens: int = 0
    bad_commits: int = 0
    bad_resident: int = 0
    unknown_commits: int = 0
    mirror_mismatches: int = 0
    wrong_outputs: int = 0


def check_mirror(engine: Engine) -> int:
    """Requests whose block table, as kvtier's worker mirrors it, differs from the runner's."""
    worker = engine.kv_worker.worker
    return sum(1 for rid, rr in engine._reqs.items() if worker.mirrored_table(rid) != rr.table)


def run_mix(seed: int, async_scheduling: bool, p_fail: float = 0.3,
            tweak: Callable[[Engine], None] | None = None) -> MixResult:
    """One randomised mix: shared prefixes, a small KV cache (preemptions), failing reads, aborts.

    Phase 1 stores some prompts; the engine's prefix cache is reset; phase 2 sends
    requests over shared prefixes at random steps while each chunk read fails with
    probability ``p_fail``, some requests are aborted and the prefix cache is reset
    when idle. ``tweak`` may break the engine on purpose (the audit must notice).
    """
    rng = np.random.default_rng(seed)
    chunk = int(rng.choice([16, 32]))
    spec = EngineSpec(
        num_blocks=int(rng.integers(10, 26)), max_num_batched_tokens=int(rng.choice([16, 32, 48, 96])),
        max_num_seqs=8, async_scheduling=async_scheduling, chunk_size=chunk, cpu_chunks=int(rng.integers(4, 64)),
    )
    eng = Engine(spec)
    res = MixResult(seed, async_scheduling)
    try:
        if tweak is not None:
            tweak(eng)
        segs = [tokens(seed * 100 + i, int(rng.integers(12, 64))) for i in range(4)]

        def prompt() -> list[int]:
            parts = [segs[int(i)] for i in rng.choice(4, size=int(rng.integers(1, 4)))]
            if rng.random() < 0.8:  # most prompts share one of two heads
                parts[0] = segs[int(rng.integers(0, 2))]
            p = [t for part in parts for t in part] + tokens(int(rng.integers(1 << 30)), int(rng.integers(1, 20)))
            return p[: spec.num_blocks * spec.geometry.block_size // 2]  # fits the KV cache with room to spare

        n = 0
        for _ in range(int(rng.integers(2, 6))):
            eng.add(f"w{n}", prompt(), max_tokens=1)
            n += 1
        eng.run()
        eng.reset_prefix_cache()
        eng.store.fail_read = lambda key: bool(rng.random() < p_fail)
        pending = int(rng.integers(4, 13))
        for _ in range(4000):
            if pending and (not eng.busy or rng.random() < 0.4):
                for _ in range(int(rng.integers(1, 3))):
                    if pending:
                        eng.add(f"r{n}", prompt(), max_tokens=int(rng.choice([1, 2, 4, 8, 24])))
                        n += 1
                        pending -= 1
            if not eng.busy:
                if not pending:
                    break
                continue
            eng.step()
            res.mirror_mismatches += check_mirror(eng)
            live = [r for r in eng.sched.requests]
            if live and rng.random() < 0.03:
                eng.abort(str(rng.choice(live)))
                res.aborts += 1
            if rng.random() < 0.05:
                eng.reset_prefix_cache()  # succeeds only when nothing runs
        else:
            raise AssertionError(f"mix {seed}: still busy")
        res.requests = n
        res.failed_reads = eng.store.failed_reads
        res.wrong_reads = len(eng.audit.wrong_reads)
        res.preemptions = eng.preemptions
        res.commits = eng.audit.commits
        res.bad_commits = len(eng.audit.bad_commits)
        res.unknown_commits = len(eng.audit.unknown_commits)
        res.bad_resident = len(eng.audit.check_store(eng.manager))
        res.wrong_outputs = len(eng.wrong_outputs())
        res.kvtier_hit_tokens = sum(h.kvtier_hit_tokens for h in (eng.hits(f"r{i}") for i in range(n)) if h)
        return res
    finally:
        eng.shutdown()
