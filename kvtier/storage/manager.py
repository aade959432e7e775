"""The storage manager: one entry point over the token index, leases and tiers.

- ``lookup`` walks a prompt's chunk keys and returns the longest prefix held by
  any tier, never the whole prompt (the engine must compute >= 1 token), and
  optionally leases those chunks until the load.
- ``open_write``/``commit`` store into the CPU tier synchronously; committed
  chunks are queued for the disk tier (write-behind): the engine's step never
  waits for disk.
- ``open_read`` serves a chunk from the fastest tier that has it; a disk or
  remote hit is promoted into the CPU tier first (read straight into a reserved
  CPU slot).
- The remote tier (``remote_url``: Redis, Redis Cluster, shared filesystem or a
  plug-in) is the lowest tier. ``lookup`` asks it about every chunk the local
  tiers miss in one batched call (one round trip); committed chunks reach it by
  write-behind on a background thread (batched ``put_many``), never on the
  engine's step. A remote failure is a miss (bounded by ``remote_timeout_s``).
- ``prefetch`` promotes a prompt's lower-tier chunks into CPU on a background thread.

Chain order: when a prompt's chunks are touched (lookup hit or store), they are
touched from the last chunk to the first, so under recency policies the tail
of a chain is always evicted before its head and no tier keeps an unreachable
chunk while evicting a reachable one.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace
from kvtier.memory.pool import ChunkPool
from kvtier.storage.batch_worker import BatchWorker
from kvtier.storage.leases import LeaseTable
from kvtier.storage.remote import open_remote_tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.policies import make_policy

log = logging.getLogger(__name__)


@dataclass
class LookupResult:
    """Outcome of a lookup.

    Attributes:
        num_tokens: tokens of the longest cached prefix (multiple of chunk_size).
        keys: keys of the hit chunks, in prompt order.
        tiers: for each hit chunk, the fastest tier that holds it ("cpu", "disk"
            or "remote").
    """

    num_tokens: int
    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)


@dataclass
class Counters:
    """Monotonic counters (tokens, chunks, bytes)."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    hit_tokens_remote: int = 0
    loaded_chunks: int = 0
    load_failures: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_skipped: int = 0
    promoted_chunks: int = 0
    promoted_chunks_remote: int = 0
    remote_promote_failures: int = 0
    remote_queued_chunks: int = 0
    remote_dropped_writes: int = 0
    prefetch_calls: int = 0
    prefetch_queued_chunks: int = 0
    prefetch_promoted_chunks: int = 0
    prefetch_dropped_chunks: int = 0


@dataclass
class RequestRecord:
    """Where one request's prompt tokens came from.

    ``engine_hit_tokens`` were already in the engine's own prefix cache,
    ``kvtier_hit_tokens`` were loaded by kvtier (split by tier in ``tiers``), the
    rest were computed.
    """

    prompt_tokens: int
    engine_hit_tokens: int = 0
    kvtier_hit_tokens: int = 0
    tiers: dict[str, int] = field(default_factory=dict)


#: Recent request records kept for inspection (oldest dropped first).
MAX_REQUEST_RECORDS = 10_000


class ReadHandle:
    """A chunk held for reading: ``buffer`` stays valid until ``close()``."""

    __slots__ = ("_tier", "key", "buffer", "source")

    def __init__(self, tier: CpuTier | None, key: bytes, buffer: np.ndarray, source: str):
        self._tier: CpuTier | None = tier  # None: a private buffer, nothing to release
        self.key = key
        self.buffer = buffer  # uint8 [chunk_bytes]
        self.source = source  # tier it came from: "cpu", "disk" or "remote"

    def close(self) -> None:
        if self._tier is not None:
            self._tier.release(self.key)
            self._tier = None

    def __enter__(self) -> "ReadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StorageManager:
    """Tiers + index + leases for one key namespace.

    Args:
        config: effective kvtier config.
        namespace: key namespace (model, layout, chunk size, rank).
        pool: optional CPU pool to use instead of allocating ``config.cpu_capacity``
            (the cache service passes one over a shared-memory segment).

    Raises:
        ValueError: capacities too small for one chunk, or a remote tier URL/option
            the tier refuses (an unreachable remote store is not an error).
        DiskTierLocked: the disk directory is owned by another process.
    """

    #: Most chunks one remote ``put_many`` (write-behind) carries.
    REMOTE_WRITE_BATCH = 8
    #: Prompts waiting for prefetch; more are dropped (counted).
    PREFETCH_QUEUE = 64

    def __init__(self, config: KVTierConfig, namespace: KeyNamespace, pool: ChunkPool | None = None):
        if namespace.chunk_size != config.chunk_size:
            raise ValueError("namespace chunk_size differs from config.chunk_size")
        self.config = config
        self.namespace = namespace
        self.chunk_bytes = namespace.chunk_bytes
        self.hasher = ChunkHasher(namespace)
        self.leases = LeaseTable(config.lease_ttl_s)
        self.counters = Counters()
        self.requests: OrderedDict[str, RequestRecord] = OrderedDict()
        self._lock = threading.Lock()
        self.cpu = CpuTier(
            self.chunk_bytes,
            int(config.cpu_capacity),
            make_policy(config.cpu_eviction),
            self.leases.is_pinned,
            pool=pool,
        )
        self.disk: DiskTier | None = None
        if config.disk_path is not None:
            self.disk = DiskTier(
                config.disk_path,
                int(config.disk_capacity),
                namespace.digest(),
                make_policy(config.disk_eviction),
                self.leases.is_pinned,
                write_queue=config.disk_write_queue,
                fsync=config.disk_fsync,
                direct_io=config.disk_direct_io,
            )
            log.info(
                "kvtier disk tier %s: %d chunks indexed in %.3f s",
                config.disk_path,
                len(self.disk),
                self.disk.index_load_s,
            )
        self.remote = open_remote_tier(config, namespace)
        self._remote_writer: BatchWorker[tuple[bytes, np.ndarray]] | None = None
        if self.remote is not None:
            self._remote_writer = BatchWorker(
                "kvtier-remote-write",
                self._remote_write_batch,
                config.remote_write_queue,
                self.REMOTE_WRITE_BATCH,
                on_discard=lambda item: self.cpu.release(item[0]),
            )
        self._prefetcher: BatchWorker[list[tuple[bytes, bytes | None]]] | None = None
        self._closed = False
        log.info("kvtier storage: chunk_bytes=%d %s", self.chunk_bytes, config.describe())

    # -- index -----------------------------------------------------------------
    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Chunk keys of every full chunk of ``tokens``."""
        return self.hasher.keys(tokens, cache_salt)

    def where(self, key: bytes) -> str | None:
        """Fastest local tier (CPU, disk) holding ``key``, or None. Never asks the remote tier."""
        if self.cpu.contains(key):
            return "cpu"
        if self.disk is not None and self.disk.contains(key):
            return "disk"
        return None

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
        with self._lock:
            self.counters.lookup_tokens += len(tokens)
        return self.lookup_keys(list(keys[:max_chunks]), lease_owner)

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` held by any tier (see :meth:`lookup`).

        The caller has already left out the chunk holding the prompt's last token.
        """
        self.leases.reap()
        if lease_owner is not None:
            # Pin first, then check: a chunk seen present cannot be evicted before
            # the lease covers it. The lease is narrowed to the hits below.
            self.leases.grant(lease_owner, keys)
        hit_keys: list[bytes] = []
        tiers: list[str] = []
        for key in keys:
            tier = self.where(key)
            if tier is None:
                break
            hit_keys.append(key)
            tiers.append(tier)
        if self.remote is not None and len(hit_keys) < len(keys):
            # Everything the local tiers miss: one batched existence check (one round
            # trip); a failing remote answers all False. A chunk also held locally
            # (evicted and re-stored since) keeps its faster label.
            rest = list(keys[len(hit_keys) :])
            try:
                found = self.remote.contains_many(rest)
            except Exception:  # defensive: a failing tier is a miss
                log.exception("kvtier: remote lookup failed")
                found = [False] * len(rest)
            for key, ok in zip(rest, found):
                if not ok:
                    break
                hit_keys.append(key)
                tiers.append(self.where(key) or "remote")
        if lease_owner is not None:
            self.leases.grant(lease_owner, hit_keys)
        self._touch_chain(hit_keys)
        with self._lock:
            self.counters.lookups += 1
        return LookupResult(len(hit_keys) * self.namespace.chunk_size, hit_keys, tiers)

    def record_request(self, request_id: str, record: RequestRecord) -> None:
        """Remember where ``request_id``'s prompt tokens came from (bounded log)."""
        with self._lock:
            self.requests[request_id] = record
            self.requests.move_to_end(request_id)
            while len(self.requests) > MAX_REQUEST_RECORDS:
                self.requests.popitem(last=False)

    def record_load(self, request_id: str, tier: str, num_tokens: int) -> None:
        """Count ``num_tokens`` supplied to ``request_id`` from ``tier``."""
        with self._lock:
            if tier == "cpu":
                self.counters.hit_tokens_cpu += num_tokens
            elif tier == "remote":
                self.counters.hit_tokens_remote += num_tokens
            else:
                self.counters.hit_tokens_disk += num_tokens
            self.counters.loaded_chunks += 1
            rec = self.requests.get(request_id)
            if rec is not None:
                rec.kvtier_hit_tokens += num_tokens
                rec.tiers[tier] = rec.tiers.get(tier, 0) + num_tokens

    def record_load_failure(self) -> None:
        """Count a planned load that could not be served (reported to the engine)."""
        with self._lock:
            self.counters.load_failures += 1

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease (load done, request finished or aborted)."""
        self.leases.release(lease_owner)

    def _touch_chain(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            self.cpu.touch(key)
            if self.disk is not None:
                self.disk.touch(key)

    # -- write path ------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """True if a local tier (CPU, disk) holds ``key`` (no remote round trip)."""
        return self.where(key) is not None

    def open_write(self, key: bytes) -> np.ndarray | None:
        """Reserve a CPU slot for ``key``; returns the uint8 ``[chunk_bytes]`` buffer to fill.

        Returns None when the chunk is already stored in a local tier or no slot can
        be freed; the caller skips the store. Follow with :meth:`commit` or :meth:`abort`.
        The remote tier is not asked (that would put a round trip on the engine's
        step): a chunk held only remotely is stored again, an idempotent overwrite.
        """
        if self.where(key) is not None:
            return None
        buf = self.cpu.reserve(key)
        if buf is None:
            with self._lock:
                self.counters.store_skipped += 1
        return buf

    def open_write_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """:meth:`open_write` for each key, in order (one round trip in the cache service)."""
        return [self.open_write(k) for k in keys]

    def commit(self, key: bytes, parent: bytes | None = None) -> None:
        """Publish a filled chunk and queue it for the disk and remote tiers (write-behind).

        ``parent``: key of the previous chunk of the prompt (None for the first).
        Never waits for disk or remote I/O: each queue holds a CPU read reference
        until its write is done; a full queue drops the write (counted).
        """
        self.cpu.commit(key, parent)
        with self._lock:
            self.counters.stored_chunks += 1
            self.counters.stored_bytes += self.chunk_bytes
        self._queue_disk(key, parent)
        if self._remote_writer is not None:
            buf = self.cpu.acquire(key)
            if buf is not None:
                if self._remote_writer.submit((key, buf)):
                    with self._lock:
                        self.counters.remote_queued_chunks += 1
                else:
                    self.cpu.release(key)
                    with self._lock:
                        self.counters.remote_dropped_writes += 1

    def _queue_disk(self, key: bytes, parent: bytes | None) -> None:
        if self.disk is not None and self.disk.writable:
            buf = self.cpu.acquire(key)
            if buf is not None:
                self.disk.put_async(key, buf, lambda: self.cpu.release(key), parent)

    def _remote_write_batch(self, items: list[tuple[bytes, np.ndarray]]) -> None:
        """Write-behind thread: one batched put of queued chunks, then drop their references."""
        try:
            assert self.remote is not None
            self.remote.put_many(items)  # failures are dropped and counted by the tier
        except Exception:  # defensive: a failing tier loses the writes, nothing else
            log.exception("kvtier: remote write-behind failed")
        finally:
            for key, _ in items:
                self.cpu.release(key)

    def abort(self, key: bytes) -> None:
        self.cpu.abort(key)

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark a stored prompt's chunks as used, tail first (see module doc)."""
        self._touch_chain(keys)

    # -- read path -------------------------------------------------------------------
    def open_read(self, key: bytes, parent: bytes | None = None) -> ReadHandle | None:
        """Hold ``key`` for reading from the fastest tier; None on a miss or failure.

        A disk or remote hit is read into a fresh CPU slot (promotion) and served
        from there. Never raises for tier failures: a failing tier is a miss. Time:
        a CPU hit is a dictionary look-up; a disk hit one file read; a remote hit
        one remote call, at most ``remote_timeout_s`` (a timeout is a miss).
        """
        return self.open_read_many([(key, parent)])[0]

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[ReadHandle | None]:
        """:meth:`open_read` for many ``(key, parent)`` pairs; remote hits come in one batched call.

        Returns one handle or None per item, in order (close every handle). Time:
        at most one remote call (``remote_timeout_s``) plus the disk reads.
        """
        out: list[ReadHandle | None] = [None] * len(items)
        remote_idx: list[int] = []
        for i, (key, parent) in enumerate(items):
            buf = self.cpu.acquire(key)
            if buf is not None:
                out[i] = ReadHandle(self.cpu, key, buf, "cpu")
            else:
                if self.disk is not None and self.disk.contains(key):
                    out[i] = self._promote_disk(key, parent)
                if out[i] is None and self.remote is not None:
                    remote_idx.append(i)  # not on disk, or the disk read failed
        if remote_idx:
            got = self._promote_remote([items[i] for i in remote_idx])
            for i, ok in zip(remote_idx, got):
                if ok:
                    out[i] = self._acquire_handle(items[i][0], "remote")
                else:
                    # Another thread may have promoted it meanwhile.
                    out[i] = self._acquire_handle(items[i][0], "cpu")
        return out

    def _acquire_handle(self, key: bytes, source: str) -> ReadHandle | None:
        buf = self.cpu.acquire(key)
        return ReadHandle(self.cpu, key, buf, source) if buf is not None else None

    def _promote_remote(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[bool]:
        """Read remote chunks straight into reserved CPU slots (one batched get).

        True where the chunk is now committed in CPU by this call. A failed get
        (absent, corrupt, timeout) aborts its slot and counts a promote failure:
        the tier keeps no stale existence, so the next lookup misses too.
        """
        assert self.remote is not None
        slots: list[tuple[int, bytes, bytes | None, np.ndarray]] = []
        for i, (key, parent) in enumerate(items):
            dst = self.cpu.reserve(key)
            if dst is not None:
                slots.append((i, key, parent, dst))
        out = [False] * len(items)
        if not slots:
            return out
        try:
            got = self.remote.get_many_into([(key, dst) for _, key, _, dst in slots])
        except Exception:  # defensive: a failing tier is a miss
            log.exception("kvtier: remote read failed")
            got = [False] * len(slots)
        failures = 0
        for (i, key, parent, _), ok in zip(slots, got):
            if ok:
                self.cpu.commit(key, parent)
                self._queue_disk(key, parent)
                out[i] = True
            else:
                self.cpu.abort(key)
                failures += 1
        with self._lock:
            self.counters.promoted_chunks_remote += len(slots) - failures
            self.counters.remote_promote_failures += failures
        return out

    def _promote_disk(self, key: bytes, parent: bytes | None) -> ReadHandle | None:
        assert self.disk is not None
        dst = self.cpu.reserve(key)
        if dst is None:
            # Another thread is promoting it right now, or no CPU slot can be freed
            # (all pinned by leases, referenced, or chain parents of such chunks).
            buf = self.cpu.acquire(key)
            if buf is not None:
                return ReadHandle(self.cpu, key, buf, "cpu")
            # A leased chunk must still load: read it into a private buffer (an
            # allocation, but only on this rare path) and serve it unpromoted.
            tmp = np.empty(self.chunk_bytes, dtype=np.uint8)
            try:
                ok = self.disk.get_into(key, tmp)
            except Exception:  # defensive: a failing tier is a miss
                log.exception("kvtier: disk read failed")
                ok = False
            return ReadHandle(None, key, tmp, "disk") if ok else None
        try:
            ok = self.disk.get_into(key, dst)
        except Exception:  # defensive: a failing tier is a miss
            log.exception("kvtier: disk read failed")
            ok = False
        if not ok:
            self.cpu.abort(key)
            return None
        self.cpu.commit(key, parent)
        with self._lock:
            self.counters.promoted_chunks += 1
        buf = self.cpu.acquire(key)
        return ReadHandle(self.cpu, key, buf, "disk") if buf is not None else None

    # -- prefetch --------------------------------------------------------------------
    def prefetch(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Queue promotion of a prompt's lower-tier chunks into CPU; returns chunks queued.

        Walks the chunk keys of ``tokens`` (as :meth:`lookup` would, leaving out the
        chunk of the last token): chunks in CPU are skipped, chunks on disk are
        queued, the rest are queued as remote candidates when a remote tier is
        configured (a background thread asks the remote tier about them in one
        round trip and promotes the leading run that exists); without a remote
        tier the walk stops at the first chunk no tier holds. Never blocks on I/O:
        the caller only hashes. A full prefetch queue drops the prompt (counted).
        """
        cs = self.namespace.chunk_size
        max_chunks = max(0, (len(tokens) - 1) // cs)
        keys = self.hasher.keys(tokens, cache_salt, max_chunks=max_chunks)[:max_chunks]
        job: list[tuple[bytes, bytes | None]] = []
        for i, key in enumerate(keys):
            if self.cpu.contains(key):
                continue
            on_disk = self.disk is not None and self.disk.contains(key)
            if not on_disk and self.remote is None:
                break
            job.append((key, keys[i - 1] if i else None))
        with self._lock:
            self.counters.prefetch_calls += 1
            if not job or self._closed:
                return 0
            if self._prefetcher is None:
                self._prefetcher = BatchWorker("kvtier-prefetch", self._prefetch_batch, self.PREFETCH_QUEUE, 1)
            prefetcher = self._prefetcher
        if not prefetcher.submit(job):
            with self._lock:
                self.counters.prefetch_dropped_chunks += len(job)
            return 0
        with self._lock:
            self.counters.prefetch_queued_chunks += len(job)
        return len(job)

    def _prefetch_batch(self, jobs: list[list[tuple[bytes, bytes | None]]]) -> None:
        """Prefetch thread: promote each job's chunks in prompt order, stopping at a gap."""
        for job in jobs:
            promoted = 0
            remote: list[tuple[bytes, bytes | None]] = []
            for n, (key, parent) in enumerate(job):
                if self.cpu.contains(key):
                    continue
                handle = None
                if self.disk is not None and self.disk.contains(key):
                    handle = self._promote_disk(key, parent)
                if handle is not None:
                    promoted += handle.source == "disk"
                    handle.close()
                    continue
                if self.remote is not None:
                    # From the first chunk the local tiers cannot serve, ask the remote tier.
                    remote = job[n:]
                break
            if remote and self.remote is not None:
                try:
                    found = self.remote.contains_many([k for k, _ in remote])
                except Exception:  # defensive: a failing tier is a miss
                    log.exception("kvtier: remote prefetch lookup failed")
                    found = []
                run = 0
                while run < len(found) and found[run]:
                    run += 1
                if run:
                    promoted += sum(self._promote_remote(remote[:run]))
            with self._lock:
                self.counters.prefetch_promoted_chunks += promoted

    # -- admin -----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for write-behind to reach the disk and remote tiers (and queued prefetches)."""
        ok = True
        if self._prefetcher is not None:
            ok = self._prefetcher.flush(timeout_s) and ok
        if self._remote_writer is not None:
            ok = self._remote_writer.flush(timeout_s) and ok
        if self.disk is not None:
            ok = self.disk.flush(timeout_s) and ok
        return ok

    def clear(self) -> dict[str, int]:
        """Remove every unreferenced chunk from every tier (remote: every chunk under its prefix/root)."""
        # Flush first: queued write-behind holds CPU references that would keep chunks alive.
        self.flush(30)
        out = {"cpu": self.cpu.clear()}
        if self.disk is not None:
            out["disk"] = self.disk.clear()
        if self.remote is not None:
            try:
                out["remote"] = self.remote.clear()
            except Exception:  # defensive: report nothing removed rather than raise
                log.exception("kvtier: clearing the remote tier failed")
                out["remote"] = 0
        return out

    def stats(self) -> dict[str, int | float]:
        c = self.counters
        out: dict[str, int | float] = dict(vars(c))
        out.update(
            cpu_chunks=len(self.cpu),
            cpu_used_bytes=self.cpu.used_bytes,
            cpu_capacity_bytes=self.cpu.capacity_bytes,
            cpu_evicted_chunks=self.cpu.evicted_chunks,
            cpu_evicted_bytes=self.cpu.evicted_bytes,
            leases=len(self.leases),
            leases_expired=self.leases.expired,
            pinned_chunks=self.leases.pinned_keys,
            referenced_chunks=self.cpu.referenced_chunks(),
        )
        if self._remote_writer is not None:
            out["remote_write_pending"] = self._remote_writer.pending
        if self.remote is not None:
            out.update(_remote_stats(self.remote))
        if self.disk is not None:
            d = self.disk
            out.update(
                disk_chunks=len(d),
                disk_used_bytes=d.used_bytes,
                disk_capacity_bytes=d.capacity_bytes,
                disk_evicted_chunks=d.evicted_chunks,
                disk_evicted_bytes=d.evicted_bytes,
                disk_written_chunks=d.written_chunks,
                disk_dropped_writes=d.dropped_writes,
                disk_failed_writes=d.failed_writes,
                disk_corrupt_reads=d.corrupt_reads,
                disk_read_errors=d.read_errors,
                disk_writable=int(d.writable),
            )
        return out

    def close(self) -> None:
        """Drop queued prefetches, flush write-behind, close the remote tier, release the disk directory.

        Idempotent. Bounded: remote write-behind drains within about
        ``remote_write_queue / REMOTE_WRITE_BATCH`` remote calls (each at most
        ``remote_timeout_s``; fewer once the tier's circuit breaker opens).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close(drain=False)
        if self._remote_writer is not None:
            if not self._remote_writer.close(60.0):
                log.warning("kvtier: remote write-behind did not finish within 60 s")
        if self.remote is not None:
            try:
                self.remote.close()
            except Exception:  # pragma: no cover - defensive
                log.exception("kvtier: closing the remote tier failed")
        if self.disk is not None:
            self.disk.close()


def _remote_stats(tier: Any) -> dict[str, int | float]:
    """A remote tier's numeric stats as ``remote_<name>`` (breaker states folded into counts)."""
    try:
        raw = tier.stats()
    except Exception:  # defensive: stats must not raise
        log.exception("kvtier: remote tier stats failed")
        return {}
    out: dict[str, int | float] = {}
    for name, value in raw.items():
        if isinstance(value, bool):
            out[f"remote_{name}"] = int(value)
        elif isinstance(value, (int, float)):
            out[f"remote_{name}"] = value
        elif name == "breakers" and isinstance(value, dict):
            out["remote_breakers_open"] = sum(1 for state in value.values() if state != "closed")
    return out
