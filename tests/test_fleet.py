"""Fleet replay: kvtier's router code over simulated engines, the engine block cache, the shared
pool, the bench's JSON, and the Dynamo driver's argument checks (Dynamo itself is not needed)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sim.fleet.dynamo import DRIVER, DynamoError, run_dynamo
from kvtier.sim.fleet.engine import MOCKER_LIKE, BlockCache
from kvtier.sim.fleet.fleet import FleetConfig, FleetSim, unbounded_reuse
from kvtier.storage.trace_file import TraceRecord, iter_trace

EXCERPT = Path(__file__).parent / "fixtures" / "traces" / "mooncake_conversation_head300.jsonl"
BS = 64


def conversations(n: int, seed: int = 0) -> list[TraceRecord]:
    """Synthetic multi-turn traffic: 30 sessions, each turn extends its session's prefix."""
    rng = random.Random(seed)
    nxt = 1
    sessions: list[list[int]] = []
    out = []
    for i in range(n):
        if len(sessions) < 30 or rng.random() < 0.1:
            sessions.append([0])  # a shared system-prompt block
        s = rng.choice(sessions)
        for _ in range(rng.randint(1, 4)):
            s.append(nxt)
            nxt += 1
        n_in = len(s) * BS - rng.randrange(BS // 2)
        out.append(TraceRecord(i * 50.0, n_in, rng.randint(1, 20), tuple(s)))
        if len(s) > 24:  # the conversation ends before it outgrows an engine
            sessions.remove(s)
    return out


def run(routing: str, recs: list[TraceRecord], workers: int = 4, blocks: int = 40, **kw: int) -> object:
    sim = FleetSim(FleetConfig(workers, routing, blocks, BS, 1.0, MOCKER_LIKE, **kw))  # type: ignore[arg-type]
    res = sim.run(recs)
    for inst in sim.instances:  # every block given back
        assert inst.cache.anon == 0 and not inst.cache.in_use
        assert len(inst.cache.free) <= blocks
    return sim, res


def test_kv_aware_routing_through_kvtiers_router_beats_round_robin() -> None:
    recs = conversations(600)
    sim, kv = run("kv-aware", recs)
    _, rr = run("round-robin", recs)
    _, ll = run("least-loaded", recs)
    assert kv.requests == rr.requests == ll.requests == 600  # type: ignore[attr-defined]
    assert kv.reuse > 1.3 * rr.reuse > 0  # type: ignore[attr-defined]
    assert kv.max_request_share_ratio < 1.5 and rr.max_request_share_ratio == 1.0  # type: ignore[attr-defined]
    stats = sim.index.stats()  # type: ignore[attr-defined]
    assert sum(s["stored"] for s in stats.values()) > 0 and kv.index_bad_events == 0  # type: ignore[attr-defined]
    assert kv.router_decisions.get("prefix", 0) > 0  # type: ignore[attr-defined]
    assert kv.reuse <= unbounded_reuse(recs, BS) + 1e-9  # type: ignore[attr-defined]


def test_a_shared_pool_lets_round_robin_reuse_across_workers() -> None:
    recs = conversations(600, seed=2)
    _, plain = run("round-robin", recs, blocks=20)
    _, pooled = run("round-robin", recs, blocks=20, pool_blocks=4 * 400)
    assert pooled.reuse > plain.reuse + 0.1  # type: ignore[attr-defined]
    assert pooled.hit_tokens_by_tier.get("pool", 0) > 0  # type: ignore[attr-defined]
    assert pooled.reuse <= unbounded_reuse(recs, BS) + 1e-9  # type: ignore[attr-defined]


def test_engine_block_cache_evicts_free_blocks_least_recently_freed_first() -> None:
    gone: list[int] = []
    c = BlockCache(4, lambda ids, p: None, gone.extend)
    c.admit([1, 2], 0, 2)
    c.computed([1, 2], 0)
    c.release([1, 2], 0)  # free: 2 then 1 (tail first)
    assert c.prefix([1, 2, 3]) == 2
    c.admit([7, 8, 9], 0, 3)  # needs 3: one free block goes, the tail
    assert gone == [2] and c.prefix([1, 2]) == 1
    assert not c.can_admit([5], 0, 2)


@pytest.mark.slow
def test_bench_fleet_writes_the_issue_keys_without_dynamo(tmp_path: Path) -> None:
    from kvtier.bench.fleet import run_bench_fleet

    out = tmp_path / "fleet.json"
    code = run_bench_fleet(EXCERPT, out, None, workers=(2,), speeds=(1.0,), capacity_tokens=200_000, enforce=False)
    assert code == 0
    d = json.loads(out.read_text())
    for key in ("lru_hit_rate_3m", "best_policy", "best_policy_vs_belady_1m", "best_policy_vs_belady_3m",
                "router_reuse_vs_dynamo_min", "max_request_share_ratio", "shared_pool_round_robin_vs_infinite",
                "timing_model_ttft_error"):
        assert key in d
    assert d["router_reuse_vs_dynamo_min"] is None and d["timing_model_ttft_error"] is None
    assert d["cells"][0]["kvtier_kv-aware"]["requests"] == 300
    assert 0 < d["shared_pool_round_robin_vs_infinite"] <= 1.0 + 1e-9


def test_dynamo_driver_refuses_bad_cells_and_a_missing_python(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(DRIVER), str(EXCERPT), "--cells", "{"], capture_output=True, text=True)
    assert r.returncode == 2 and "--cells" in r.stderr
    with pytest.raises(DynamoError, match="no such file"):
        run_dynamo(tmp_path / "nope" / "python", EXCERPT, [])
    assert len(list(iter_trace(EXCERPT))) == 300


_FAKE_REPLAY = """
def run_trace_replay(trace, extra_engine_args, num_workers, replay_mode, router_mode,
                     arrival_speedup_ratio, trace_block_size):
    assert extra_engine_args["engine"]["num_gpu_blocks"] == 40 and trace_block_size == 64
    if router_mode == "round_robin" and num_workers == 3:
        raise RuntimeError("fake failure")
    return {"prefix_cache_reused_ratio": 0.5 if router_mode == "kv_router" else 0.25,
            "mean_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "num_requests": 300}
"""


def _fake_dynamo_python(tmp_path: Path) -> Path:
    """A 'Python' whose ``dynamo.replay`` is a fake (the real Dynamo is not needed)."""
    pkg = tmp_path / "site" / "dynamo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "replay.py").write_text(_FAKE_REPLAY)
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return py


def test_dynamo_driver_imports_dynamo_not_its_sibling_module(tmp_path: Path) -> None:
    """The driver's folder holds kvtier's dynamo.py: run as a script it must still import Dynamo's
    package (it did not: every cell failed with "'dynamo' is not a package")."""
    from kvtier.sim.fleet.dynamo import dynamo_cell

    cells = [dynamo_cell(w, r, 40, BS, 1.0) for w in (2, 3) for r in ("kv_router", "round_robin")]
    out = run_dynamo(_fake_dynamo_python(tmp_path), EXCERPT, cells)
    got = {(c["cell"]["workers"], c["cell"]["router"]): c for c in out["cells"]}
    assert got[(2, "kv_router")]["reuse"] == 0.5 and got[(2, "round_robin")]["reuse"] == 0.25
    assert "fake failure" in got[(3, "round_robin")]["error"]  # one cell failing leaves the others


@pytest.mark.slow
def test_bench_fleet_refuses_a_dynamo_that_fails_every_cell(tmp_path: Path) -> None:
    from kvtier.bench.common import BenchUsageError
    from kvtier.bench.fleet import run_bench_fleet

    broken = tmp_path / "python"  # a "Python" whose every cell fails, as Dynamo's import did
    broken.write_text(f"#!{sys.executable}\nimport json\n"
                      "print(json.dumps({'cells': [{'cell': {}, 'error': 'ImportError: no dynamo'}]}))\n")
    broken.chmod(0o755)
    with pytest.raises(BenchUsageError, match="failed in every cell.*no dynamo"):
        run_bench_fleet(EXCERPT, None, broken, workers=(2,), speeds=(1.0,), capacity_tokens=40 * 512,
                        block_size=512, enforce=False)


def test_a_request_larger_than_an_engine_is_refused_not_fatal() -> None:
    recs = conversations(50) + [TraceRecord(1e6, 100 * BS, 1, tuple(range(10_000, 10_100)))]
    sim, res = run("kv-aware", recs)
    assert sim.rejected == 1 and res.requests == 50  # type: ignore[attr-defined]
