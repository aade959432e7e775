"""The tiers of one key namespace inside the cache service."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.index.keys import KeyNamespace
from kvtier.memory.pool import ChunkPool
from kvtier.service.shm import SharedSegment
from kvtier.storage.manager import StorageManager


class NamespaceHost:
    """A shared-memory CPU pool plus a :class:`StorageManager` for one namespace.

    The disk tier lives in ``<disk_path>/ns-<namespace digest>``; the server is the
    single owner of that directory.

    Args:
        config: the server's tier settings (``chunk_size`` is replaced by the
            namespace's).
        namespace: the clients' key namespace.
        cpu_bytes: this namespace's share of ``cpu_capacity`` (bytes).
        disk_bytes: its share of ``disk_capacity`` (bytes).

    Raises:
        ValueError: the CPU share is below one chunk.
        DiskTierLocked: the namespace's disk directory is owned by another process.
    """

    def __init__(self, config: KVTierConfig, namespace: KeyNamespace, cpu_bytes: int, disk_bytes: int):
        cb = namespace.chunk_bytes
        num_slots = cpu_bytes // cb
        if num_slots < 1:
            raise ValueError(f"cpu_capacity per namespace ({cpu_bytes} B) is below one chunk ({cb} B)")
        if config.disk_path is not None and disk_bytes < cb:
            raise ValueError(f"disk_capacity per namespace ({disk_bytes} B) is below one chunk ({cb} B)")
        self.namespace = namespace
        self.digest = namespace.digest()
        self.segment = SharedSegment.create(num_slots * cb, f"kvtier-{self.digest.hex()[:12]}")
        self.pool = ChunkPool(cb, num_slots, buffer=self.segment.array)
        disk_path = None if config.disk_path is None else Path(config.disk_path) / f"ns-{self.digest.hex()[:32]}"
        cfg = config.model_copy(
            update=dict(
                chunk_size=namespace.chunk_size,
                cpu_capacity=num_slots * cb,
                disk_path=disk_path,
                disk_capacity=disk_bytes,
            )
        )
        try:
            self.manager = StorageManager(cfg, namespace, pool=self.pool)
        except BaseException:
            self.segment.close()
            raise

    def close(self) -> None:
        self.manager.close()
        self.segment.close()
