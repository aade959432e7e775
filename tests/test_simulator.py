"""The eviction simulator: seeded traces, replay accounting, the chain check, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.sim.replay import replay
from kvtier.sim.run import simulate
from kvtier.sim.trace import TraceParams, generate
from kvtier.tiers.policies import POLICIES

SMALL = TraceParams(num_requests=120, num_documents=10, doc_tokens=2000, active_sessions=6)


def k(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.mark.parametrize("trace", ["multi-turn", "long-doc", "mixed"])
def test_traces_are_deterministic_per_seed(trace: str) -> None:
    a, b, c = generate(trace, 7, SMALL), generate(trace, 7, SMALL), generate(trace, 8, SMALL)
    assert len(a) == SMALL.num_requests
    assert all(np.array_equal(x.tokens, y.tokens) and x.source == y.source for x, y in zip(a, b))
    assert not all(len(x.tokens) == len(y.tokens) and np.array_equal(x.tokens, y.tokens) for x, y in zip(a, c))
    assert all(x.tokens.dtype == np.uint32 and int(x.tokens.max()) < SMALL.vocab_size for x in a)


def test_unknown_trace_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown trace 'chat'.*multi-turn"):
        generate("chat")


def test_multi_turn_sessions_grow_by_prefix_and_share_system_prompts() -> None:
    reqs = generate("multi-turn", 1, SMALL)
    by_session: dict[int, list[np.ndarray]] = {}
    for r in reqs:
        by_session.setdefault(r.source, []).append(r.tokens)
    grown = 0
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            assert len(cur) > len(prev) and np.array_equal(cur[: len(prev)], prev)
            grown += 1
    assert grown > 20
    firsts = [turns[0][: min(SMALL.system_prompt_tokens)].tobytes() for turns in by_session.values()]
    assert len(set(firsts)) <= len(SMALL.system_prompt_tokens) < len(firsts)


def test_long_doc_popularity_is_skewed_and_prompts_share_the_document() -> None:
    reqs = generate("long-doc", 2, SMALL)
    counts = np.bincount([r.source for r in reqs], minlength=SMALL.num_documents)
    assert counts.max() >= 4 * max(1, int(np.median(counts)))
    doc = int(counts.argmax())
    same = [r.tokens for r in reqs if r.source == doc]
    shared = min(len(t) for t in same) - 400  # questions are at most 400 tokens
    assert all(np.array_equal(t[:shared], same[0][:shared]) for t in same)


def test_replay_never_reports_the_whole_prompt_and_counts_tokens() -> None:
    a = [k(1), k(2), k(3)]
    prompts = [(3 * 16, a), (3 * 16, a), (3 * 16 + 5, a)]
    st = replay(prompts, 16, "lru", None)
    # second prompt: 3 chunks resident but the engine computes >= 1 token -> 2 chunks;
    # third prompt: 53 tokens -> all 3 chunks may hit.
    assert st.hit_tokens == 2 * 16 + 3 * 16
    assert st.prompt_tokens == 3 * 48 + 5 and st.stored_chunks == 3


def test_replay_respects_capacity_and_stores_chains_in_order() -> None:
    chain = [k(i) for i in range(5)]
    other = [k(10 + i) for i in range(5)]
    st = replay([(80, chain), (80, other), (80, chain)], 16, "lru", 5)
    # 'other' evicts the whole chain (tail first); the chain then misses entirely
    assert st.hit_tokens == 0 and st.evicted_chunks == 5 + 5 and st.chain_violations == 0


def test_replay_capacity_below_the_prompt_stores_what_fits() -> None:
    chain = [k(i) for i in range(6)]
    st = replay([(97, chain), (97, chain)], 16, "s3fifo", 3)
    # pinned prompt: only the first 3 chunks fit, and they hit the second time
    assert st.store_skipped == 3 + 3 and st.hit_tokens == 3 * 16


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_replays_a_trace_without_chain_violations(name: str) -> None:
    rep = simulate("mixed", capacities=[16, 64], policies=[name], seed=3, num_requests=150)
    for cap in (16, 64):
        st = rep.results[name][cap]
        assert st.chain_violations == 0
        assert 0 < st.hit_rate <= rep.ceiling.hit_rate
        assert st.evicted_chunks > 0


def test_simulate_defaults_and_errors() -> None:
    rep = simulate("long-doc", seed=0, num_requests=100)
    assert rep.capacities == sorted(rep.capacities) and rep.capacities[-1] <= rep.distinct_chunks
    json.dumps(rep.as_dict())
    with pytest.raises(ValueError, match="at least 1 chunk"):
        simulate("long-doc", capacities=[0], num_requests=10)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        simulate("long-doc", policies=["mru"], num_requests=10)


def test_cli_simulate_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    res = CliRunner().invoke(
        app,
        ["simulate", "--trace", "multi-turn", "--requests", "100", "--capacities", "8,32", "--json", str(out)],
    )
    assert res.exit_code == 0, res.output
    for name in POLICIES:
        assert name in res.output
    data = json.loads(out.read_text())
    assert data["trace"] == "multi-turn" and data["capacities_chunks"] == [8, 32]
    assert set(data["results"]) == set(POLICIES)
    assert 0 <= data["results"]["lru"]["8"]["hit_rate"] <= data["ceiling"]["hit_rate"]


def test_cli_simulate_bad_arguments_exit_2() -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["simulate", "--trace", "nope", "--requests", "5"]).exit_code == 2
    res = runner.invoke(app, ["simulate", "--capacities", "8,x", "--requests", "5"])
    assert res.exit_code == 2 and "--capacities" in res.output


def test_sim_tier_counts_a_policy_that_breaks_the_chain_rule() -> None:
    """The simulator's own check must see an eviction that leaves an unreachable chunk."""
    from collections import OrderedDict
    from typing import Iterator

    from kvtier.sim.replay import SimStats, SimTier
    from kvtier.tiers.policies import EvictionPolicy

    class ChainBlindFIFO(EvictionPolicy):
        def __init__(self) -> None:
            self.od: OrderedDict[bytes, None] = OrderedDict()

        def insert(self, key: bytes, parent: bytes | None = None) -> None:
            self.od[key] = None

        def touch(self, key: bytes) -> None:
            pass

        def remove(self, key: bytes) -> None:
            self.od.pop(key, None)

        def candidates(self) -> Iterator[bytes]:
            return iter(self.od)

        def __len__(self) -> int:
            return len(self.od)

    stats = SimStats("blind", 3)
    tier = SimTier(3, ChainBlindFIFO(), stats)
    for i in range(3):
        assert tier.store(k(i), k(i - 1) if i else None, set())
    assert tier.store(k(9), None, set())  # evicts k0, the head: k1, k2 become unreachable
    assert stats.chain_violations == 1
