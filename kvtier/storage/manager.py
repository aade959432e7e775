"""The storage manager: one entry point over the token index, leases and tiers.

- ``lookup`` walks a prompt's chunk keys and returns the longest prefix held by
  any tier, never the whole prompt (the engine must compute >= 1 token), and
  optionally leases those chunks until the load.
- ``open_write``/``commit`` store into the CPU tier synchronously; committed
  chunks are queued for the disk tier (write-behind): the engine's step never
  waits for disk.
- ``open_read`` serves a chunk from the fastest tier that has it; a disk hit is
  promoted into the CPU tier first.

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
from typing import Sequence

import numpy as np

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace
from kvtier.storage.leases import LeaseTable
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
        tiers: for each hit chunk, the tier that holds it ("cpu" or "disk").
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
    loaded_chunks: int = 0
    load_failures: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_skipped: int = 0
    promoted_chunks: int = 0


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

    def __init__(self, tier: CpuTier, key: bytes, buffer: np.ndarray, source: str):
        self._tier: CpuTier | None = tier
        self.key = key
        self.buffer = buffer  # uint8 [chunk_bytes]
        self.source = source  # "cpu" or "disk"

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

    Raises:
        ValueError: capacities too small for one chunk.
        DiskTierLocked: the disk directory is owned by another process.
    """

    def __init__(self, config: KVTierConfig, namespace: KeyNamespace):
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
        log.info("kvtier storage: chunk_bytes=%d %s", self.chunk_bytes, config.describe())

    # -- index -----------------------------------------------------------------
    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Chunk keys of every full chunk of ``tokens``."""
        return self.hasher.keys(tokens, cache_salt)

    def where(self, key: bytes) -> str | None:
        """Fastest tier holding ``key``, or None."""
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
        return self.where(key) is not None

    def open_write(self, key: bytes) -> np.ndarray | None:
        """Reserve a CPU slot for ``key``; returns the uint8 ``[chunk_bytes]`` buffer to fill.

        Returns None when the chunk is already stored in any tier or no slot can be
        freed; the caller skips the store. Follow with :meth:`commit` or :meth:`abort`.
        """
        if self.where(key) is not None:
            return None
        buf = self.cpu.reserve(key)
        if buf is None:
            with self._lock:
                self.counters.store_skipped += 1
        return buf

    def commit(self, key: bytes, parent: bytes | None = None) -> None:
        """Publish a filled chunk and queue it for the disk tier (write-behind).

        ``parent``: key of the previous chunk of the prompt (None for the first).
        """
        self.cpu.commit(key, parent)
        with self._lock:
            self.counters.stored_chunks += 1
            self.counters.stored_bytes += self.chunk_bytes
        if self.disk is not None and self.disk.writable:
            buf = self.cpu.acquire(key)
            if buf is not None:
                self.disk.put_async(key, buf, lambda: self.cpu.release(key), parent)

    def abort(self, key: bytes) -> None:
        self.cpu.abort(key)

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark a stored prompt's chunks as used, tail first (see module doc)."""
        self._touch_chain(keys)

    # -- read path -------------------------------------------------------------------
    def open_read(self, key: bytes, parent: bytes | None = None) -> ReadHandle | None:
        """Hold ``key`` for reading from the fastest tier; None on a miss or failure.

        A disk hit is read into a fresh CPU slot (promotion) and served from there.
        Never raises for tier failures: a failing tier is a miss.
        """
        buf = self.cpu.acquire(key)
        if buf is not None:
            return ReadHandle(self.cpu, key, buf, "cpu")
        if self.disk is None or not self.disk.contains(key):
            return None
        dst = self.cpu.reserve(key)
        if dst is None:
            # Either another thread is promoting it right now or CPU is full of
            # pinned chunks; retry the CPU once, otherwise a miss.
            buf = self.cpu.acquire(key)
            return ReadHandle(self.cpu, key, buf, "cpu") if buf is not None else None
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

    # -- admin -----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for write-behind to reach the disk tier."""
        return True if self.disk is None else self.disk.flush(timeout_s)

    def clear(self) -> dict[str, int]:
        """Remove every unreferenced chunk from every tier."""
        # Flush first: queued write-behind holds CPU references that would keep chunks alive.
        self.flush(30)
        out = {"cpu": self.cpu.clear()}
        if self.disk is not None:
            out["disk"] = self.disk.clear()
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
        """Flush write-behind and release the disk directory."""
        if self.disk is not None:
            self.disk.close()
