"""The engine-side client of ``kvtier server``: a :class:`kvtier.storage.backend.KVStore`.

``ServiceClient`` has the storage interface of the embedded
:class:`~kvtier.storage.manager.StorageManager`, so a connector switches between
the two with one setting. Buffers it returns (``open_write`` and
``ReadHandle.buffer``) are ``uint8 [chunk_bytes]`` views of the server's
shared-memory segment mapped into this process: the copy into or out of them is
the only payload copy, and no payload byte crosses the socket.

Failures are misses (lookups find nothing, ``open_write``/``open_read`` give
None or a skip, commits are dropped); the connection, its timeouts and its
reconnect back-off are :class:`kvtier.service.connection.ServiceConnection`.
Reservations and read handles belong to one connection (its generation): a
commit or close for an older connection is dropped, never applied to a new one.

Not fork-safe: create the client in the process that uses it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import fields
from typing import Any, Sequence

import msgspec
import numpy as np

from kvtier import protocol as P
from kvtier.index.keys import KeyNamespace
from kvtier.protocol import Backoff, parse_address
from kvtier.protocol.messages import KVRegister
from kvtier.protocol.replies import LoadManyReply, LookupReply, ReserveManyReply
from kvtier.service.client_blocks import EngineBlockCopies
from kvtier.service.connection import ClientCounters, Conn, ServiceConnection
from kvtier.service.load_verifier import BAD, GOOD, PENDING, LoadVerifier
from kvtier.service.reply_checks import check_loaded, check_reserved, write_skip
from kvtier.service.request_split import fits_one_frame, request_or_none
from kvtier.storage.types import ChunkUnavailable, LookupResult, WriteSkip

__all__ = ["ClientCounters", "ServiceClient", "ServiceReadHandle", "ServiceUnavailable", "parse_address"]


#: Most items of one ``load_many`` request: 32-byte keys plus a parent of up to 34 bytes each stay
#: well inside ``MAX_FRAME_BYTES`` (the server bounds what one connection holds far lower anyway).
LOAD_BATCH = 8192

log = logging.getLogger(__name__)

# One cached decoder per typed reply (kvtier.protocol.replies); built once, never changed.
_LOOKUP = msgspec.msgpack.Decoder(LookupReply)
_RESERVE_MANY = msgspec.msgpack.Decoder(ReserveManyReply)
_LOAD_MANY = msgspec.msgpack.Decoder(LoadManyReply)


class ServiceUnavailable(RuntimeError):
    """Raised only by :meth:`ServiceClient.wait_connected` when no connection came up in time."""


class ServiceReadHandle:
    """A chunk held for reading in the server: ``buffer`` stays valid until ``close()``.

    Attributes:
        key: chunk key.
        buffer: ``uint8 [chunk_bytes]`` view of the slot in this process's mapping. With
            client-side verification (:mod:`kvtier.service.load_verifier`) the first access
            waits for the chunk's checksum verdict and raises
            :class:`~kvtier.storage.types.ChunkUnavailable` if the slot's bytes differ from
            the chunk's commit checksum (a miss from this chunk on).
        source: tier kind that served it ("cpu", or the lower tier it was promoted from).
    """

    __slots__ = ("_client", "_gen", "_handle", "key", "view", "source", "expected", "verdict", "closed", "taken")

    def __init__(self, client: "ServiceClient", gen: int, handle: int, key: bytes, buffer: np.ndarray, source: str,
                 expected: int | None = None):
        self._client: ServiceClient | None = client
        self._gen = gen
        self._handle = handle
        self.key = key
        self.view = buffer
        self.source = source
        self.expected = 0 if expected is None else expected
        self.verdict = GOOD if expected is None else PENDING  # GOOD: checked by the server, or nothing to check
        self.closed = False
        self.taken = False  # picked up for checking (by the helper thread or the caller)

    @property
    def buffer(self) -> np.ndarray:
        if self.verdict != GOOD:
            client = self._client
            verdict = client._verifier.wait(self) if client is not None else self.verdict
            if verdict != GOOD:
                why = ("differ from its commit checksum" if verdict == BAD else
                       "were not verified: the client is closed" if client is not None and client._verifier.closed
                       else "could not be verified in time")
                raise ChunkUnavailable(f"kvtier: the bytes of chunk {self.key.hex()[:16]} {why}; a miss")
        return self.view

    def check_beside(self) -> bool:
        """Hand this chunk to the verifier's helper thread, to be hashed while the caller copies
        it; True if handed (copy from :attr:`view`, then read :attr:`buffer`, which waits for the
        verdict), False where there is no helper or nothing left to check. Both read the slot at
        once, so it comes from memory about once (:func:`kvtier.integrations.block_copy.load_handle`)."""
        client = self._client
        if self.verdict != PENDING or client is None or self.taken:
            return False
        return client._verifier.submit_now(self)

    def claim(self) -> int | None:
        """The commit checksum to check this chunk against while copying it, or None when there is
        nothing left to check (verified already, by the server or here) or the helper thread is on it
        (then read :attr:`buffer`, which waits for it). A caller that gets a checksum must call
        :meth:`settle` with its verdict (:func:`kvtier.integrations.block_copy.load_blocks_checked`)."""
        client = self._client
        if self.verdict != PENDING or client is None:
            return None
        return self.expected if client._verifier.claim(self) else None

    def unclaim(self) -> None:
        """Give back a :meth:`claim` whose check did not finish (the copy raised): the chunk is
        pending again, for the next reader to check."""
        client = self._client
        if client is not None:
            client._verifier.unclaim(self)

    def settle(self, ok: bool) -> None:
        """Record the verdict of a check made by the caller after :meth:`claim` (a mismatch is
        reported to the server when the handle closes)."""
        client = self._client
        if client is not None:
            client._verifier.settle(self, ok)
        else:
            self.verdict = GOOD if ok else BAD

    def close(self) -> None:
        client, self._client = self._client, None
        self.closed = True
        if client is not None:
            client._unload(self._gen, self._handle, corrupt=self.verdict == BAD)

    def __enter__(self) -> "ServiceReadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServiceClient:
    """Storage client of a ``kvtier server`` for one key namespace.

    Args:
        address: ``unix:///path/to.sock`` (or a bare path) or ``tcp://host:port``.
            A Unix socket's directory must be owned by this user and not
            group/other-writable (else the client refuses to connect).
        namespace: this engine's key namespace; the server refuses a namespace it
            cannot host, and ``chunk_bytes`` must match its slots.
        client_id: engine identity (<= 256 chars). Connections with the same id
            share lease owners (an engine's scheduler and worker); use a distinct
            id per engine. Default: unique per client.
        timeout_s: bound on each data-plane call, seconds.
        connect_timeout_s: bound on connecting and registering (in the
            background thread; the first registration may wait while the server
            allocates the namespace's pool).
        backoff_min_s / backoff_max_s: reconnect back-off range, seconds.
        token: secret for a TCP server (ignored on Unix sockets).
        wait_connected_s: if > 0, wait up to this long for the first connection
            (no error if it does not come; calls are then misses).
        sync_commit: wait for the server to acknowledge each commit. Default
            False: a commit is sent one-way; it is applied before any later
            request of this client, and other clients see it microseconds later
            (until then a lookup misses it, which is safe). :meth:`flush` waits
            for every commit sent before it.
        verify: who checks a loaded CPU chunk against its commit checksum: ``"server"``
            (before it answers; the default) or ``"client"`` (this process, beside or in
            the caller's copies, :mod:`kvtier.service.load_verifier`; a
            handle's ``buffer`` then raises ``ChunkUnavailable`` for a chunk that fails,
            so use it where the caller treats that as a miss, as the vLLM connector does).
        verify_helper: with ``verify="client"``, hash each chunk on a helper thread while the
            caller copies it (True: faster where a second core is free, but the hash and the copy
            are two reads of the slot, so a scribble between them passes, as with the server's
            check), or in the caller's own copy, each copied run hashed from its destination (False,
            the default: the hash covers exactly the bytes the engine received). Measured in
            ``kvtier bench server``.

    Raises:
        ValueError: malformed address or non-positive timeouts, a ``verify`` or ``verify_helper``
            outside its values, ``verify_helper=True`` without ``verify="client"``, or a namespace the protocol
            cannot carry (``ProtocolError``, e.g. a model name over 1,024 characters).
    """

    def __init__(
        self,
        address: str,
        namespace: KeyNamespace,
        client_id: str | None = None,
        *,
        timeout_s: float = 0.5,
        connect_timeout_s: float = 30.0,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = 2.0,
        token: str | None = None,
        wait_connected_s: float = 0.0,
        sync_commit: bool = False,
        verify: str = "server",
        verify_helper: bool = False,
    ):
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if verify not in ("server", "client"):
            raise ValueError(f"verify must be 'server' or 'client', got {verify!r}")
        if not isinstance(verify_helper, bool):
            raise ValueError(f"verify_helper must be True or False, got {verify_helper!r}")
        if verify_helper and verify != "client":  # it would be silently unused: the server checks
            raise ValueError("verify_helper=True needs verify='client' (with verify='server' the server checks every load)")
        self.verify = verify
        self._verifier = LoadVerifier(helper=verify_helper)
        self.address = address
        family, addr = parse_address(address)
        self.namespace = namespace
        self.chunk_bytes = namespace.chunk_bytes
        self.chunk_size = namespace.chunk_size
        self.client_id = client_id or f"pid{os.getpid()}-{os.urandom(4).hex()}"
        if not 0 < len(self.client_id) <= P.MAX_NAME_CHARS:
            raise ValueError("client_id must have 1 to 256 characters")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.sync_commit = sync_commit
        self.counters = ClientCounters()
        self._writes: dict[bytes, int] = {}  # key -> generation of the connection that reserved it
        self._writes_lock = threading.Lock()
        reg = P.Register(self.client_id, os.getpid(), namespace, namespace.digest(), self.chunk_bytes, token)
        self._link = ServiceConnection(
            family, addr, reg, timeout_s, connect_timeout_s, Backoff(backoff_min_s, backoff_max_s), self.counters
        )
        self._blocks = EngineBlockCopies(self._link, timeout_s)
        if wait_connected_s > 0:
            self._link.connected_event.wait(wait_connected_s)

    # -- connection ------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._link.conn is not None

    @property
    def server_pid(self) -> int | None:
        return self._link.server_pid

    def wait_connected(self, timeout_s: float) -> None:
        """Block until registered with the server.

        Raises:
            ServiceUnavailable: not connected within ``timeout_s``.
        """
        if not self._link.connected_event.wait(timeout_s):
            raise ServiceUnavailable(f"kvtier server at {self.address} not reachable within {timeout_s} s")

    # -- KVStore: lookups and leases --------------------------------------------------------------
    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` held by the server's tiers; leased to ``lease_owner`` if given.

        Returns ``LookupResult(0)`` on any failure; the lease does not outlive a
        failed call (the server ends it on an error, a dropped connection ends
        it, and an unusable reply is answered with a release).
        """
        keys = list(keys[: P.MAX_KEYS])
        reply, conn = self._link.call_typed(P.Lookup(keys, lease_owner), _LOOKUP)
        codes = None if reply is None else reply.tiers
        tiers = P.decode_tiers(codes) if codes is not None and len(codes) <= len(keys) else None
        if tiers is None:
            if lease_owner is not None and conn is not None:
                self.release(lease_owner)
            return LookupResult(0)
        n = len(tiers)
        return LookupResult(n * self.chunk_size, keys[:n], tiers)

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease (no-op when unreachable: the server's TTL or disconnect ends it)."""
        self._link.call(P.ReleaseLease(lease_owner))

    def contains(self, key: bytes) -> bool:
        reply, _ = self._link.call(P.Contains(key))
        return bool(reply and reply.get("hit") is True)

    # -- KVStore: write path ------------------------------------------------------------------------
    def open_write(self, key: bytes, parent: bytes | None) -> np.ndarray | None:
        """Reserve a slot for ``key``; returns its ``uint8 [chunk_bytes]`` view to fill, or None.

        None: already stored, being written by another client, no room, or the
        server is unreachable (:meth:`open_write_many` says which). Follow with
        :meth:`commit` or :meth:`abort`.
        """
        got = self.open_write_many([key], [parent])[0]
        return got if isinstance(got, np.ndarray) else None

    def open_write_many(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None]
    ) -> list[np.ndarray | WriteSkip]:
        """Reserve slots for many distinct keys in one round trip (two or more when the request
        would not fit one frame, :mod:`kvtier.service.request_split`).

        ``parents`` (required, one per key; None for a prompt's first chunk): each
        chunk's chain parent, so making room never evicts it.

        Returns, per key in order, its slot view (``uint8 [chunk_bytes]``) or why
        there is none: ``WriteSkip.PRESENT`` (stored), ``IN_FLIGHT`` (another
        writer holds an uncommitted reservation: go on with the rest of the
        chain) or ``NO_ROOM`` (also for a failed call: stop storing the chain).
        """
        if parents is None or len(parents) != len(keys):
            raise ValueError(f"{'no' if parents is None else len(parents)} parents for {len(keys)} keys: "
                             "pass each chunk's parent (None for a prompt's first chunk)")
        if not keys:
            return []
        if len(keys) > 1 and not fits_one_frame(len(keys)):  # in two frames: the first half's skips stop the rest
            h = len(keys) // 2
            first = self.open_write_many(keys[:h], parents[:h])
            if WriteSkip.NO_ROOM in first:
                return first + [WriteSkip.NO_ROOM] * (len(keys) - h)
            return first + self.open_write_many(keys[h:], parents[h:])
        req = request_or_none(lambda: P.ReserveMany(list(keys), list(parents)))
        reply, conn = (None, None) if req is None else self._link.call_typed(req, _RESERVE_MANY,
                                                                             check=_check_reserved)
        slots = None if reply is None else reply.slots
        if reply is None or conn is None or slots is None or len(slots) != len(keys):
            return [WriteSkip.NO_ROOM] * len(keys)
        skips = reply.skips
        if skips is None or len(skips) != len(keys):
            skips = [0] * len(keys)  # a reply without reasons: no slot means stop the chain
        out: list[np.ndarray | WriteSkip] = []
        with self._writes_lock:
            for key, slot, skip in zip(keys, slots, skips):
                view = conn.slot(slot)
                if view is not None:
                    self._writes[key] = conn.gen
                    out.append(view)
                else:
                    out.append(write_skip(skip))
        return out

    def commit(self, key: bytes, parent: bytes | None) -> None:
        """Publish a filled slot (acknowledged only with ``sync_commit``; see the constructor)."""
        with self._writes_lock:
            gen = self._writes.pop(key, None)
        if gen is None:
            return
        req = request_or_none(lambda: P.Commit(key, parent))
        reply, _ = (None, None) if req is None else self._link.call(req, noreply=not self.sync_commit, gen=gen)
        if reply is None:
            self.counters.lost_stores += 1

    def abort(self, key: bytes) -> None:
        with self._writes_lock:
            gen = self._writes.pop(key, None)
        if gen is not None:
            self._link.call(P.Abort(key), gen=gen)

    # -- KVStore: read path ---------------------------------------------------------------------------
    def open_read(self, key: bytes, parent: bytes | None = None) -> ServiceReadHandle | None:
        """Hold ``key`` for reading in the server; None on a miss or failure."""
        return self.open_read_many([(key, parent)])[0]

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[ServiceReadHandle | None]:
        """Read references on many ``(key, parent)`` pairs in one round trip.

        Returns one handle or None per item, in order (close every handle); all
        None on a failure.
        """
        items = list(items)
        if not items:
            return []
        if len(items) > LOAD_BATCH:  # each request fits one frame (keys, and parents of up to 34 B each)
            return [*self.open_read_many(items[:LOAD_BATCH]), *self.open_read_many(items[LOAD_BATCH:])]
        mine = self.verify == "client"
        req = request_or_none(lambda: P.LoadMany([k for k, _ in items], [p for _, p in items], mine))
        keys = [k for k, _ in items]
        reply, conn = (None, None) if req is None else self._link.call_typed(
            req, _LOAD_MANY, check=lambda r, c: check_loaded(r.handles or [], keys, c.num_slots))
        out: list[ServiceReadHandle | None] = [None] * len(items)
        got = reply.handles if reply is not None else None
        if conn is None or got is None or len(got) != len(items):
            return out
        for i, entry in enumerate(got):
            # [handle, slot, source] (checked by the server) or, when asked, [handle, slot, source, sum | nil]
            if entry is None:
                continue
            view = conn.slot(entry.slot)
            if view is None:
                self._unload(conn.gen, entry.handle)
                continue
            h = ServiceReadHandle(self, conn.gen, entry.handle, items[i][0], view, entry.source,
                                  entry.checksum if mine else None)
            out[i] = h  # checked when it is copied (load_handle) or its buffer is first read
        return out

    def _unload(self, gen: int, handle: int, corrupt: bool = False) -> None:
        if corrupt:
            self.counters.corrupt_loads += 1
        self._link.call(P.Unload(handle, corrupt), noreply=True, gen=gen)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the server to promote these chunks into its CPU tier; returns how many were queued."""
        reply, _ = self._link.call(P.Prefetch(list(keys[: P.MAX_KEYS])))
        q = reply.get("queued") if reply else 0
        return q if type(q) is int else 0

    # -- copies by engine block id: kvtier.service.client_blocks ----------------------------------------
    def register_kv(self, request: KVRegister, timeout_s: float = 30.0) -> dict[str, Any] | None:
        """:meth:`EngineBlockCopies.register_kv <kvtier.service.client_blocks.EngineBlockCopies.register_kv>`."""
        return self._blocks.register_kv(request, timeout_s)

    def release_kv(self) -> bool:
        """:meth:`EngineBlockCopies.release_kv <kvtier.service.client_blocks.EngineBlockCopies.release_kv>`."""
        return self._blocks.release_kv()

    def store_blocks(self, keys: Sequence[bytes], blocks: Sequence[Sequence[int]],
                     parents: Sequence[bytes | None], timeout_s: float = 30.0) -> list[WriteSkip | None]:
        """:meth:`EngineBlockCopies.store_blocks <kvtier.service.client_blocks.EngineBlockCopies.store_blocks>`."""
        return self._blocks.store_blocks(keys, blocks, parents, timeout_s)

    def load_blocks(self, keys: Sequence[bytes], parents: Sequence[bytes | None], blocks: Sequence[Sequence[int]],
                    offsets: Sequence[int] | None = None, timeout_s: float = 30.0) -> list[str | None]:
        """:meth:`EngineBlockCopies.load_blocks <kvtier.service.client_blocks.EngineBlockCopies.load_blocks>`."""
        return self._blocks.load_blocks(keys, parents, blocks, offsets, timeout_s)

    # -- KVStore: admin ---------------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (up to ``timeout_s``, default 10 s, at most 60 s) for the server's write-behind."""
        t = min(60.0, 10.0 if timeout_s is None else max(0.0, timeout_s))
        reply, _ = self._link.call(P.Flush(t), timeout_s=t + self.timeout_s)
        return bool(reply and reply.get("done"))

    def clear(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Remove every unreferenced chunk of this namespace from every server tier; chunks removed per tier."""
        reply, _ = self._link.call(P.Clear(), timeout_s=timeout_s)
        removed = reply.get("removed") if reply else None
        return dict(removed) if isinstance(removed, dict) else {}

    def health(self) -> dict[str, Any] | None:
        reply, _ = self._link.call(P.Health())
        return reply

    def stats(self, timeout_s: float = 5.0) -> dict[str, int | float]:
        """The server's counters for this namespace plus this client's (``client_*``)."""
        reply, _ = self._link.call(P.Stats(), timeout_s=timeout_s)
        out: dict[str, int | float] = {}
        st = reply.get("stats") if reply else None
        if isinstance(st, dict):
            out.update({k: v for k, v in st.items() if isinstance(k, str) and type(v) in (int, float)})
        out["client_connected"] = int(self.connected)
        for f in fields(ClientCounters):
            out[f"client_{f.name}"] = getattr(self.counters, f.name)
        return out

    def close(self) -> None:
        """Disconnect (the server releases this client's reservations, reads and leases)."""
        self._verifier.close()
        self._link.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_reserved(reply: ReserveManyReply, conn: Conn) -> None:
    """Refuse (BAD_REPLY, a miss) a ``reserve_many`` reply granting a slot out of range or twice."""
    check_reserved(reply.slots or [], conn.num_slots)
