"""The client's checks of every slot and handle a reply hands it, before any view is made.

A slot index becomes a writable (``reserve``/``reserve_many``) or readable
(``load``/``load_many``) view of the shared segment, so a reply is refused whole
(``ProtocolError(BAD_REPLY)``: the connection drops, the server releases what it granted,
the call is a miss) when it

- names a slot outside ``[0, num_slots)`` of the mapped segment, or not an integer;
- grants one slot twice for writing (two keys' bytes would land in one chunk);
- hands the same read handle out twice (closing one would end the other's read);
- hands one slot to two different keys for reading (a read of one key would see another's
  bytes; the same key asked twice may share its slot).

The checks take the reply's lists as decoded (:mod:`kvtier.protocol.replies`) and run
in O(n) for n entries.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.replies import HandleEntry
from kvtier.storage.types import WriteSkip


def _bad(why: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REPLY, f"server reply refused: {why}")


def check_slot(slot: object, num_slots: int) -> int:
    """``slot`` itself if it is an int in ``[0, num_slots)``.

    Raises:
        ProtocolError: ``BAD_REPLY`` otherwise.
    """
    if type(slot) is not int or not 0 <= slot < num_slots:
        raise _bad(f"slot {slot!r} is not one of the segment's {num_slots} slots")
    return slot


def check_reserved(slots: Sequence[object], num_slots: int) -> None:
    """Check the slots of a ``reserve``/``reserve_many`` reply (None: no slot for that key).

    Raises:
        ProtocolError: ``BAD_REPLY``: a slot out of range, or one slot granted twice.
    """
    seen: set[int] = set()
    for s in slots:
        if s is None:
            continue
        slot = check_slot(s, num_slots)
        if slot in seen:
            raise _bad(f"slot {slot} granted to two keys")
        seen.add(slot)


def check_loaded(entries: Sequence[HandleEntry | None], keys: Sequence[bytes], num_slots: int) -> None:
    """Check the entries of a ``load``/``load_many`` reply, ``entries[i]`` for ``keys[i]``.

    Raises:
        ProtocolError: ``BAD_REPLY``: more entries than keys, a slot out of range, a handle
            given twice, or one slot given to two different keys.
    """
    if len(entries) > len(keys):
        raise _bad(f"{len(entries)} handles for {len(keys)} keys")
    handles: set[int] = set()
    owner: dict[int, bytes] = {}
    for e, key in zip(entries, keys):
        if e is None:
            continue
        slot = check_slot(e.slot, num_slots)
        if e.handle in handles:
            raise _bad(f"read handle {e.handle} given twice")
        handles.add(e.handle)
        if owner.setdefault(slot, key) != key:
            raise _bad(f"slot {slot} given to two different keys")


__all__ = ["check_loaded", "check_reserved", "check_slot"]


def write_skip(v: object) -> WriteSkip:
    """A reply's skip code as a :class:`WriteSkip` (anything unknown: ``NO_ROOM``, stop the chain)."""
    try:
        return WriteSkip(v) if type(v) is int and v else WriteSkip.NO_ROOM
    except ValueError:
        return WriteSkip.NO_ROOM
