"""Production-trace replay: the Mooncake reader's errors, keys from hash ids, the ceilings, the
streamed multi-policy replay against a direct reference, the CLI, and bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.sim.belady import belady, unbounded
from kvtier.sim.blocks import BlockKeyer, block_tokens
from kvtier.sim.trace_replay import chunk_ids, parse_tokens, replay_trace
from kvtier.storage.trace_file import TraceFormatError, iter_trace, parse_line

EXCERPT = Path(__file__).parent / "fixtures" / "traces" / "mooncake_conversation_head300.jsonl"


def line(ts: float = 0, n_in: int = 1000, n_out: int = 10, ids: object = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": [0, 1] if ids is None else ids})


# -- the reader ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, field, what", [
    ("{not json", None, "not JSON"),
    ("[1, 2]", None, "JSON object"),
    (json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}), "hash_ids", "missing"),
    (line(n_in="10"), "input_length", "integer"),  # type: ignore[arg-type]
    (line(n_in=0), "input_length", "outside"),
    (line(n_out=-1), "output_length", "outside"),
    (line(ts=-5), "timestamp", ">= 0"),
    (line(ids="0,1"), "hash_ids", "list"),
    (line(ids=[0, -1]), "hash_ids", "item 1"),
    (line(ids=[0, 1.5]), "hash_ids", "item 1"),
    (line(ids=[0, 1, 2]), "hash_ids", "3 ids for input_length 1000"),
    ("[" * 5000 + "]" * 5000, None, "nested too deeply"),  # json recurses per level: RecursionError
    ('{"hash_ids": ' + "[" * 5000 + "]" * 5000 + "}", None, "nested too deeply"),
])
def test_a_malformed_line_names_the_line_and_the_field(tmp_path: Path, text: str, field: str | None,
                                                       what: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(line() + "\n\n" + text + "\n" + line() + "\n")
    with pytest.raises(TraceFormatError) as exc:
        list(iter_trace(p, 512))
    assert exc.value.line == 3 and exc.value.field == field
    assert what in str(exc.value) and "t.jsonl line 3" in str(exc.value)
    if field is not None:  # the message itself names the field, not only the attribute
        assert f"t.jsonl line 3, field {field!r}" in str(exc.value)


def test_timestamps_must_not_go_back_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(line(ts=5) + "\n\n" + line(ts=5) + "\n" + line(ts=4) + "\n")
    with pytest.raises(TraceFormatError, match="line 4, field 'timestamp'.*before"):
        list(iter_trace(p))
    recs = list(iter_trace(EXCERPT))
    assert len(recs) == 300 and recs[0].hash_ids[:3] == (0, 1, 2) and recs[0].input_length == 6758


def test_an_overlong_line_is_refused_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.storage.trace_file as tf

    monkeypatch.setattr(tf, "MAX_LINE_BYTES", 200)
    p = tmp_path / "t.jsonl"
    p.write_text(line() + "\n" + line(n_in=600 * 512, ids=list(range(600))) + "\n")
    with pytest.raises(TraceFormatError, match="line 2: longer than 200 bytes"):
        list(iter_trace(p))


# -- keys from hash ids ----------------------------------------------------------------------
def test_block_tokens_are_injective_and_keys_are_the_real_chain() -> None:
    a, b = block_tokens(7, 512), block_tokens(7, 512)
    assert (a == b).all() and a[0] == 7 and a[1] == 0 and not (block_tokens(8, 512) == a).all()
    rec = parse_line(line(n_in=1100, ids=[3, 9, 4]), 1, 512)
    keyer = BlockKeyer(256, 512, "every-block")
    keys = keyer.keys(rec)
    import numpy as np
    toks = np.concatenate([block_tokens(h, 512) for h in (3, 9, 4)])
    assert keys == keyer.hasher.keys(toks)  # the same keys as hashing the whole prompt
    eng = BlockKeyer(256, 512, "engine").keys(rec)
    assert eng == keys[:4]  # 1100 tokens: 4 full 256-token chunks, the partial block not keyed
    assert keyer.keys(rec) == keys and keyer.hashed_blocks == 3  # memoized


def test_belady_and_unbounded_on_a_hand_example() -> None:
    # capacity 2: a b | a c | a b  -> MIN keeps a and b (c is never used again)
    reqs = [(2, [1, 2]), (2, [1, 3]), (2, [1, 2])]
    got = belady(lambda: iter(reqs), [2, 3])
    assert got[2].hit_chunks == 1 + 2 and got[3].hit_chunks == 3
    assert unbounded(reqs).hit_chunks == 3
    assert chunk_ids(parse_line(line(n_in=1000, ids=[5, 6]), 1, 512), BlockKeyer(256, 512)) == (4, [10, 11, 12, 13])


def _reference_lru(recs: list, cap: int) -> float:
    od: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for r in recs:
        ids = r.hash_ids
        p = 0
        while p < len(ids) and ids[p] in od:
            p += 1
        for h in reversed(ids[:p]):
            od.move_to_end(h)
        hits += p
        total += len(ids)
        for h in ids[p:]:
            od[h] = None
            if len(od) > cap:
                od.popitem(last=False)
    return hits / total


def test_replay_of_the_excerpt_matches_a_direct_lru_and_stays_under_the_ceilings() -> None:
    caps = (100_000, 300_000)  # each request fits (a longer one than the cache: kvtier keeps its head)
    rep = replay_trace(EXCERPT, caps, ["lru", "a2q", "s3fifo"])
    recs = list(iter_trace(EXCERPT))
    for t in caps:
        assert rep.rate("lru", t) == pytest.approx(_reference_lru(recs, t // 512), abs=0.003)
        bel = rep.belady_rate(t)
        assert bel is not None
        for p in ("lru", "a2q", "s3fifo"):
            assert rep.rate(p, t) <= bel + 1e-9 <= rep.unbounded.chunk_hit_rate + 1e-9
            assert rep.results[p][t // 512].chain_violations == 0
    assert rep.chunk_refs == sum(len(r.hash_ids) for r in recs)
    json.dumps(rep.as_dict())


@pytest.mark.slow  # a CLI process and a matplotlib plot (~1.3 s)
def test_cli_replays_a_trace_file_with_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(app, ["simulate", "--trace-file", str(EXCERPT), "--capacity-tokens", "20k,100k",
                                   "--policies", "lru,a2q", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert set(data["hit_rate"]) == {"lru", "a2q"} and data["capacities_tokens"] == [20_000, 100_000]
    assert data["belady_hit_rate"]["100000"] >= data["hit_rate"]["a2q"]["100000"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_trace_line_exits_2_naming_it(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(line() + "\n" + line(ids=[0]) + "\n")
    res = CliRunner().invoke(app, ["simulate", "--trace-file", str(p)])
    assert res.exit_code == 2 and "bad.jsonl line 2" in res.output and "hash_ids" in res.output
    assert CliRunner().invoke(app, ["simulate", "--trace-file", str(p), "--capacity-tokens", "3Q"]).exit_code == 2
    assert parse_tokens("3M") == 3_000_000 and parse_tokens("100k") == 100_000


_RSS_SCRIPT = """
import json, sys
from kvtier.sim.trace_replay import replay_trace
n = int(sys.argv[2])
with open(sys.argv[1], "w") as f:
    for i in range(n):  # 2-block prompts: a shared head, then one of 50,000 recurring tails
        f.write(json.dumps({"timestamp": i, "input_length": 1000, "output_length": 1,
                            "hash_ids": [0, 1 + (i * 7919) % 50000]}) + "\\n")
rep = replay_trace(sys.argv[1], [512 * 1000], ["lru"], with_belady=False)
print(json.dumps({"requests": rep.requests, "rss": rep.max_rss_bytes}))
"""


@pytest.mark.slow  # over 5 s on 2 cores: out of the fast loop
def test_a_long_trace_replays_in_bounded_memory(tmp_path: Path) -> None:
    """Ten times the requests may not cost more memory than the ids' bitmap and noise."""
    def rss(n: int) -> int:
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / f"t{n}.jsonl"), str(n)],
                             capture_output=True, text=True, check=True, timeout=900).stdout
        got = json.loads(out.splitlines()[-1])
        assert got["requests"] == n
        return got["rss"]

    small, big = rss(20_000), rss(200_000)
    assert big - small < 24 << 20, (small, big)


def test_chunk_capacities_with_a_trace_file_are_a_usage_error(tmp_path: Path) -> None:
    """--capacities (chunks, synthetic traces) beside --trace-file was silently ignored (the replay
    showed its default token capacities); it is a usage error naming the option to use."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n")
    res = CliRunner().invoke(app, ["simulate", "--trace-file", str(trace), "--capacities", "0,-1"])
    assert res.exit_code == 2, res.output
    assert "--capacity-tokens" in res.output
