"""``/metrics`` renders from a real namespace, and what it reads is really produced.

``service/metrics.py`` reads a hosted namespace's stats as fields of
:class:`~kvtier.service.namespace_host.NamespaceStats` (the manager's
:class:`~kvtier.storage.stats.ManagerStats`, one ``LowerTierStats`` per tier), so a renamed
manager or service stat is a type error (mypy), not a series stuck at 0. Two string
boundaries remain, checked here on a namespace with every tier ``/metrics`` reports on (CPU,
disk, a Redis remote tier): a lower tier's own ``stats()`` dict, from which the per-tier
fields are read by name (a tier that renames a number would give 0), and the series names
the server's dashboard shows. The wire ``stats`` op keeps the flat names (``flat()``).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.dashboard.server_view import SERVER_COUNTERS, TIER_SERIES
from kvtier.index.keys import KeyNamespace, LayoutSignature
from kvtier.service import metrics
from kvtier.service.namespace_host import NamespaceHost

#: The per-tier numbers /metrics reads from each tier's own ``stats()`` (``LowerTierStats`` fields).
DISK_READS = {"chunks", "used_bytes", "capacity_bytes", "evicted_chunks", "evicted_bytes", "written_chunks"}
REMOTE_READS = {"puts", "put_ok", "put_failed", "gets", "get_hits", "get_corrupt", "errors", "skipped_calls",
                "breaker_trips", "bytes_read", "bytes_written"}


def test_metrics_render_from_a_real_namespace_and_read_what_tiers_report(tmp_path: Path, redis_url: str) -> None:
    layout = LayoutSignature(engine="t", attn_backend="numpy", kv_layout="LBHNC", block_size=16, num_layers=2,
                             num_kv_heads=1, head_dim=8, dtype="bfloat16")
    ns = KeyNamespace("t/stat-names", layout, 32)
    # Redis: the remote tier with per-node circuit breakers (``breaker_trips``); nothing is stored
    cfg = KVTierConfig(chunk_size=32, disk_path=tmp_path / "disk", disk_capacity=64 * ns.chunk_bytes,
                       remote_url=f"{redis_url}?key_prefix=kvt-stat-names-{os.getpid()}:")
    host = NamespaceHost(cfg, ns, 16 * ns.chunk_bytes, 64 * ns.chunk_bytes)
    try:
        typed = host.typed_stats()
        flat = host.stats()
        exposition = metrics.ServerMetrics(lambda: (1, [host.typed_stats()]), None,
                                           lambda: list(host.manager.lower)).exposition().decode()
    finally:
        host.close()
    # every series the server's dashboard shows is one /metrics renders
    series = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line and line[0] != "#"}
    shown = {*(name for _, name in SERVER_COUNTERS), *(n for cells in TIER_SERIES.values() for n in cells.values())}
    assert not sorted(shown - series), f"the dashboard shows series /metrics lacks: {sorted(shown - series)}"
    # the per-tier numbers /metrics reads are ones the tiers really report (by these names)
    disk, remote = typed.manager.tier("disk"), typed.manager.tier("remote")
    assert not sorted(DISK_READS - set(disk.reported)), "the disk tier no longer reports a number /metrics reads"
    assert not sorted(REMOTE_READS - set(remote.reported)), "the Redis tier no longer reports a number /metrics reads"
    assert disk.capacity_bytes == 64 * ns.chunk_bytes
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in exposition.splitlines()
              if line.startswith("kvtier_") and "{" not in line}
    assert values["kvtier_disk_capacity_bytes"] == disk.capacity_bytes  # read from the fields (no config given)
    # the wire form keeps the names the dashboards, demo and tests read, every value a number
    assert {"cpu_chunks", "disk_chunks", "remote_puts", "promoted_chunks", "remote_write_pending",
            "corrupt_chunks", "load_failures", *metrics.COUNTER_STAT_NAMES} <= set(flat)
    assert set(flat) == set(typed.flat())
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat.values())
