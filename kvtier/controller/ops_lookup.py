"""The synchronous fleet operations: ``lookup``, ``instances`` and ``health``.

``lookup`` and ``instances`` answer from the controller's own state (registry + index);
``health`` too, unless ``live`` asks every instance now. Each takes an
:class:`~kvtier.controller.op_context.OpContext` first.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from kvtier.controller.endpoint import InstanceOpError
from kvtier.controller.errors import BadRequest
from kvtier.controller.op_context import OpContext
from kvtier.controller.registry import NamespaceEntry, epoch_fingerprint
from kvtier.controller.tracker import OpRecord
from kvtier.storage.types import TIER_KINDS
from kvtier.urls import mask_url

#: Tier labels always reported by lookup's per-tier shape.
REPORTED_TIERS = ("cpu", "disk", "remote")


def _tokens(n_chunks: int, entry: NamespaceEntry) -> int:
    return n_chunks * entry.namespace.chunk_size


def lookup(ctx: OpContext, tokens: Sequence[int] | None = None, keys: list[bytes] | None = None,
           cache_salt: str | None = None, instance: str | None = None) -> dict[str, Any]:
    """Longest cached prefix per instance, in both response shapes.

    Returns:
        ``{"layout_info": {instance: [LOCATION, tokens]}, "instances": {instance:
        {"longest_matched", "CPU", "DISK", "REMOTE", "pinned"}}}`` (tokens; LOCATION is
        the upper-cased fastest tier holding the longest single-tier prefix; only
        instances with a match appear in ``layout_info``).

    Raises:
        UnknownInstance, BadRequest.
    """
    if (tokens is None) == (keys is None):
        raise BadRequest("give exactly one of tokens or keys", "tokens")
    recs = ctx.targets(instance)
    hashed = ctx.hash_all(recs, tokens, keys, cache_salt)
    layout: dict[str, list[Any]] = {}
    per_inst: dict[str, dict[str, int]] = {}
    with ctx.state.lock:
        for r in recs:
            best = None
            for digest, entry in r.namespaces.items():
                m = ctx.state.index.match(r.instance, digest, hashed[digest])
                if best is None or m.longest > best[0].longest:
                    best = (m, entry)
            row = {"longest_matched": 0, **{t.upper(): 0 for t in REPORTED_TIERS}, "pinned": 0}
            for label in r.tiers:
                row.setdefault(label.upper(), 0)
            if best is not None:
                m, entry = best
                row["longest_matched"] = _tokens(m.longest, entry)
                row["pinned"] = _tokens(m.pinned, entry)
                for label, n in m.per_tier.items():
                    row[label.upper()] = _tokens(n, entry)
                if m.longest > 0:
                    top = max(m.per_tier.values(), default=0)
                    loc = next((t for t in TIER_KINDS if m.per_tier.get(t, -1) == top), "cpu")
                    layout[r.instance] = [loc.upper(), row["longest_matched"]]
            per_inst[r.instance] = row
    return {"layout_info": layout, "instances": per_inst}


def instances(ctx: OpContext) -> list[dict[str, Any]]:
    """Registered instances: ids, roles, peer URLs, tiers (with indexed chunks/bytes), namespaces, heartbeat age.
    URLs are shown masked (:func:`kvtier.urls.mask_url`), whatever an instance sent."""
    now = time.monotonic()
    out = []
    with ctx.state.lock:
        for r in ctx.state.registry.records():
            tiers = []
            for label, info in r.tiers.items():
                chunks = sum(ctx.state.index.tier_chunks(r.instance, d, label) for d in r.namespaces)
                nbytes = sum(ctx.state.index.tier_chunks(r.instance, d, label) * e.info.chunk_bytes
                             for d, e in r.namespaces.items())
                tiers.append({"kind": label, "name": mask_url(info.name), "capacity_bytes": info.capacity_bytes,
                              "shared": info.shared, "chunks": chunks, "bytes": nbytes})
            out.append({
                # The epoch proves an open controller's records (registry.py): only a fingerprint is shown.
                "instance": r.instance, "epoch": epoch_fingerprint(r.epoch), "role": r.role, "host": r.host,
                "pid": r.pid, "peer_url": mask_url(r.peer_url), "member": r.member,
                "registered_at": r.registered_at, "last_heartbeat": r.last_heartbeat,
                "last_seen_age_s": round(now - r.last_seen, 4), "tiers": tiers,
                "namespaces": [{"digest": d.hex(), "model": e.namespace.model, "chunk_size": e.info.chunk_size,
                                "chunk_bytes": e.info.chunk_bytes, "rank": e.namespace.rank,
                                "world_size": e.namespace.world_size} for d, e in r.namespaces.items()],
            })
    return out


def health(ctx: OpContext, instance: str | None = None, live: bool = False) -> dict[str, Any]:
    """Per instance: last heartbeat's tier health (``live``: ask each instance now, within the deadline,
    with ``probe``: every tier must answer one bounded round trip to count as reachable)."""
    recs = ctx.targets(instance)
    now = time.monotonic()
    out: dict[str, Any] = {}
    for r in recs:
        row: dict[str, Any] = {"last_seen_age_s": round(now - r.last_seen, 4), "tiers": dict(r.health)}
        out[r.instance] = row
    if live:
        rec = OpRecord("live-health", "health", {}, time.monotonic() + ctx.deadline_s)
        for r in recs:
            ns = next(iter(r.namespaces), b"")
            try:
                # live: each tier answers a bounded round trip (a dead store is unreachable at once)
                out[r.instance]["tiers"] = ctx.call(rec, r.instance, "health", ns, {"probe": True})
                out[r.instance]["reachable"] = True
            except InstanceOpError as exc:
                out[r.instance]["reachable"] = False
                out[r.instance]["error"] = str(exc)
    return {"instances": out}
