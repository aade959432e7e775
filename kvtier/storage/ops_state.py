"""What an instance holds and how its tiers are: the bodies of ``snapshot`` and ``health``.

Both are read-only and run without the operations lock
(:class:`kvtier.storage.instance_ops.InstanceOps`). A tier that fails is left
out of a snapshot and reported unreachable or with zero counts in health,
never raised.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import KEY_BYTES
from kvtier.tiers.base import LowerTier

log = logging.getLogger(__name__)

__all__ = ["probe", "resident_chunks", "tier_health"]


def resident_chunks(m: StorageManager) -> dict[str, list[tuple[bytes, bytes | None]]]:
    """Resident ``(key, parent)`` chunks per tier label; see
    :meth:`kvtier.storage.instance_ops.InstanceOps.snapshot`."""
    out: dict[str, list[tuple[bytes, bytes | None]]] = {"cpu": m.cpu.resident()}
    for tier in m.lower:
        try:
            items = list(tier.scan_keys())
        except NotImplementedError:
            continue
        except Exception:  # defensive: a failing tier is left out
            log.exception("kvtier ops: listing %s failed", tier.name)
            continue
        out.setdefault(tier.kind, []).extend(items)
    return out


def tier_health(m: StorageManager, probe_tiers: bool = False) -> dict[str, dict[str, Any]]:
    """Per tier label, its health from the tiers' stats; see
    :meth:`kvtier.storage.instance_ops.InstanceOps.health` for the fields."""
    cpu = m.cpu
    out: dict[str, dict[str, Any]] = {
        "cpu": {
            "reachable": True, "read_errors": 0, "write_errors": 0, "breaker": "n/a",
            "queue_depth": 0, "used_bytes": cpu.used_bytes, "capacity_bytes": cpu.capacity_bytes,
            "chunks": len(cpu),
        }
    }
    for i, (label, tier) in enumerate(zip(m._prefixes, m.lower)):
        try:
            st = dict(tier.stats())
        except Exception:
            log.exception("kvtier ops: stats of %s failed", tier.name)
            st = {}
        breakers = st.get("breakers")
        if isinstance(breakers, dict) and breakers:
            states = set(breakers.values())
            breaker = "open" if "open" in states else "half_open" if states - {"closed"} else "closed"
        else:
            breaker = "n/a" if not isinstance(breakers, dict) else "closed"
        reachable = breaker != "open" and not getattr(tier, "_closed", False)
        root = getattr(tier, "root", None)
        if root is not None and hasattr(root, "is_dir"):
            reachable = reachable and root.is_dir()
        if probe_tiers and reachable:
            reachable = probe(tier)
        write_errors = st.get("failed_writes", st.get("put_failed", 0))
        out[label] = {
            "reachable": bool(reachable),
            "read_errors": int(st.get("read_errors", 0)) + int(st.get("get_corrupt", 0)),
            "write_errors": int(write_errors),
            "errors": int(st.get("errors", 0)),
            "breaker": breaker,
            "queue_depth": int(m.write_behind.pending(i)),
            "used_bytes": int(st.get("used_bytes", 0)),
            "capacity_bytes": int(st.get("capacity_bytes", 0)),
            "chunks": int(st.get("chunks", 0)),
        }
    return out


def probe(tier: LowerTier) -> bool:
    """One bounded ``contains`` round trip to ``tier``; True if it added no error or skipped call."""

    def failures() -> int:
        st = tier.stats()
        return int(st.get("errors", 0)) + int(st.get("skipped_calls", 0))

    try:
        before = failures()
        tier.contains_many([b"\xff" * KEY_BYTES])
        return failures() == before
    except Exception:
        return False
