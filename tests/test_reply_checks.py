"""The client refuses a reply that hands out a slot out of range or twice (kvtier.service.reply_checks)."""

from __future__ import annotations

import pytest

from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.replies import HandleEntry
from kvtier.service.reply_checks import check_loaded, check_reserved, check_slot

K1, K2 = b"\x01" * 32, b"\x02" * 32


def _refused(fn: object, *args: object) -> str:
    with pytest.raises(ProtocolError) as e:
        fn(*args)  # type: ignore[operator]
    assert e.value.code == ErrorCode.BAD_REPLY
    return str(e.value)


@pytest.mark.parametrize("slot", [-1, 8, 1 << 40, True, 1.0, "0"])
def test_slot_outside_the_segment_is_refused(slot: object) -> None:
    _refused(check_slot, slot, 8)
    _refused(check_reserved, [0, slot], 8)
    if type(slot) is int:
        _refused(check_loaded, [HandleEntry(1, slot, "cpu")], [K1], 8)


def test_reserve_reply_granting_one_slot_twice_is_refused() -> None:
    assert "two keys" in _refused(check_reserved, [3, None, 3], 8)
    check_reserved([0, None, 7, None], 8)  # distinct, in range, gaps: fine
    check_reserved([], 8)


def test_load_reply_checks_handles_and_slot_owners() -> None:
    assert "twice" in _refused(check_loaded, [HandleEntry(5, 0, "cpu"), HandleEntry(5, 1, "cpu")], [K1, K2], 8)
    assert "different keys" in _refused(check_loaded, [HandleEntry(1, 2, "cpu"), HandleEntry(2, 2, "cpu")],
                                        [K1, K2], 8)
    assert "handles for" in _refused(check_loaded, [None, None, None], [K1, K2], 8)
    # the same key asked twice may share its slot (two reads of one chunk)
    check_loaded([HandleEntry(1, 2, "cpu"), None, HandleEntry(2, 2, "disk")], [K1, K2, K1], 8)


def test_client_refuses_a_load_many_reply_giving_two_keys_one_slot() -> None:
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from conftest import small_namespace
    from test_hostile_protocol_trial import V, FakeServer

    from kvtier.service.client import ServiceClient

    d = Path(tempfile.mkdtemp(prefix="kvrc-", dir="/tmp"))  # short: a Unix socket path
    fake = FakeServer(d, lambda r: {"v": V, "id": r["id"], "ok": True,
                                    "handles": [[1, 0, "cpu"], [2, 0, "cpu"]] if r["op"] == "load_many" else None})
    c = ServiceClient(fake.path, small_namespace(), "c", wait_connected_s=5, timeout_s=1.0)
    try:
        assert c.connected
        k1, k2 = os.urandom(32), os.urandom(32)
        assert c.open_read_many([(k1, None), (k2, k1)]) == [None, None]
        assert c.counters.disconnects == 1  # refused as BAD_REPLY: the server releases what it granted
    finally:
        c.close()
        fake.close()
        shutil.rmtree(d, ignore_errors=True)
