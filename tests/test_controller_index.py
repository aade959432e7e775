"""FleetIndex, registry and FleetState without sockets."""

from __future__ import annotations

import os

import pytest

from fleet_fakes import make_namespace
from kvtier.controller.index import FleetIndex
from kvtier.controller.registry import namespace_from_spec
from kvtier.controller.state import FleetState
from kvtier.index.keys import ChunkHasher
from kvtier.protocol.fleet import (
    FLEET_PROTOCOL_VERSION, Change, Changes, FleetProtocolError, Heartbeat, NamespaceInfo, Register, Snapshot,
    TierInfo, join_parents,
)

NS = make_namespace()
D = NS.digest()
H = ChunkHasher(NS)


def chain(n: int, start: int = 0, salt: str | None = None) -> list[bytes]:
    return H.keys(list(range(start, start + n * NS.chunk_size)), cache_salt=salt)


def blob(keys: list[bytes]) -> bytes:
    return b"".join(keys)


def parents(keys: list[bytes]) -> bytes:
    return join_parents([None] + keys[:-1])


def tiers(shared: bool = False) -> dict[str, TierInfo]:
    t = {"cpu": TierInfo("cpu", "cpu"), "disk": TierInfo("disk", "disk")}
    t["remote"] = TierInfo("remote", "redis://x", shared=shared)
    return t


def register(instance: str = "a", epoch: str = "e1", token: str = "", spec: bytes | None = None) -> Register:
    ns = NamespaceInfo(D, spec if spec is not None else NS.canonical_bytes(), NS.chunk_size, NS.chunk_bytes)
    return Register(instance, epoch, FLEET_PROTOCOL_VERSION, "embedded", "h", 1, [ns], list(tiers().values()), token)


def test_namespace_from_spec_round_trips_digest():
    ns = namespace_from_spec(NS.canonical_bytes())
    assert ns == NS and ns.digest() == D
    with pytest.raises(ValueError, match="JSON"):
        namespace_from_spec(b"\xff")
    with pytest.raises(ValueError, match="scheme"):
        namespace_from_spec(b'{"scheme": 99}')
    # a registration's spec is bounded to 4 KiB, which still nests 2,000 deep (json: RecursionError)
    with pytest.raises(ValueError, match="nested too deeply"):
        namespace_from_spec(b"[" * 2000 + b"]" * 2000)


def test_snapshot_parts_swap_on_last_and_longest_prefix():
    idx = FleetIndex()
    idx.add_instance("a", tiers(), [D])
    ks = chain(6)
    idx.apply_snapshot(Snapshot("a", "e", 1, D, "cpu", blob(ks[:3]), parents(ks)[: 3 * 32], last=False), "cpu")
    assert idx.longest_prefix("a", D, ks)["cpu"] == 0  # not swapped before the last part
    idx.apply_snapshot(Snapshot("a", "e", 1, D, "cpu", blob(ks[3:5]), parents(ks)[3 * 32: 5 * 32], last=True), "cpu")
    assert idx.longest_prefix("a", D, ks) == {"cpu": 5, "disk": 0, "remote": 0}
    # A chunk only in disk extends the any-tier match but not the cpu one.
    idx.apply_changes(Changes("a", "e", 1, [Change("s", D, "disk", ks[5])]))
    m = idx.match("a", D, ks)
    assert (m.per_tier["cpu"], m.per_tier["disk"], m.longest) == (5, 0, 6)


def test_changes_gap_marks_resync_and_snapshot_replays_newer_changes():
    idx = FleetIndex()
    idx.add_instance("a", tiers(), [D])
    ks = chain(4)
    idx.apply_changes(Changes("a", "e", 1, [Change("s", D, "cpu", blob(ks[:2]))]))
    assert "a" not in idx.needs_resync
    assert idx.apply_changes(Changes("a", "e", 3, [Change("s", D, "cpu", blob(ks[2:3]))])) is True
    assert "a" in idx.needs_resync
    idx.needs_resync.clear()
    # Change 4 arrives before the snapshot taken at seq 3: the swap must keep it.
    idx.apply_changes(Changes("a", "e", 4, [Change("r", D, "cpu", ks[0])]))
    idx.apply_snapshot(Snapshot("a", "e", 2, D, "cpu", blob(ks[:4]), parents(ks), last=True, seq=3), "cpu")
    assert ks[0] not in idx.keys_in("a", D, "cpu")
    assert idx.keys_in("a", D, "cpu") == set(ks[1:4])
    # A heartbeat ahead of the last applied seq means a lost Changes.
    assert idx.heartbeat_seq("a", 5) is True and "a" in idx.needs_resync


def test_shared_tier_is_one_table_and_survives_one_instance_drop():
    idx = FleetIndex()
    idx.add_instance("a", tiers(shared=True), [D])
    idx.add_instance("b", tiers(shared=True), [D])
    ks = chain(3)
    idx.apply_changes(Changes("a", "e", 1, [Change("s", D, "remote", blob(ks), parents(ks))]))
    assert idx.longest_prefix("b", D, ks)["remote"] == 3
    idx.drop_instance("a")
    assert idx.longest_prefix("b", D, ks)["remote"] == 3
    assert idx.longest_prefix("a", D, ks) == {}
    idx.drop_instance("b")
    assert idx._tables == {}



def test_a_snapshot_replaces_its_own_view_only_and_asks_no_other_sharer():
    """Removals reach the other sharers' views as changes (the agent never loses a shared tier's:
    kvtier.fleet.changes); a snapshot that shrinks a view asks nobody, so a store that evicts by
    itself (Redis LRU: every listing smaller than the last) cannot make the sharers relist it back to
    back, and a failed listing (sent empty) empties only its sender's view."""
    idx = FleetIndex()
    for inst in ("a", "b", "c"):
        idx.add_instance(inst, tiers(shared=True), [D])
    ks = chain(3)
    idx.apply_changes(Changes("a", "e", 1, [Change("s", D, "remote", blob(ks), parents(ks))]))
    idx.apply_snapshot(Snapshot("b", "e", 1, D, "remote", blob(ks), b"", last=True), "remote")
    idx.needs_resync.clear()
    idx.apply_snapshot(Snapshot("a", "e", 2, D, "remote", b"", b"", last=True, seq=1), "remote")
    assert idx.needs_resync == set()
    assert idx.longest_prefix("c", D, ks)["remote"] == 3  # b's view still holds them
    idx.apply_changes(Changes("a", "e", 2, [Change("c", D, "remote")]))  # the removal, as a change
    assert idx.longest_prefix("c", D, ks)["remote"] == 0 and idx.needs_resync == {"b", "c"}

def test_bad_key_lists_and_unknown_tiers_raise_protocol_errors():
    idx = FleetIndex()
    idx.add_instance("a", tiers(), [D])
    with pytest.raises(FleetProtocolError):
        idx.apply_changes(Changes("a", "e", 1, [Change("s", D, "cpu", b"x" * 33)]))
    with pytest.raises(FleetProtocolError):
        idx.apply_changes(Changes("a", "e", 2, [Change("s", D, "nvme", b"x" * 32)]))
    with pytest.raises(FleetProtocolError):
        idx.apply_snapshot(Snapshot("a", "e", 1, b"z" * 32, "cpu", b"", b"", last=True), "cpu")


def test_salt_scope_follows_lineage_markers_and_counts_unattributed_chunks():
    idx = FleetIndex()
    idx.add_instance("a", tiers(), [D])
    t1, t2, legacy = chain(3, salt="t1"), chain(2, start=7, salt="t2"), chain(2, start=20, salt="t1")
    idx.apply_changes(Changes("a", "e", 1, [
        Change("s", D, "cpu", blob(t1), join_parents([NS.lineage("t1")] + t1[:-1])),
        Change("s", D, "cpu", blob(t2), join_parents([NS.lineage("t2")] + t2[:-1])),
        Change("s", D, "cpu", blob(legacy), parents(legacy)),  # written without a lineage marker
        # the remote tier reports no parents (Redis after a resync): lineage comes from the cpu tier
        Change("s", D, "remote", blob(t1[:2])),
    ]))
    keys, unknown = idx.keys_of_salt("a", D, NS.lineage("t1"))
    assert set(keys) == set(t1) and unknown == len(legacy)
    remote, _ = idx.keys_of_salt("a", D, NS.lineage("t1"), "remote")
    assert set(remote) == set(t1[:2])
    assert idx.keys_of_salt("a", D, NS.lineage("nobody"))[0] == []


def test_state_register_token_epochs_and_expiry():
    st = FleetState(token="s3cret", expiry_s=0.5)
    refused = st.handle("a", register(token="wrong"))
    assert refused is not None and not refused.known and "wrong token" in refused.refused
    none = st.handle("a", register(token=""))
    assert none is not None and "sent no token" in none.refused and "KVTIER_CONTROLLER_TOKEN" in none.refused
    assert st.counters["refused_registrations"] == 2
    bad_spec = register(token="s3cret", spec=make_namespace("other").canonical_bytes())
    ack = st.handle("a", bad_spec)  # spec does not match the digest
    assert ack is not None and not ack.known and ack.refused
    assert "a" not in st.registry.ids()
    ack = st.handle("a", register(token="s3cret"), now=0.0)
    assert ack is not None and ack.known and ack.resync
    ks = chain(2)
    st.handle("a", Changes("a", "e1", 1, [Change("s", D, "cpu", blob(ks))]), now=0.1)
    assert st.index.longest_prefix("a", D, ks)["cpu"] == 2
    # Another epoch: the old index is dropped, listeners told.
    dropped: list[str] = []
    st.on_drop.append(dropped.append)
    st.handle("a", register(epoch="e2", token="s3cret"), now=0.2)
    assert dropped == ["a"] and st.index.longest_prefix("a", D, ks)["cpu"] == 0
    # Old-epoch messages are ignored; heartbeats of unknown instances get known=False.
    st.handle("a", Changes("a", "e1", 2, [Change("s", D, "cpu", blob(ks))]), now=0.3)
    assert st.index.longest_prefix("a", D, ks)["cpu"] == 0
    assert st.handle("zz", Heartbeat("zz", "e", 0)).known is False
    # Another connection with the record's (secret) epoch is the agent reconnected: replies go there now.
    assert st.handle("b", Heartbeat("a", "e2", 0), now=0.3).known is True
    assert st.registry.get("a").routing_id == b"b"
    # Another connection with another epoch cannot speak for it, nor take its id over (issue 24, kind 1).
    assert st.handle("c", Heartbeat("a", "e9", 0), now=0.3).known is False
    refused = st.handle("c", register(epoch="e9", token="s3cret"), now=0.3)
    assert not refused.known and "held by another live connection" in refused.refused and refused.retry_s > 0
    assert st.registry.get("a").epoch == "e2" and st.registry.get("a").routing_id == b"b"
    assert st.sweep(now=0.3 + 0.4) == []
    assert st.sweep(now=0.3 + 0.6) == ["a"]
    assert "a" not in st.registry and st.index.instances() == []


def test_lookup_of_128_chunks_is_dict_lookups_only():
    """Shape of the hot path: 3 instances x 3 tiers x 128 chunks (no timing asserted here)."""
    idx = FleetIndex()
    ks = [os.urandom(32) for _ in range(128)]
    for inst in "abc":
        idx.add_instance(inst, tiers(), [D])
        idx.apply_snapshot(Snapshot(inst, "e", 1, D, "disk", blob(ks), parents(ks), last=True), "disk")
    for inst in "abc":
        m = idx.match(inst, D, ks)
        assert m.longest == 128 and m.per_tier == {"cpu": 0, "disk": 128, "remote": 0}


def test_op_tracker_is_bounded_and_fails_overdue_records():
    from kvtier.controller.operations import OpTracker

    tr = OpTracker(history=3, grace_s=0.0)
    recs = [tr.create("clear", {}, deadline_s=60) for _ in range(3)]
    for r in recs[:2]:
        tr.done(r, {"tokens": 0})
    tr.create("clear", {}, deadline_s=60)
    assert tr.get(recs[0].event_id) is None  # oldest terminal record forgotten
    assert tr.get(recs[2].event_id)["state"] == "pending"  # live records are kept
    late = tr.create("move", {}, deadline_s=-1.0)
    out = tr.get(late.event_id)
    assert out["state"] == "failed" and "deadline" in out["reason"]
    tr.done(late, {})  # a terminal record never changes again
    assert tr.get(late.event_id)["state"] == "failed"
