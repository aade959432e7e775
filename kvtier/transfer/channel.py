"""The one interface of kvtier's transfer channels (shared memory, TCP, NIXL).

A :class:`TransferChannel` is one end of a connected link between two kvtier
instances (or an instance and a peer). Either end may send; the other end takes
the batch with :meth:`~TransferChannel.recv_into`, straight into buffers the
caller owns (engine-side CPU slots), with no intermediate copy. The two ends take
turns: a ``send`` on one end is matched by a ``recv_into`` on the other, and small
:meth:`~TransferChannel.send_control` / :meth:`~TransferChannel.recv_control`
messages carry the users' own requests (a peer tier's lookups, a bench's commands).

Semantics every channel keeps (tests/test_transfer_channels.py checks each):

- **Bounded time.** Every call returns or raises within its ``timeout_s`` (default: the
  channel's) plus a small slack; a silent peer raises :class:`TransferTimeout`.
- **Typed errors.** Failures raise :class:`TransferError` subclasses, never anything
  else for I/O (programming errors such as a read-only destination raise
  ``TypeError``/``ValueError`` before any I/O).
- **Honest results.** ``recv_into`` returns True for a destination only if the whole
  payload arrived, has the sender's size and checksum (xxh3-64), and was written into
  that very buffer. A corrupt payload, a size that does not match the destination, or
  a key the caller did not ask for is a miss (counted in :meth:`stats`). When the
  peer dies mid-batch the error's ``received`` lists only chunks that completed.
- One thread uses a channel at a time (callers serialise; channels are not shared).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence, Union

import numpy as np
import xxhash

from kvtier.serde.base import Buffer, byte_view
from kvtier.tiers.base import AtomicCounters, check_key, writable_view
from kvtier.transfer.errors import TransferTimeout

#: A chunk to send: ``(key, payload)`` or ``(key, payload, checksum)``; the payload is a
#: C-contiguous buffer (uint8 numpy array, bytes, memoryview), only read during the call;
#: ``checksum`` (optional) is the payload's xxh3-64, as 8 bytes (``xxh3_64_digest``) or an int
#: (``xxh3_64_intdigest``, what ``kvtier server`` records at commit), so the sender need not
#: read the payload to hash it. A wrong one makes the receiver report a miss.
OutChunk = Union[tuple[bytes, Buffer], tuple[bytes, Buffer, Union[bytes, int]]]
#: A destination: ``(key, out)``; ``out`` a writable C-contiguous buffer of the payload's size.
InSlot = tuple[bytes, Buffer]

DEFAULT_TIMEOUT_S = 10.0


@dataclass
class ChannelCounters(AtomicCounters):
    """Monotonic counters of one channel end (chunks and bytes).

    Attributes:
        batches_sent / chunks_sent / bytes_sent: what ``send`` handed over.
        chunks_delivered: sent chunks the peer reported received.
        chunks_received / bytes_received: chunks written into destinations and verified.
        corrupt: payloads whose checksum did not match (misses).
        size_mismatch: payloads whose size differs from the destination (misses).
        unexpected: chunks for keys the caller did not ask for (dropped).
        errors: calls that raised a :class:`TransferError`.
    """

    batches_sent: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    chunks_delivered: int = 0
    chunks_received: int = 0
    bytes_received: int = 0
    corrupt: int = 0
    size_mismatch: int = 0
    unexpected: int = 0
    errors: int = 0


class Deadline:
    """A point on the monotonic clock ``timeout_s`` seconds from now."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        """Seconds left (> 0).

        Raises:
            TransferTimeout: none left.
        """
        left = self.at - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"transfer timed out after {self.timeout_s:.3g} s")
        return left


def check_out_chunks(chunks: Sequence[OutChunk]) -> list[tuple[bytes, memoryview, bytes | None]]:
    """Checked ``(key, flat uint8 view, 8-byte checksum or None)`` triples (no copy).

    Raises:
        TypeError/ValueError: a bad key, a payload that is not a C-contiguous buffer, a bad checksum.
    """
    out = []
    for item in chunks:
        key, payload = item[0], item[1]
        check_key(key)
        try:
            mv = byte_view(payload)
        except TypeError as exc:
            raise TypeError(f"payload must be a buffer, got {type(payload).__name__}") from exc
        if not mv.c_contiguous:
            raise ValueError("payload must be a C-contiguous buffer")
        digest = _digest(item[2]) if len(item) > 2 else None
        out.append((bytes(key), mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, digest))
    return out


def _digest(checksum: bytes | int | None) -> bytes | None:
    if checksum is None:
        return None
    if isinstance(checksum, int):
        return checksum.to_bytes(8, "big")
    if isinstance(checksum, (bytes, bytearray)) and len(checksum) == 8:
        return bytes(checksum)
    raise ValueError("a chunk checksum is the 8-byte xxh3-64 digest or its int")


def payload_digest(mv: memoryview, given: bytes | None) -> bytes:
    """``given``, or the xxh3-64 digest of ``mv`` (8 bytes, big-endian like ``xxh3_64_digest``)."""
    return given if given is not None else xxhash.xxh3_64_digest(mv)


def buffer_address(mv: memoryview) -> int:
    """The address of ``mv``'s first byte (a flat uint8 view), 0 for an empty one."""
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


def check_in_slots(dests: Sequence[InSlot]) -> tuple[list[memoryview], dict[bytes, int]]:
    """Writable flat views of the destinations and the index of each key.

    Raises:
        TypeError/ValueError: a bad key, a duplicate key, a read-only or non-contiguous buffer.
    """
    views: list[memoryview] = []
    index: dict[bytes, int] = {}
    for i, (key, out) in enumerate(dests):
        check_key(key)
        if key in index:
            raise ValueError(f"duplicate destination key {key.hex()[:16]}")
        index[bytes(key)] = i
        views.append(writable_view(out))
    return views, index


class TransferChannel(ABC):
    """One end of a connected transfer link; see the module docstring for the semantics."""

    #: Channel kind: ``"shm"``, ``"tcp"`` or ``"nixl"``.
    kind: ClassVar[str] = ""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.counters = ChannelCounters()

    def _deadline(self, timeout_s: float | None) -> Deadline:
        return Deadline(self.timeout_s if timeout_s is None else timeout_s)

    def _count_sent(self, items: Sequence[tuple[bytes, memoryview, bytes | None]], received: Sequence[bool]) -> None:
        """Count one batch sent (``items`` from :func:`check_out_chunks`) and the peer's verdicts."""
        self.counters.add(batches_sent=1, chunks_sent=len(items), bytes_sent=sum(len(it[1]) for it in items),
                          chunks_delivered=sum(received))

    def _slot_for(self, key: bytes, nbytes: int, views: list[memoryview], index: dict[bytes, int]) -> int | None:
        """The destination index of an incoming chunk, or None (counted) when the caller did not ask
        for ``key`` or its destination is not ``nbytes`` long."""
        i = index.get(key)
        if i is None:
            self.counters.add(unexpected=1)
            return None
        if len(views[i]) != nbytes:
            self.counters.add(size_mismatch=1)
            return None
        return i

    def _count_received(self, ok: bool, nbytes: int) -> None:
        """Count one chunk received: verified (``ok``) or corrupt."""
        self.counters.add(**({"chunks_received": 1, "bytes_received": nbytes} if ok else {"corrupt": 1}))

    @abstractmethod
    def send(self, chunks: Sequence[OutChunk], timeout_s: float | None = None) -> list[bool]:
        """Send a batch; returns, per chunk in order, whether the peer received it intact.

        Returns once the peer has answered for every chunk (its ``recv_into``), so the
        payload buffers may be reused afterwards.

        Raises:
            TransferError: timeout, the peer gone, or a protocol error (``received`` None).
            TypeError/ValueError: bad keys or payload buffers (before any I/O).
        """

    @abstractmethod
    def recv_into(self, dests: Sequence[InSlot], timeout_s: float | None = None) -> list[bool]:
        """Receive the peer's next batch into ``dests``; True per destination filled and verified.

        Keys the peer sends that are not among ``dests`` are dropped; destinations the
        batch does not carry stay False (their contents untouched). After False the
        contents of that destination are unspecified.

        Raises:
            TransferError: timeout, the peer gone mid-batch, or a malformed frame; its
                ``received`` holds the per-destination result of what completed before.
            TypeError/ValueError: bad keys or destination buffers (before any I/O).
        """

    @abstractmethod
    def send_control(self, body: bytes, timeout_s: float | None = None) -> None:
        """Send one small opaque message (at most ~60 KiB).

        Raises:
            TransferError: timeout or the peer gone.
        """

    @abstractmethod
    def recv_control(self, timeout_s: float | None = None) -> bytes:
        """The peer's next control message.

        Raises:
            TransferError: timeout, the peer gone, or the next frame is not a control message.
        """

    @abstractmethod
    def close(self) -> None:
        """Close the link (idempotent); later calls raise :class:`PeerGone`."""

    def stats(self) -> dict[str, Any]:
        """:class:`ChannelCounters` fields plus ``kind``."""
        return {"kind": self.kind, **self.counters.snapshot()}

    def __enter__(self) -> "TransferChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
