"""The tiers of one key namespace inside the cache service."""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.config import KVTierConfig
from kvtier.index.keys import KeyNamespace
from kvtier.memory.budget import BudgetShare, ByteBudget
from kvtier.memory.numa_topology import choose as choose_numa
from kvtier.memory.pool import ChunkPool
from kvtier.service.integrity import ChunkSums, verify_writes
from kvtier.service.ratelog import RateLimitedLog
from kvtier.memory.shared_segment import SharedSegment
from kvtier.transfer.assembly import open_lower_tiers
from kvtier.storage.manager import StorageManager
from kvtier.storage.stats import ManagerStats
from kvtier.storage.types import ReadHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamespaceStats:
    """One hosted namespace's stats: its manager's and the service's counters for it.

    Attributes:
        manager: the storage manager's (:class:`~kvtier.storage.stats.ManagerStats`).
        corrupt_chunks: CPU chunks that failed their commit checksum (dropped; chunks).
        expired_reservations: reservations aborted by the reservation timeout.
        quota_refusals: reserve/load calls refused by a client id's quota.
        load_failures: chunks clients asked to load that could not be served.
        stray_page_trims: times free slots' pages were found backed without a charge and released.
        cpu_charged_bytes / cpu_resident_bytes: CPU memory charged to the byte budget / resident (bytes).
    """

    manager: ManagerStats = field(default_factory=ManagerStats)
    corrupt_chunks: int = 0
    expired_reservations: int = 0
    quota_refusals: int = 0
    load_failures: int = 0
    stray_page_trims: int = 0
    cpu_charged_bytes: int = 0
    cpu_resident_bytes: int = 0

    def flat(self) -> dict[str, int | float]:
        """The manager's flat stats plus these counters under their field names."""
        out = self.manager.flat()
        out.update((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "manager")
        return out


class NamespaceHost:
    """A shared-memory CPU pool plus a :class:`StorageManager` for one namespace.

    The disk tier lives in ``<disk_path>/ns-<namespace digest>``; the server is the
    single owner of that directory.

    Args:
        config: the server's tier settings (``chunk_size`` is replaced by the
            namespace's).
        namespace: the clients' key namespace.
        cpu_bytes: the most CPU memory this namespace may use (bytes): its
            segment spans ``cpu_bytes // chunk_bytes`` slots.
        disk_bytes: its share of ``disk_capacity`` (bytes).
        verify_loads: check a CPU chunk's commit checksum before serving it
            (xxh3: ~25 GB/s here, about twice memcpy); the check before
            write-behind is always on.
        budget: the CPU byte budget this namespace shares with the others
            (see :mod:`kvtier.memory.budget`): the segment is then sparse and
            slots are charged to the budget as they are used. None: the whole
            segment is pre-touched and this namespace's alone.

    Raises:
        ValueError: the CPU share is below one chunk.
        DiskTierLocked: the namespace's disk directory is owned by another process.
    """

    def __init__(
        self,
        config: KVTierConfig,
        namespace: KeyNamespace,
        cpu_bytes: int,
        disk_bytes: int,
        verify_loads: bool = True,
        budget: ByteBudget | None = None,
    ):
        cb = namespace.chunk_bytes
        num_slots = cpu_bytes // cb
        if num_slots < 1:
            raise ValueError(f"cpu_capacity per namespace ({cpu_bytes} B) is below one chunk ({cb} B)")
        if config.disk_path is not None and disk_bytes < cb:
            raise ValueError(f"disk_capacity per namespace ({disk_bytes} B) is below one chunk ({cb} B)")
        self.namespace = namespace
        self.digest = namespace.digest()
        self.segment = SharedSegment.create(num_slots * cb, f"kvtier-{self.digest.hex()[:12]}", sparse=budget is not None,
                                            numa=choose_numa(config.cpu_numa_node))
        if self.segment.numa is not None:
            log.info("kvtier server: namespace %s: CPU segment of %d B %s", namespace.model[:128], num_slots * cb,
                     self.segment.numa.describe())
        self.share: BudgetShare | None = None
        if budget is not None:
            self.share = budget.share(self._give_back)
        self.pool = ChunkPool(
            cb, num_slots, buffer=self.segment.array, budget=self.share,
            release_pages=lambda slot: self.segment.release(slot * cb, cb),
        )
        self.pool.numa = self.segment.numa
        disk_path = None if config.disk_path is None else Path(config.disk_path) / f"ns-{self.digest.hex()[:32]}"
        cfg = config.model_copy(
            update=dict(
                chunk_size=namespace.chunk_size,
                cpu_capacity=num_slots * cb,
                disk_path=disk_path,
                disk_capacity=disk_bytes,
                peer_listen=None,  # the server runs one peer server for every namespace (peer_host.py)
            )
        )
        self.sums = ChunkSums(num_slots, self._resident)
        self.verify_loads = verify_loads
        self.expired_reservations = 0  # aborted by the reservation timeout
        self.quota_refusals = 0  # reserve/load calls refused by a client id's quota
        self.load_failures = 0  # chunks clients asked to load that could not be served (``/metrics``)
        self.stray_page_trims = 0  # times free slots' pages were backed without a charge and released
        self._warn = RateLimitedLog(log, 60.0)
        def lower(is_pinned: Callable[[bytes], bool]) -> list[Any]:  # storage tiers and peers (peer_listen: the server's)
            tiers = open_lower_tiers(cfg, namespace, is_pinned)
            return [verify_writes(t, self.sums) for t in tiers]

        try:
            self.manager = StorageManager(cfg, namespace, pool=self.pool, lower=lower)
        except BaseException:
            if self.share is not None:
                self.share.close()
            self.segment.close()
            raise

    def stats(self) -> dict[str, int | float]:
        """The manager's stats plus this namespace's service counters, by name (the wire ``stats`` op)."""
        return self.typed_stats().flat()

    def typed_stats(self) -> NamespaceStats:
        """The same numbers as :meth:`stats`, as fields (what ``/metrics`` reads)."""
        return NamespaceStats(
            self.manager.typed_stats(),
            corrupt_chunks=self.sums.corrupt,
            expired_reservations=self.expired_reservations,
            quota_refusals=self.quota_refusals,
            load_failures=self.load_failures,
            stray_page_trims=self.stray_page_trims,
            cpu_charged_bytes=self.pool.charged_bytes,
            cpu_resident_bytes=self.segment.resident_bytes(),
        )

    def _give_back(self) -> bool:
        """Free one CPU slot for another namespace (the budget asks; see :meth:`CpuTier.give_back`)."""
        manager = getattr(self, "manager", None)  # None while constructing (nothing charged yet)
        return manager is not None and manager.cpu.give_back()

    def trim(self) -> bool:
        """Release free slots' pages if more of the segment is backed than its slots charged.

        Only a client writing outside its reservations backs such pages (they
        are then charged to nobody); the maintenance pass calls this. Checked
        only for page-multiple slots (smaller ones share pages). Returns True
        if pages were released.
        """
        if self.share is None or self.pool.slot_bytes % mmap.PAGESIZE:
            return False
        if self.segment.resident_bytes() <= self.pool.charged_bytes:
            return False
        self.pool.release_free_pages()
        self.stray_page_trims += 1
        self._warn.warning(
            "", "stray", "kvtier server: a client of %s wrote outside its reservations; those pages were released",
            self.namespace.model[:128],
        )
        return True

    def _resident(self, key: bytes) -> bool:
        return self.manager.cpu.contains(key)

    def commit(self, key: bytes, parent: bytes | None, slot: int) -> None:
        """Checksum the filled slot, then publish the chunk (see :mod:`kvtier.service.integrity`)."""
        self.sums.record(key, self.pool.view(slot))
        self.manager.commit(key, parent)

    def open_verified(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[ReadHandle | None]:
        """``open_read_many`` whose CPU chunks match their commit checksum; a mismatch is a miss.

        A corrupted chunk is dropped from the CPU tier and counted in
        ``sums.corrupt``. If it cannot be dropped now (another reader holds it,
        or it is the parent of a resident chunk) its sum is kept, so every load
        of it stays a miss until it is evicted.
        """
        handles = self.manager.open_read_many(items)
        out: list[ReadHandle | None] = []
        for (key, _), h in zip(items, handles):
            if h is not None and h.source != "cpu":
                self.sums.record(key, h.buffer)  # promoted just now (the lower tier checked its own sum)
            elif h is not None and self.verify_loads and not self.sums.verify(key, h.buffer):
                h.close()
                self._drop_corrupt(key)
                h = None
            out.append(h)
        return out

    def open_for_client(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[tuple[ReadHandle, int | None] | None]:
        """``open_read_many`` for a client that verifies CPU chunks itself as it reads them.

        Per item: None (a miss), or the handle and the commit checksum the client must find
        (None: nothing to check, a chunk promoted just now from a lower tier, which checked
        its own sum; its sum is recorded here for later loads). A CPU chunk whose sum was
        pruned from the table gets one now (as :meth:`ChunkSums.verify` does).
        """
        out: list[tuple[ReadHandle, int | None] | None] = []
        for (key, _), h in zip(items, self.manager.open_read_many(items)):
            if h is None:
                out.append(None)
            elif h.source != "cpu":
                self.sums.record(key, h.buffer)
                out.append((h, None))
            elif not self.verify_loads:  # the server's operator turned load checks off
                out.append((h, None))
            else:
                out.append((h, self.sums.expected(key, h.buffer)))
        return out

    def report_corrupt(self, handle: ReadHandle) -> bool:
        """A client found ``handle``'s slot differs from its commit checksum: check it here (the
        client may be wrong, or the bytes changed back) and, if it does differ, drop the chunk as
        :meth:`open_verified` does. Closes the handle. True if the chunk failed here too."""
        try:
            bad = not self.sums.verify(handle.key, handle.buffer)
        finally:
            handle.close()
        if bad:
            self._drop_corrupt(handle.key)
        return bad

    def _drop_corrupt(self, key: bytes) -> None:
        if self.manager.cpu.delete(key):
            self.sums.forget(key)
        self._warn.warning(
            "", "corrupt", "kvtier server: chunk %s of %s failed its checksum (its slot was overwritten "
            "in shared memory); served as a miss and dropped", key.hex()[:16], self.namespace.model[:128],
        )

    def close(self) -> None:
        if self.share is not None:
            self.share.close()  # first: no other namespace asks this one for slots any more
        self.manager.close()
        self.segment.close()
