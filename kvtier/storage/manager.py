"""The storage manager: the CPU tier plus an ordered list of lower tiers, behind one API.

``manager.lower`` holds the lower tiers (:class:`kvtier.tiers.base.LowerTier`),
fastest first: the disk tier (``disk_path``), then the remote tier
(``remote_url``: Redis, Redis Cluster, shared filesystem or a plug-in). Every
operation is a loop over the tiers:

- ``lookup`` walks a prompt's chunk keys over the tiers (:mod:`.lookup`) and
  returns the longest prefix held by any tier, never the whole prompt (the engine
  must compute >= 1 token), optionally leasing those chunks until the load. The
  hit chain is touched tail first in every tier (recency; TTL refresh in stores
  that expire keys), so a hot head outlives its tails.
- ``open_write``/``commit`` store into the CPU tier synchronously; committed
  chunks reach every lower tier by write-behind (:mod:`.write_behind`): the
  engine's step never waits for disk or network.
- ``open_read`` serves a chunk from the fastest tier; a lower-tier hit is
  promoted into the CPU tier first (:mod:`.promotion`, one path for every tier).
- ``prefetch`` runs the same promotion on a background thread.
- ``clear``, ``flush``, ``close`` and ``stats`` loop over the tiers; ``clear``
  removes only this manager's namespace, also in a store other models share.
- ``subscribe`` registers a listener of every tier change (stored / removed /
  cleared chunks, :mod:`.tier_events`); without listeners no tier reports anything.
  The manager calls each lower tier through its :class:`.reporting_tier.ReportingTier`
  (:meth:`StorageManager.reporting`), which reports what is stored, removed or cleared
  through it unless the tier reports its own changes.

A failing lower tier is a miss (bounded by its timeout), never an exception.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence, Union

import numpy as np

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace, is_lineage
from kvtier.memory.numa_topology import choose as choose_numa
from kvtier.memory.pool import ChunkPool, pins_by_default
from kvtier.memory.shared_segment import SharedSegment, shared_chunk_pool
from kvtier.storage.handles import CpuReadHandle
from kvtier.storage.leases import LeaseTable
from kvtier.storage.lookup import contains_many_safe, held_prefix
from kvtier.storage.lower_tiers import open_storage_tiers
from kvtier.storage.promotion import Promoter
from kvtier.storage.reporting_tier import ReportingTier
from kvtier.storage.stats import Counters, ManagerStats, collect_stats, tier_prefixes
from kvtier.storage.tier_events import TierEvents, TierListener
from kvtier.storage.types import LookupResult, ReadHandle, WriteSkip
from kvtier.storage.write_behind import WriteBehind
from kvtier.tiers.base import LowerTier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.policies import make_policy

log = logging.getLogger(__name__)

__all__ = ["LookupResult", "LowerTiers", "ReadHandle", "StorageManager", "WriteSkip"]

#: Lower tiers given to a manager: the tiers, fastest first, or a factory that
#: opens them given the lease table's ``is_pinned`` (so leased chunks stay).
LowerTiers = Union[Sequence[LowerTier], Callable[[Callable[[bytes], bool]], Sequence[LowerTier]]]


class StorageManager:
    """CPU tier + lower tiers + index + leases for one key namespace.

    Args:
        config: effective kvtier config.
        namespace: key namespace (model, layout, chunk size, rank).
        pool: optional CPU pool to use instead of allocating ``config.cpu_capacity``
            (the cache service passes one over a shared-memory segment).
        lower: lower tiers to use instead of opening them from ``config``
            (:data:`LowerTiers`; fastest first; the manager owns and closes them).

    Raises:
        ValueError: capacities too small for one chunk, or a remote tier URL/option
            the tier refuses (an unreachable remote store is not an error).
        DiskTierLocked: the disk directory is owned by another process.
    """

    #: Most chunks one write-behind ``put_many`` carries.
    WRITE_BATCH = 8
    #: Prompts waiting for prefetch; more are dropped (counted).
    PREFETCH_QUEUE = 64

    def __init__(
        self,
        config: KVTierConfig,
        namespace: KeyNamespace,
        pool: ChunkPool | None = None,
        lower: LowerTiers | None = None,
    ):
        if namespace.chunk_size != config.chunk_size:
            raise ValueError("namespace chunk_size differs from config.chunk_size")
        self.config = config
        self.namespace = namespace
        self.chunk_bytes = namespace.chunk_bytes
        self.hasher = ChunkHasher(namespace)
        self.leases = LeaseTable(config.lease_ttl_s)
        self.counters = Counters()
        self._lock = threading.Lock()
        self._closed = False
        #: The CPU tier's memory as a shared segment when this instance serves peers over shared
        #: memory (peers map it read-only and copy chunks straight out of it); else None.
        self.cpu_segment: SharedSegment | None = None
        if pool is None and int(config.cpu_capacity) >= self.chunk_bytes:  # (below one chunk: CpuTier says so)
            placement = choose_numa(config.cpu_numa_node)  # NumaError: a node this machine lacks
            if _cpu_shared_with_peers(config):
                pool, self.cpu_segment = shared_chunk_pool(self.chunk_bytes, int(config.cpu_capacity), numa=placement)
            else:
                pool = ChunkPool(self.chunk_bytes, int(config.cpu_capacity) // self.chunk_bytes, numa=placement)
            if pool.numa is not None:
                log.info("kvtier CPU tier: %d B %s", pool.capacity_bytes, pool.numa.describe())
        self.cpu = CpuTier(
            self.chunk_bytes, int(config.cpu_capacity), make_policy(config.cpu_eviction), self.leases.is_pinned, pool=pool
        )
        if lower is None:
            peer_settings = [k for k in ("peers", "peer_discovery", "peer_listen") if getattr(config, k)]
            if peer_settings:
                raise ValueError(f"{', '.join(peer_settings)}: peer sharing is opened one layer up; build this "
                                 "manager with kvtier.transfer.assembly.open_manager (or pass lower=)")
            self.lower: list[LowerTier] = open_storage_tiers(config, namespace, self.leases.is_pinned)
        elif callable(lower):
            self.lower = list(lower(self.leases.is_pinned))
        else:
            self.lower = list(lower)
        _register_cpu_memory(self.cpu, self.lower)
        self._prefixes = tier_prefixes(self.lower)
        #: ``lower`` as the manager calls them (write-behind, promotion, lookups, operations): each
        #: behind the wrapper that reports its changes while someone listens.
        self._reporting = [ReportingTier(t) for t in self.lower]
        queues = [config.disk_write_queue if t.local else config.remote_write_queue for t in self.lower]
        self.write_behind = WriteBehind(self.cpu, self._reporting, queues, self.WRITE_BATCH)
        self.promoter = Promoter(self.cpu, self._reporting, self.write_behind, self.chunk_bytes, self.PREFETCH_QUEUE)
        self._local = [t for t in self.lower if t.local]
        self.events = TierEvents()
        self._hooks_lock = threading.Lock()  # orders hook (un)installation of concurrent (un)subscribes
        #: Serves local chunks to peers on ``config.peer_listen`` (None when unset; set by
        #: :meth:`attach_peer_server`); stopped by close.
        self.peer_server: Any = None
        log.info(
            "kvtier storage: chunk_bytes=%d lower tiers=[%s] %s",
            self.chunk_bytes,
            ", ".join(t.name for t in self.lower),
            config.describe(),
        )

    # -- tier change notifications ------------------------------------------------------
    def subscribe(self, listener: TierListener) -> None:
        """Call ``listener`` with every :class:`~kvtier.storage.tier_events.TierChange` of this
        manager's tiers from now on (see :mod:`kvtier.storage.tier_events`: it must only
        enqueue; it runs on any thread, possibly under a tier lock; its exceptions are
        logged and swallowed).

        Raises:
            TypeError: ``listener`` is not callable.
        """
        with self._hooks_lock:
            if self.events.subscribe(listener):
                self._install_hooks(True)

    def unsubscribe(self, listener: TierListener) -> None:
        """Stop calling ``listener`` (an unknown one is ignored)."""
        with self._hooks_lock:
            if self.events.unsubscribe(listener):
                self._install_hooks(False)

    def _install_hooks(self, on: bool) -> None:
        self.cpu.set_change_hook(self.events.hook("cpu") if on else None)
        for tier in self._reporting:
            tier.set_change_hook(self.events.hook(tier.kind) if on else None)

    def reporting(self, tier: LowerTier) -> ReportingTier:
        """``tier`` (one of :attr:`lower`) behind its :class:`~kvtier.storage.reporting_tier.ReportingTier`:
        what an operation stores, removes or clears through it is reported to the listeners.

        Raises:
            ValueError: ``tier`` is not one of this manager's lower tiers.
        """
        for wrapped in self._reporting:
            if wrapped.inner is tier:
                return wrapped
        raise ValueError(f"{tier!r} is not a lower tier of this manager")

    # -- tiers -------------------------------------------------------------------------
    def _first_of_kind(self, kind: str) -> LowerTier | None:
        return next((t for t in self.lower if t.kind == kind), None)

    @property
    def disk(self) -> LowerTier | None:
        """The first lower tier of kind ``disk`` (read-only view; None without one)."""
        return self._first_of_kind("disk")

    @property
    def remote(self) -> LowerTier | None:
        """The first lower tier of kind ``remote`` (read-only view; None without one)."""
        return self._first_of_kind("remote")

    # -- index -------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Chunk keys (32-byte blake3 digests) of every full chunk of ``tokens``."""
        return self.hasher.keys(tokens, cache_salt)

    def where(self, key: bytes) -> str | None:
        """Fastest local tier (``"cpu"``, ``"disk"``) holding ``key``, or None. No network round trip."""
        if self.cpu.contains(key):
            return "cpu"
        for tier in self._local:
            if contains_many_safe(tier, [key])[0]:
                return tier.kind
        return None

    def namespace_of(self, key: bytes) -> KeyNamespace | None:
        """This manager's namespace if a local tier holds ``key``, else None (a peer server checks the
        namespace against the asking member's ``models``)."""
        return self.namespace if self.where(key) is not None else None

    def lineage_of(self, key: bytes, max_steps: int = 1 << 16) -> bytes | None:
        """The lineage marker (:meth:`KeyNamespace.lineage`: which ``cache_salt``) ``key``'s chain starts
        from, following the parents the CPU and disk tiers recorded; None when an ancestor is not held
        locally or a chain was stored without a marker (a peer server then refuses a salt-restricted member).
        Each tier's links form a forest, but one tier's may close a cycle with another's (A's parent B in
        one, B's A in the other): a key met again ends the walk (None). Cost: one dictionary lookup per
        ancestor, at most ``max_steps``."""
        parent_of = [self.cpu.policy.parent_of] + [getattr(t, "parent_of") for t in self._local
                                                    if hasattr(t, "parent_of")]
        k: bytes = key
        seen = {key}
        for _ in range(max_steps):
            parent: bytes | None = None
            for fn in parent_of:
                parent = fn(k)
                if parent is not None:
                    break
            if parent is None or parent in seen:
                return None
            if is_lineage(parent):
                return parent
            seen.add(parent)
            k = parent
        return None

    def contains(self, key: bytes) -> bool:
        """True if a local tier (CPU, disk) holds ``key`` (no remote round trip)."""
        return self.where(key) is not None

    def lookup(
        self,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        lease_owner: str | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> LookupResult:
        """Longest cached prefix of ``tokens``.

        Args:
            tokens: prompt token ids.
            cache_salt: tenant salt (part of the key).
            lease_owner: if given, the hit chunks are leased to this id (replacing
                its previous lease) until :meth:`release` or the TTL.
            keys: precomputed keys of ``tokens`` (saves hashing twice).

        Returns:
            A :class:`LookupResult`; ``num_tokens`` is a multiple of chunk_size and
            at most ``len(tokens) - 1`` rounded down to a chunk.
        """
        cs = self.namespace.chunk_size
        max_chunks = max(0, (len(tokens) - 1) // cs)
        if keys is None:
            keys = self.hasher.keys(tokens, cache_salt, max_chunks=max_chunks)
        self.counters.add(lookup_tokens=len(tokens))
        return self.lookup_keys(list(keys[:max_chunks]), lease_owner)

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` held by any tier (see :meth:`lookup`).

        The caller has already left out the chunk holding the prompt's last token.
        Time: dictionary look-ups, plus one batched ``contains_many`` per non-local
        tier when the faster tiers miss (bounded by that tier's timeout). After :meth:`close`: a miss.
        """
        if self._closed:  # a closed manager's CPU memory is given back: nothing is held any more
            return LookupResult(0, [], [], repeated=0)
        self.leases.reap()
        before: tuple[bytes, ...] = ()
        if lease_owner is not None:
            before = self.leases.keys_of(lease_owner)  # this owner's live lease: an earlier lookup of its request
            # Pin first, then check: a chunk seen present cannot be evicted before
            # the lease covers it. The lease is narrowed to the hits below.
            self.leases.grant(lease_owner, keys)
        try:
            tiers = held_prefix(keys, self._reporting, self.cpu)
        except BaseException:  # e.g. bad keys (TypeError): no lease outlives a failed call
            if lease_owner is not None:
                self.leases.release(lease_owner)
            raise
        hit_keys = list(keys[: len(tiers)])
        if lease_owner is not None:
            self.leases.grant(lease_owner, hit_keys)
        self.touch_chain(hit_keys)
        repeated = _common_prefix(before, hit_keys)
        self.counters.add(lookups=1, lookup_hit_tokens=(len(hit_keys) - repeated) * self.namespace.chunk_size)
        return LookupResult(len(hit_keys) * self.namespace.chunk_size, hit_keys, tiers, repeated=repeated)

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease (load done, request finished or aborted)."""
        self.leases.release(lease_owner)

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark a prompt's chunks (prompt order) as used in every tier, tail first."""
        for key in reversed(keys):
            self.cpu.touch(key)
        self.write_behind.touch(keys)

    # -- write path --------------------------------------------------------------------
    def open_write(self, key: bytes, parent: bytes | None) -> np.ndarray | None:
        """Reserve a CPU slot for ``key``; returns the uint8 ``[chunk_bytes]`` buffer to fill.

        ``parent``: the key ``key`` will be committed with (None or a lineage marker
        for a prompt's first chunk); required, see :meth:`open_write_many`.

        Returns None when a local tier already holds the chunk, another writer holds
        its reservation, or no slot can be freed (see :meth:`open_write_many` for
        which). Follow with :meth:`commit` or :meth:`abort`. Remote tiers are not
        asked (that would put a round trip on the engine's step): a chunk held only
        remotely is stored again, an idempotent overwrite.
        """
        got = self.open_write_many([key], [parent])[0]
        return None if isinstance(got, WriteSkip) else got

    def open_write_many(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None]
    ) -> list[np.ndarray | WriteSkip]:
        """:meth:`open_write` for each key, in order; a refusal says why.

        Args:
            keys: chunk keys to store.
            parents: each key's parent (the key it will be committed with; None or
                a lineage marker for a prompt's first chunk). Making room for a key
                never evicts its parent (the new chunk would be orphaned at birth,
                and a chunk stored after a hit would evict the chunks it extends).
                Required: a store path that does not know its chunks' parents
                cannot keep the chain rule, so there is no default.

        Returns:
            Per key, the buffer to fill, or ``WriteSkip.PRESENT`` (the CPU or a local
            lower tier holds it), ``WriteSkip.IN_FLIGHT`` (another writer's
            uncommitted reservation: go on with the rest of the chain) or
            ``WriteSkip.NO_ROOM`` (no CPU slot can be freed: stop storing the chain).

            After :meth:`close`: ``NO_ROOM`` for every key.

        Raises:
            ValueError: ``parents`` is not as long as ``keys``.
        """
        if parents is None or len(parents) != len(keys):
            raise ValueError(f"{'no' if parents is None else len(parents)} parents for {len(keys)} keys: "
                             "pass each chunk's parent (None for a prompt's first chunk)")
        if self._closed:
            return [WriteSkip.NO_ROOM] * len(keys)
        out: list[np.ndarray | WriteSkip] = []
        on_local = self._held_locally(keys)
        # A parent a local lower tier (disk) holds stays reachable if the CPU tier drops
        # it: there it is not protected, so a small CPU tier in front of a disk keeps
        # staging a long prompt's chunks (write-behind) instead of refusing its tail.
        own = set(keys)
        asked = sorted({p for p in parents if p is not None and p not in own})
        below: set[bytes] = set()
        for tier in self._local if asked else ():
            below.update(p for p, ok in zip(asked, contains_many_safe(tier, asked)) if ok)
        skipped = 0
        for key, parent, present in zip(keys, parents, on_local):
            if present:
                out.append(WriteSkip.PRESENT)
                continue
            got = self.cpu.try_reserve(key, None if parent in below else parent)
            skipped += got is WriteSkip.NO_ROOM
            out.append(got)
        if skipped:
            self.counters.add(store_skipped=skipped)
        return out

    def _held_locally(self, keys: Sequence[bytes]) -> list[bool]:
        held = [self.cpu.contains(k) for k in keys]
        for tier in self._local:
            ask = [i for i, h in enumerate(held) if not h]
            if not ask:
                break
            for i, ok in zip(ask, contains_many_safe(tier, [keys[i] for i in ask])):
                held[i] = ok
        return held

    def commit(self, key: bytes, parent: bytes | None) -> None:
        """Publish a filled chunk and queue it for every lower tier (write-behind).

        ``parent``: key of the previous chunk of the prompt (None or a lineage
        marker for the first), as given to :meth:`open_write_many`.
        Never waits for lower-tier I/O: each queue holds a CPU read reference until
        its write is done; a full queue drops the write (counted). A parent that would
        close a parent cycle is recorded nowhere (:meth:`CpuTier.commit
        <kvtier.tiers.cpu.CpuTier.commit>`): the lower tiers get the parent the CPU tier kept.

        Raises:
            RuntimeError: ``key`` has no reservation of this caller (a programming error).
        """
        parent = self.cpu.commit(key, parent)
        self.counters.add(stored_chunks=1, stored_bytes=self.chunk_bytes)
        self.write_behind.submit(key, parent)

    def abort(self, key: bytes) -> None:
        """Drop a buffer reserved by :meth:`open_write` (the copy failed)."""
        self.cpu.abort(key)

    # -- read path ---------------------------------------------------------------------
    def open_read(self, key: bytes, parent: bytes | None = None) -> ReadHandle | None:
        """Hold ``key`` for reading from the fastest tier; None on a miss or failure.

        A lower-tier hit is read into a fresh CPU slot (promotion) and served from
        there. Never raises for tier failures. Time: a CPU hit is a dictionary
        look-up; otherwise one read per lower tier asked (each within its timeout).
        """
        return self.open_read_many([(key, parent)])[0]

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[ReadHandle | None]:
        """:meth:`open_read` for many ``(key, parent)`` pairs: one batched read per lower tier.

        Returns one handle or None per item, in order (close every handle); all None after :meth:`close`.
        """
        if self._closed:
            return [None] * len(items)
        handles: list[CpuReadHandle | None] = self.promoter.open_read_many(items)
        return list(handles)

    def prefetch(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Queue promotion of a prompt's lower-tier chunks into CPU; returns chunks queued.

        Walks the chunk keys of ``tokens`` (as :meth:`lookup` would, leaving out the
        chunk of the last token): CPU chunks are skipped; the rest are queued up to
        the first chunk no local tier holds, or all of them when a non-local tier
        exists (the background thread asks it in one round trip and promotes the
        leading run some tier holds). Never blocks on I/O; a full queue drops the
        prompt (counted).
        """
        cs = self.namespace.chunk_size
        max_chunks = max(0, (len(tokens) - 1) // cs)
        keys = self.hasher.keys(tokens, cache_salt, max_chunks=max_chunks)[:max_chunks]
        has_remote = any(not t.local for t in self.lower)
        on_local = self._held_locally(keys)
        job: list[tuple[bytes, bytes | None]] = []
        for i, key in enumerate(keys):
            if self.cpu.contains(key):
                continue
            if not on_local[i] and not has_remote:
                break
            job.append((key, keys[i - 1] if i else None))
        self.counters.add(prefetch_calls=1)
        if not job or self._closed or not self.promoter.prefetch(job):
            return 0
        return len(job)

    # -- admin -------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for queued prefetches and write-behind to reach every lower tier; False on timeout."""
        ok = self.promoter.flush(timeout_s)
        return self.write_behind.flush(timeout_s) and ok

    def clear(self) -> dict[str, int]:
        """Remove this namespace's chunks from every tier; returns chunks removed per tier.

        Keys: ``"cpu"`` and each lower tier's stat prefix (``"disk"``, ``"remote"``).
        Chunks being read stay (with their ancestors). Other namespaces sharing a
        store are untouched.
        """
        self.flush(30)  # queued write-behind holds CPU references that would keep chunks alive
        out = {"cpu": self.cpu.clear()}
        for prefix, tier in zip(self._prefixes, self._reporting):
            out[prefix] = tier.clear()
        return out

    def stats(self) -> dict[str, int | float]:
        """Counters and gauges by name: manager counters, ``cpu_*``, and ``<kind>_*`` per lower tier
        (:meth:`ManagerStats.flat <kvtier.storage.stats.ManagerStats.flat>` of :meth:`typed_stats`)."""
        return self.typed_stats().flat()

    def typed_stats(self) -> ManagerStats:
        """The same numbers as :meth:`stats`, as fields (:class:`~kvtier.storage.stats.ManagerStats`)."""
        forgotten = sum(t.stale_forgotten for t in self._reporting)
        return collect_stats(self.counters, forgotten, self.cpu, self.leases, self.promoter, self.write_behind,
                             self._prefixes, self.lower)

    def check_invariants(self) -> None:
        """Assert the CPU tier's and the lease table's invariants (tests; O(entries)).

        Raises:
            AssertionError: an invariant is broken.
        """
        self.cpu.check_invariants()
        self.leases.check_invariants()

    def attach_peer_server(self, server: Any) -> None:
        """Take ``server`` (``stop()``; None: nothing to attach) as the one serving this manager's chunks to
        peers; :meth:`close` stops it. Called by :func:`kvtier.transfer.assembly.open_manager`.

        Raises:
            RuntimeError: the manager is closed (``server`` is stopped first) or already has one.
        """
        if server is None:
            return
        with self._lock:
            refused = "closed" if self._closed else "already serving peers" if self.peer_server is not None else ""
            if not refused:
                self.peer_server = server
                return
        server.stop()
        raise RuntimeError(f"StorageManager.attach_peer_server: the manager is {refused}")

    def close(self) -> None:
        """Drop queued prefetches, flush write-behind, close every lower tier.

        Idempotent. Bounded: write-behind drains within about ``queue / WRITE_BATCH``
        tier calls per tier (each within the tier's timeout).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.peer_server is not None:
            self.peer_server.stop()
        self.promoter.close()
        self.write_behind.close(60.0)
        for tier in self.lower:
            try:
                tier.close()
            except Exception:  # pragma: no cover - defensive
                log.exception("kvtier: closing %s failed", tier.name)
        if self.cpu_segment is not None:  # its fd; the mapping stays while a reader's view is alive
            self.cpu.pool.release_buffer()  # else the pool's own view keeps it until a gc (a cycle holds it)
            self.cpu_segment.close()


def _cpu_shared_with_peers(config: KVTierConfig) -> bool:
    """Whether the CPU tier should live in a shared segment: this instance serves peers over
    shared memory (``peer_listen = shm://...``) and its CPU memory need not be CUDA-pinned
    (a pinned pool keeps its private, page-locked memory; peers then get staged copies)."""
    return (config.peer_listen or "").startswith("shm://") and not pins_by_default()


def _register_cpu_memory(cpu: CpuTier, lower: Sequence[LowerTier]) -> None:
    """Tell each lower tier that moves bytes straight to and from host memory (an optional
    ``register_host_memory(address, nbytes)``, e.g. the Mooncake tier) where the CPU tier's
    slots lie: one contiguous region that lives as long as the manager."""
    first = cpu.pool.view(0)
    for tier in lower:
        register = getattr(tier, "register_host_memory", None)
        if callable(register):
            register(int(first.ctypes.data), cpu.pool.capacity_bytes)
def _common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Leading entries ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
