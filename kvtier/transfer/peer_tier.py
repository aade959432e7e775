"""A peer kvtier instance as a read-only lower tier, over a transfer channel.

:class:`~kvtier.transfer.peer_server.PeerServer` (re-exported here) serves the chunks one
instance's :class:`StorageManager` holds *locally* (CPU or disk; never its own lower remote or
peer tiers, so peers never ask each other in circles) to authenticated peers.
:class:`PeerTier` is the other side: a :class:`~kvtier.tiers.base.LowerTier` whose
``contains_many`` / ``get_many_into`` ask that peer, so the storage manager promotes a
peer's chunks into its CPU tier like any other lower tier's.

Requests and replies are msgspec structs in control messages; chunks travel as one
channel batch per ``get_many_into``, straight into the caller's CPU slots. A peer that
is down, slow, vanishes mid-pull or sends a corrupt chunk is a miss (counted); the tier
reconnects on a later call (at most once per ``retry_s``). ``put_many`` stores nothing
(``writable`` is False: write-behind skips the tier).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import Any, Callable, Sequence

import msgspec

from kvtier.protocol.decoding import decode

from kvtier.serde.base import Buffer
from kvtier.tiers.base import (
    ChunkWrite,
    LowerTier,
    TierCounters,
    check_key,
    writable_view,
)
from kvtier.transfer.channel import TransferChannel
from kvtier.transfer.errors import TransferError
from kvtier.transfer.peer_server import PeerServer
from kvtier.transfer.peer_wire import BATCH_KEYS as _BATCH_KEYS
from kvtier.transfer.peer_wire import PeerReply, PeerRequest

__all__ = ["PeerReply", "PeerRequest", "PeerServer", "PeerTier", "ReadOnlyTier"]

log = logging.getLogger("kvtier.transfer.peer")


class ReadOnlyTier(LowerTier):
    """A lower tier that only serves reads: peers (this module, :mod:`.directed_peer`).

    Subclasses set ``self.counters`` (:class:`TierCounters`); stores are counted as failed.
    """

    counters: TierCounters  # (declared here, set by each subclass)

    @property
    def writable(self) -> bool:
        return False

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Read-only tier: stores nothing (the write-behind skips it since ``writable`` is False)."""
        self.counters.add(puts=len(items), put_failed=len(items))
        return [False] * len(items)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return 0

    def clear(self) -> int:
        return 0


class PeerTier(ReadOnlyTier):
    """A read-only lower tier backed by a peer's :class:`PeerServer`.

    Args:
        connect: opens a channel to the peer, e.g. ``lambda: TcpChannel.connect(host, port, 2.0)``;
            may raise :class:`TransferError` (the peer is down: misses).
        timeout_s: bound of each request, seconds (a get waits at most this long for its batch).
        retry_s: after a failure, calls are misses without trying for this long.
    """

    name = "peer"
    kind = "peer"

    def __init__(self, connect: Callable[[], TransferChannel], timeout_s: float = 2.0, retry_s: float = 1.0,
                 location: str = "peer"):
        self._connect = connect
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._location = location
        self._chan: TransferChannel | None = None
        self._down_until = 0.0
        self._closed = False
        self._lock = threading.Lock()
        self._reply = msgspec.msgpack.Decoder(PeerReply)
        self.counters = TierCounters()

    @property
    def location(self) -> str:
        return self._location

    def _channel(self) -> TransferChannel | None:
        if self._chan is not None and not getattr(self._chan, "closed", False):
            if not _closed_while_idle(self._chan):
                return self._chan
            self._chan.close()  # the server closed an idle link (its idle timeout, a restart): redial
            self._chan = None
        if self._closed or time.monotonic() < self._down_until:
            self.counters.add(skipped_calls=1)
            return None
        try:
            self._chan = self._connect()
        except TransferError as exc:
            self._failed(exc)
            return None
        return self._chan

    def ready(self) -> bool:
        """True if a channel to the peer is open now: the pooled one if the peer has not closed it
        (seen without a request: an idle link that turns readable is the peer's EOF), else one dialled
        now (outside the backoff after a failure). Sends no request; never raises."""
        with self._lock:
            return self._channel() is not None

    def _failed(self, exc: Exception) -> None:
        log.info("kvtier peer tier %s: %s (misses for %.1f s)", self._location, exc, self.retry_s)
        self.counters.add(errors=1)
        self._down_until = time.monotonic() + self.retry_s
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()

    def _ask(self, chan: TransferChannel, op: str, keys: list[bytes]) -> list[bool]:
        chan.send_control(msgspec.msgpack.encode(PeerRequest(op=op, keys=keys)), self.timeout_s)
        try:
            found = decode(self._reply, chan.recv_control(self.timeout_s)).found
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransferError(f"bad reply from the peer: {exc}") from None
        if len(found) != len(keys):
            raise TransferError("the peer answered for another number of keys")
        return found

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if len(keys) > _BATCH_KEYS:  # a request must fit one control frame
            return [f for i in range(0, len(keys), _BATCH_KEYS) for f in self.contains_many(keys[i : i + _BATCH_KEYS])]
        keys = [bytes(k) for k in keys]
        for k in keys:
            check_key(k)
        self.counters.add(contains_keys=len(keys))
        with self._lock:
            chan = self._channel()
            if chan is None or not keys:
                return [False] * len(keys)
            try:
                found = self._ask(chan, "contains", keys)
            except TransferError as exc:
                self._failed(exc)
                return [False] * len(keys)
        self.counters.add(contains_hits=sum(found))
        return found

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        if len(items) > _BATCH_KEYS:
            return [f for i in range(0, len(items), _BATCH_KEYS) for f in self.get_many_into(items[i : i + _BATCH_KEYS])]
        keys = [bytes(k) for k, _ in items]
        for k in keys:
            check_key(k)
        outs = [writable_view(out) for _, out in items]
        self.counters.add(gets=len(keys))
        with self._lock:
            chan = self._channel()
            if chan is None or not keys:
                self.counters.add(get_misses=len(keys))
                return [False] * len(keys)
            try:
                found = self._ask(chan, "get", keys)
                dests = [(k, o) for k, o, f in zip(keys, outs, found) if f]
                got = chan.recv_into(dests, self.timeout_s) if dests else []
            except TransferError as exc:
                self._failed(exc)
                self.counters.add(get_misses=len(keys))
                return [False] * len(keys)  # a peer gone mid-pull: every chunk of the call is a miss
        it = iter(got)
        result = [bool(next(it)) if f else False for f in found]
        corrupt = sum(f for f in found) - sum(result)
        hits = sum(result)
        self.counters.add(get_hits=hits, get_misses=len(keys) - hits - corrupt, get_corrupt=corrupt,
                          bytes_read=sum(len(o) for o, r in zip(outs, result) if r))
        return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()

    def stats(self) -> dict[str, Any]:
        return {**self.counters.snapshot(), "connected": self._chan is not None, "location": self._location}


def _closed_while_idle(chan: TransferChannel) -> bool:
    """True if an idle channel's socket is readable: between requests the server sends nothing, so
    that is its close (EOF) or a refusal, and the link must be dialled again."""
    sock = getattr(chan, "_sock", None)
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
