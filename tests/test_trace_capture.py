"""Trace capture: the recorder's file (0600, first-sight ids, bounded), a real ``kvtier server``
workload replayed to its live hit rate, and the vLLM connector's capture; no token id, text or
key ever reaches the file."""

from __future__ import annotations

import json
import os
import random
import stat
import uuid
from pathlib import Path

import pytest

from kvtier.index.keys import ChunkHasher
from kvtier.service.server import CacheServer, ServerOptions
from kvtier.sim.trace_replay import replay_trace
from kvtier.storage.trace_file import TraceRecorder, iter_trace

from conftest import CHUNK, payload_for, small_namespace
from service_helpers import connect, server_config, short_dir  # noqa: F401 - fixture

#: Token ids far above any id a short trace can hand out, so a leaked one would show.
TOKEN_BASE = 7_000_000
TEXT = "Kimi, summarise the attached quarterly report"


def k(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _first_sight(path: Path) -> list[list[int]]:
    """The hash id lists of a trace, checking that ids are handed out 0, 1, 2... by first sight."""
    out, nxt = [], 0
    for rec in iter_trace(path, CHUNK):
        for h in rec.hash_ids:
            if h >= nxt:
                assert h == nxt, f"id {h} before {nxt}: not in order of first sight"
                nxt += 1
        out.append(list(rec.hash_ids))
    return out


def _assert_private_and_clean(path: Path, keys: list[bytes]) -> None:
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert TEXT not in text and "Kimi" not in text
    assert not any(str(TOKEN_BASE + j) in text for j in range(0, 5000, 7)), "a token id is in the trace"
    assert not any(key.hex()[:16] in text for key in keys[:50]), "a key is in the trace"
    for ln in text.splitlines():  # nothing but the four fields
        assert set(json.loads(ln)) == {"timestamp", "input_length", "output_length", "hash_ids"}


def test_recorder_maps_keys_by_first_sight_and_writes_a_private_file(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("old\n")
    os.chmod(p, 0o644)
    t = [0.0]
    rec = TraceRecorder(p, 16, clock=lambda: t[0])
    assert rec.record([k(5), k(6)], 32, 7)
    t[0] = 0.25
    assert rec.record([k(5), k(6), k(9)], 50, 0)  # 50 tokens: a partial block of its own
    rec.close()
    assert not rec.record([k(5)], 16)
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    assert lines == [{"timestamp": 0, "input_length": 32, "output_length": 7, "hash_ids": [0, 1]},
                     {"timestamp": 250, "input_length": 50, "output_length": 0, "hash_ids": [0, 1, 2, 3]}]
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="does not cover"):
        TraceRecorder(tmp_path / "u.jsonl", 16).record([k(1), k(2)], 20)
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(OSError):
        TraceRecorder(link, 16)


def test_recorder_stops_at_its_byte_and_id_bounds_with_a_whole_file(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    rec = TraceRecorder(p, 16, max_bytes=400)
    n = sum(rec.record([k(i), k(i + 1)], 32) for i in range(100))
    assert 0 < n < 100 and rec.full and rec.dropped == 100 - n and p.stat().st_size <= 400
    assert len(list(iter_trace(p, 16))) == n
    rec2 = TraceRecorder(tmp_path / "u.jsonl", 16, max_ids=5)
    assert rec2.record([k(1), k(2), k(3)], 48) and not rec2.record([k(4), k(5), k(6)], 48)
    assert rec2.stats()["records"] == 1


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Chat-like families: shared heads, growing turns (token ids from TOKEN_BASE on)."""
    heads = [[TOKEN_BASE + rng.randrange(5000) for _ in range(rng.randint(40, 120))] for _ in range(6)]
    sessions: list[list[int]] = []
    out = []
    for _ in range(n):
        if not sessions or rng.random() < 0.25:
            sessions.append(list(rng.choice(heads)))
        s = rng.choice(sessions)
        s.extend(TOKEN_BASE + rng.randrange(5000) for _ in range(rng.randint(5, 70)))
        out.append(list(s))
        if len(s) > 900:
            sessions.remove(s)
    return out


@pytest.mark.slow
def test_a_recorded_server_workload_replays_to_its_live_hit_rate(short_dir: Path) -> None:  # noqa: F811
    trace = short_dir / "captured.jsonl"
    cpu_chunks = 40
    cfg = server_config(cpu_chunks, None, trace_capture_path=trace)
    srv = CacheServer(cfg, ServerOptions(socket_path=str(short_dir / "s.sock"))).start()
    hasher = ChunkHasher(small_namespace())
    looked = hit = 0
    all_keys: list[bytes] = []
    try:
        c = connect(short_dir / "s.sock")
        for i, toks in enumerate(_prompts(random.Random(3), 400)):
            keys = hasher.keys(toks)[: max(0, (len(toks) - 1) // CHUNK)]  # as the connector looks up
            all_keys += keys
            owner = f"req-{i}"
            res = c.lookup_keys(keys, owner)
            n = res.num_tokens // CHUNK
            looked += len(keys)
            hit += n
            for j in range(n, len(keys)):  # the engine computed the rest: store it
                buf = c.open_write(keys[j], keys[j - 1] if j else None)
                if buf is None:
                    break
                buf[:] = payload_for(keys[j], c.chunk_bytes)
                c.commit(keys[j], keys[j - 1] if j else None)
            c.release(owner)
        c.close()
    finally:
        srv.close()
    live = hit / looked
    assert 0.2 < live < 0.95  # evictions happened and hits too
    _first_sight(trace)
    _assert_private_and_clean(trace, all_keys)
    rep = replay_trace(trace, [cpu_chunks * CHUNK], ["lru"], block_size=CHUNK, with_belady=False)
    assert rep.chunk_refs == looked
    assert rep.rate("lru", cpu_chunks * CHUNK) == pytest.approx(live, rel=0.02)


def test_the_vllm_connector_records_finished_requests(tmp_path: Path) -> None:
    from fake_vllm import FakeEngine, Geometry, make_connectors

    geom = Geometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=48)
    trace = tmp_path / "engine.jsonl"
    rng = random.Random(5)
    prompts = [([TOKEN_BASE + rng.randrange(5000) for _ in range(rng.randint(10, 150))], None) for _ in range(6)]
    extra = dict(chunk_size=32, cpu_capacity=16 * 32 * geom.token_bytes, model_id="fake/capture",
                 trace_capture_path=str(trace))
    pair = make_connectors(geom, extra, engine_id=f"capture-{uuid.uuid4().hex[:8]}")
    try:
        eng = FakeEngine(pair, geom, prompts, seed=1)
        eng.run(20, 5000)
    finally:
        pair.shutdown()
    recs = list(iter_trace(trace, 32))
    assert len(recs) == 20
    lengths = {len(t) for t, _ in prompts}
    assert all(r.input_length in lengths for r in recs)
    assert any(r.output_length >= 1 for r in recs)  # answer lengths (0 for a request aborted early)
    _first_sight_any(trace)
    _assert_private_and_clean(trace, [])


def _first_sight_any(path: Path) -> None:
    nxt = 0
    for rec in iter_trace(path, 32):
        for h in rec.hash_ids:
            assert h <= nxt
            nxt = max(nxt, h + 1)
