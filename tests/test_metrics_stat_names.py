"""Every stat the server's ``/metrics`` reads is one a hosted namespace's stats really carry.

``service/metrics.py`` reads ``StorageManager.stats()`` (plus the namespace host's counters) by
name, with 0 for a missing one; a renamed counter would otherwise leave ``/metrics`` silently
(its series stuck at 0). This test builds a namespace with every tier /metrics reports on (CPU,
disk, a Redis remote tier) and checks each name, so a rename fails here. (It found
``load_failures``, exported since the first server and produced by nothing since the storage
redesign.)
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.dashboard.server_view import SERVER_COUNTERS, TIER_SERIES
from kvtier.index.keys import KeyNamespace, LayoutSignature
from kvtier.service import metrics
from kvtier.service.namespace_host import NamespaceHost


def test_every_stat_metrics_reads_is_produced(tmp_path: Path, redis_url: str) -> None:
    layout = LayoutSignature(engine="t", attn_backend="numpy", kv_layout="LBHNC", block_size=16, num_layers=2,
                             num_kv_heads=1, head_dim=8, dtype="bfloat16")
    ns = KeyNamespace("t/stat-names", layout, 32)
    # Redis: the remote tier with per-node circuit breakers (``remote_breaker_trips``); nothing is stored
    cfg = KVTierConfig(chunk_size=32, disk_path=tmp_path / "disk", disk_capacity=64 * ns.chunk_bytes,
                       remote_url=f"{redis_url}?key_prefix=kvt-stat-names-{os.getpid()}:")
    host = NamespaceHost(cfg, ns, 16 * ns.chunk_bytes, 64 * ns.chunk_bytes)
    try:
        st = host.stats()
        exposition = metrics.ServerMetrics(lambda: (1, [host.stats()]), cfg,
                                           lambda: list(host.manager.lower)).exposition().decode()
    finally:
        host.close()
    # ... and every series the server's dashboard shows is one /metrics renders
    series = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line and line[0] != "#"}
    shown = {*(name for _, name in SERVER_COUNTERS), *(n for cells in TIER_SERIES.values() for n in cells.values())}
    assert not sorted(shown - series), f"the dashboard shows series /metrics lacks: {sorted(shown - series)}"
    read = {*metrics._COUNTER_STATS, *metrics._GAUGE_STATS, *(f"remote_{s}" for s in metrics._REMOTE_COUNTERS),
            "cpu_capacity_bytes", "disk_capacity_bytes"}
    missing = sorted(read - set(st))
    assert not missing, f"/metrics reads stats no hosted namespace reports (renamed?): {missing}"
    assert all(isinstance(st[k], (int, float)) and not isinstance(st[k], bool) for k in read)
