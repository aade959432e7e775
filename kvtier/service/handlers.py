"""The cache service's per-op handlers for registered clients (one concept: what each op does).

Each handler takes the connection's :class:`Holds`, its :class:`Registered`
state (namespace host never None) and the decoded request, and returns the
reply's fields. Holds are recorded at the moment they are taken; a handler
that fails midway gives back what it took before the error reply (no
reservation, read reference or lease outlives a failed call).
"""

from __future__ import annotations

import logging
import queue
from typing import Any, Callable

import numpy as np

from kvtier.index.keys import chain_parents
from kvtier.protocol import (
    Abort,
    Clear,
    Commit,
    Contains,
    ErrorCode,
    Flush,
    Load,
    LoadMany,
    Lookup,
    Prefetch,
    ProtocolError,
    ReleaseLease,
    Reserve,
    ReserveMany,
    Stats,
    Unload,
)
from kvtier.service.lease_ops import lookup_op, release_op
from kvtier.service.metrics import ServerMetrics
from kvtier.service.namespace_host import NamespaceHost
from kvtier.service.session import Holds, Registered
from kvtier.storage.types import WriteSkip

log = logging.getLogger(__name__)

Handler = Callable[[Holds, Registered, Any], dict[str, Any]]


def _skip_reason(host: NamespaceHost, key: bytes, got: object) -> WriteSkip:
    if isinstance(got, WriteSkip):
        return got
    # A manager that only says None: present, or no room (it cannot tell in-flight apart).
    return WriteSkip.PRESENT if host.manager.contains(key) else WriteSkip.NO_ROOM


class DataHandlers:
    """Handlers of every op a registered client may send (except ``register``/``health``).

    Args:
        metrics: the server's Prometheus metrics.
        prefetch_q: bounded queue of ``(host, key)`` the prefetch thread promotes.
        server_stats: extra ``server_*`` counters for the ``stats`` reply.
    """

    def __init__(
        self,
        metrics: ServerMetrics,
        prefetch_q: "queue.Queue[tuple[NamespaceHost, bytes]]",
        server_stats: Callable[[], dict[str, int]],
    ):
        self.metrics = metrics
        self.prefetch_q = prefetch_q
        self.server_stats = server_stats
        #: The lookup trace recorder (kvtier.service.trace_capture), None when trace_capture_path is unset.
        self.capture: Any = None
        self.table: dict[str, Handler] = {
            "lookup": self.lookup,
            "contains": self.contains,
            "release": self.release,
            "reserve": self.reserve,
            "reserve_many": self.reserve_many,
            "commit": self.commit,
            "abort": self.abort,
            "load": self.load,
            "load_many": self.load_many,
            "unload": self.unload,
            "prefetch": self.prefetch,
            "flush": self.flush,
            "stats": self.stats,
            "clear": self.clear,
        }

    # -- leases ------------------------------------------------------------------------------
    def lookup(self, h: Holds, reg: Registered, r: Lookup) -> dict[str, Any]:
        res, codes = lookup_op(reg.host.manager, h, reg.prefix, r)
        if self.capture is not None:
            self.capture.lookup(reg.host.namespace.chunk_size, r.keys)
        m = self.metrics
        m.lookups.inc()
        cs = reg.host.namespace.chunk_size
        # A request's repeated lookup (same owner, its lease still live: vLLM asks again after a
        # failed block allocation) is not a new request: it adds only the hits it finds beyond
        # the last answer (StorageManager.lookup_keys sets ``repeated``).
        if not res.repeated:
            m.lookup_tokens.inc(cs * len(r.keys))
        new = res.tiers[res.repeated:]
        hit = {tier: cs * new.count(tier) for tier in set(new)}
        for tier, n in hit.items():
            m.lookup_hit_tokens.labels(tier).inc(n)
        if new:  # the dashboard's hot prefixes: a hit chain is named by its last key (keys are chained)
            nbytes = getattr(reg.host.manager, "chunk_bytes", 0) * len(res.keys)
            m.hot.observe(res.keys[-1], cs * len(res.keys), nbytes, hit)
        return {"tiers": codes}

    def release(self, h: Holds, reg: Registered, r: ReleaseLease) -> dict[str, Any]:
        release_op(reg.host.manager, h, reg.prefix, r)
        return {}

    def contains(self, h: Holds, reg: Registered, r: Contains) -> dict[str, Any]:
        return {"hit": reg.host.manager.contains(r.key)}

    # -- write path -----------------------------------------------------------------------------
    def reserve(self, h: Holds, reg: Registered, r: Reserve) -> dict[str, Any]:
        slots, skips = self._reserve(h, reg, [r.key])
        return {"slot": slots[0], "skip": skips[0], "present": skips[0] == WriteSkip.PRESENT}

    def reserve_many(self, h: Holds, reg: Registered, r: ReserveMany) -> dict[str, Any]:
        slots, skips = self._reserve(h, reg, r.keys, r.parents)
        return {"slots": slots, "skips": skips}

    def _reserve(
        self, h: Holds, reg: Registered, keys: list[bytes], parents: list[bytes | None] | None = None
    ) -> tuple[list[int | None], list[int]]:
        if len(keys) > h.room():
            raise ProtocolError(ErrorCode.TOO_MANY_HOLDS, f"at most {h.max_holds} reservations+reads per connection")
        if any(k in h.writes for k in keys):
            raise ProtocolError(ErrorCode.BAD_STATE, "key already reserved by this client")
        n = _take_quota(h, reg, len(keys))  # beyond the client's quota: NO_ROOM (the client stops the chain)
        host = reg.host
        try:
            if parents is None:  # the wire's default: the keys are one chain in order, the first a head
                parents = chain_parents(keys)
            got = host.manager.open_write_many(keys[:n], parents[:n])
        except BaseException:
            _give_quota(h, n)
            raise
        got = list(got) + [WriteSkip.NO_ROOM] * (len(keys) - n)
        slots: list[int | None] = []
        skips: list[int] = []
        taken = 0
        try:
            for key, g in zip(keys, got, strict=True):
                if isinstance(g, np.ndarray):
                    slot = host.pool.slot_of(g)
                    h.add_write(key, slot)
                    taken += 1
                    slots.append(slot)
                    skips.append(0)
                else:
                    slots.append(None)
                    skips.append(int(_skip_reason(host, key, g)))
        except BaseException:
            for key, g in zip(keys, got):
                if isinstance(g, np.ndarray):
                    if h.pop_write(key) is not None:
                        taken -= 1
                    host.manager.abort(key)
            raise
        finally:
            _give_quota(h, n - taken)
        return slots, skips

    def commit(self, h: Holds, reg: Registered, r: Commit) -> dict[str, Any]:
        slot = h.pop_write(r.key)
        if slot is None:
            if h.was_expired(r.key):
                raise ProtocolError(
                    ErrorCode.EXPIRED, "commit after the reservation timed out (its slot was freed); store it again"
                )
            raise ProtocolError(ErrorCode.NOT_RESERVED, "commit of a key this client has not reserved")
        reg.host.commit(r.key, r.parent, slot)
        self.metrics.bytes_in.inc(reg.host.pool.slot_bytes)
        return {}

    def abort(self, h: Holds, reg: Registered, r: Abort) -> dict[str, Any]:
        if h.pop_write(r.key) is None:
            if h.was_expired(r.key):
                return {}  # the timeout already aborted it
            raise ProtocolError(ErrorCode.NOT_RESERVED, "abort of a key this client has not reserved")
        reg.host.manager.abort(r.key)
        return {}

    # -- read path ---------------------------------------------------------------------------------
    def load(self, h: Holds, reg: Registered, r: Load) -> dict[str, Any]:
        out = self._load(h, reg, [r.key], [r.parent])[0]
        if out is None:
            return {"handle": None}
        hid, slot, source = out
        return {"handle": hid, "slot": slot, "source": source}

    def load_many(self, h: Holds, reg: Registered, r: LoadMany) -> dict[str, Any]:
        return {"handles": self._load(h, reg, r.keys, r.parents, r.client_verifies)}

    def _load(
        self, h: Holds, reg: Registered, keys: list[bytes], parents: list[bytes | None], client_verifies: bool = False
    ) -> list[list[Any] | None]:
        if len(keys) > h.room():
            raise ProtocolError(ErrorCode.TOO_MANY_HOLDS, f"at most {h.max_holds} reservations+reads per connection")
        n = _take_quota(h, reg, len(keys))  # beyond the client's quota: a miss
        host = reg.host
        items = list(zip(keys[:n], parents[:n]))
        try:
            if client_verifies:  # the client checks each slot as it reads it (integrity.py)
                opened = host.open_for_client(items)
                handles = [None if o is None else o[0] for o in opened]
                sums = [None if o is None else o[1] for o in opened]
            else:
                handles, sums = list(host.open_verified(items)), [None] * n
        except BaseException:
            _give_quota(h, n)
            raise
        handles = list(handles) + [None] * (len(keys) - n)
        out: list[list[Any] | None] = []
        taken: list[int] = []
        try:
            for handle, want in zip(handles, sums + [None] * (len(keys) - n)):
                if handle is None:
                    out.append(None)
                    continue
                slot = host.pool.slot_of(handle.buffer)
                hid = h.add_read(handle)
                taken.append(hid)
                out.append([hid, slot, handle.source, want] if client_verifies else [hid, slot, handle.source])
                self.metrics.load_tokens.labels(handle.source).inc(host.namespace.chunk_size)
        except BaseException:
            for handle in handles:
                if handle is not None:
                    handle.close()
            for hid in taken:
                h.reads.pop(hid, None)
            taken.clear()
            raise
        finally:
            _give_quota(h, n - len(taken))
        self.metrics.bytes_out.inc(host.pool.slot_bytes * len(taken))
        host.load_failures += len(keys) - len(taken)  # asked for and not served: gone, a failing tier, quota
        return out

    def unload(self, h: Holds, reg: Registered, r: Unload) -> dict[str, Any]:
        handle = h.pop_read(r.handle)
        if handle is None:
            raise ProtocolError(ErrorCode.UNKNOWN_HANDLE, "unload of a handle this client does not hold")
        if r.corrupt and handle.source == "cpu":
            reg.host.report_corrupt(handle)  # checked again here, dropped if it differs; closes the handle
        else:
            handle.close()
        return {}

    def prefetch(self, h: Holds, reg: Registered, r: Prefetch) -> dict[str, Any]:
        queued = 0
        for key in r.keys:
            try:
                self.prefetch_q.put_nowait((reg.host, key))
                queued += 1
            except queue.Full:
                break
        return {"queued": queued}

    # -- admin -----------------------------------------------------------------------------------------
    def flush(self, h: Holds, reg: Registered, r: Flush) -> dict[str, Any]:
        return {"done": bool(reg.host.manager.flush(r.timeout_s))}

    def stats(self, h: Holds, reg: Registered, r: Stats) -> dict[str, Any]:
        host = reg.host
        out: dict[str, Any] = dict(host.stats())
        out.update(self.server_stats())
        out.update(cpu_num_slots=host.pool.num_slots, cpu_free_slots=host.pool.num_free)
        q = h.quota
        if q is not None:
            out.update(client_holds=q.holds, client_max_holds=q.limits.max_holds,
                       client_leased=q.leased, client_max_leased=q.limits.max_leased)
        return {"stats": out}

    def clear(self, h: Holds, reg: Registered, r: Clear) -> dict[str, Any]:
        return {"removed": reg.host.manager.clear()}


def _take_quota(h: Holds, reg: Registered, n: int) -> int:
    """Take up to ``n`` holds from the client id's quota; returns how many (at least 1).

    Raises:
        ProtocolError: ``TOO_MANY_HOLDS`` when the quota has no room at all.
    """
    q = h.quota
    if q is None or n == 0:
        return n
    got = q.take_upto(n)
    if got < n:
        reg.host.quota_refusals += 1
    if got == 0:
        raise ProtocolError(
            ErrorCode.TOO_MANY_HOLDS,
            f"client {q.client_id!r} holds {q.holds} of its {q.limits.max_holds} reservations+reads "
            "(all its connections together); commit, abort or unload first",
        )
    return got


def _give_quota(h: Holds, n: int) -> None:
    if h.quota is not None:
        h.quota.give(n)


def prefetch_one(host: NamespaceHost, key: bytes) -> None:
    """Promote a chunk held only below the CPU tier into it (a failing tier is a miss)."""
    m = host.manager
    try:
        if m.where(key) != "cpu":
            for handle in host.open_verified([(key, None)]):  # records the promoted chunk's checksum
                if handle is not None:
                    handle.close()
    except Exception:
        log.exception("kvtier server: prefetch failed")
