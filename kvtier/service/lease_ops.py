"""Lookup and lease release: the one code path of the cache server and the engine's lookup endpoint.

Invariant: no lease outlives a failed call. A lookup with an owner pins its hits
first (the manager grants the lease before checking, so a chunk seen present
cannot be evicted before the lease covers it); if anything after that fails (a
tier label the protocol cannot encode, an exception anywhere in the handler),
the owner's lease is ended before the error reply is sent. A connection that
ends (including a client that gave up after its timeout) ends every lease it
was granted (:meth:`kvtier.service.session.Holds.release_all`).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvtier.protocol import Lookup, ReleaseLease, encode_tiers
from kvtier.service.session import Holds
from kvtier.storage.types import LookupResult


class LeaseManager(Protocol):
    """What the two ops need of a storage manager."""

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult: ...

    def release(self, lease_owner: str) -> None: ...

    def abort(self, key: bytes) -> None: ...


def lookup_op(manager: LeaseManager, holds: Holds, prefix: str, req: Lookup) -> tuple[LookupResult, bytes]:
    """Answer ``req``: the hit prefix and its tier codes (one byte per hit chunk).

    The lease owner is ``prefix + req.owner`` and is tracked in ``holds``.

    Raises:
        ProtocolError: ``INTERNAL`` for a tier label outside the tier table; any
            exception of the manager. Either way the owner's lease is ended first.
    """
    owner = None if req.owner is None else prefix + req.owner
    keys = req.keys
    quota = holds.quota
    if owner is not None:
        holds.add_owner(owner, manager)
        if quota is not None:
            table = getattr(manager, "leases", None)
            size = (lambda o: 0) if table is None else table.size
            room = quota.lease_room(owner, size)
            if room < len(keys):
                keys = keys[: max(0, room)]  # beyond the client's lease quota: a miss, not pinned
    try:
        res = manager.lookup_keys(keys, owner)
        if owner is not None and quota is not None:
            quota.set_lease(owner, len(res.keys))
        codes = encode_tiers(res.tiers)
        if len(codes) != len(res.keys) or len(codes) > len(req.keys):
            raise RuntimeError(f"lookup returned {len(res.keys)} keys and {len(codes)} tiers for {len(req.keys)} keys")
    except BaseException:
        if owner is not None:
            manager.release(owner)
            holds.owners.pop(owner, None)
            if quota is not None:
                quota.set_lease(owner, 0)
        raise
    return res, codes


def release_op(manager: LeaseManager, holds: Holds, prefix: str, req: ReleaseLease) -> None:
    """End the lease of ``prefix + req.owner`` (a no-op if it has none)."""
    owner = prefix + req.owner
    manager.release(owner)
    holds.owners.pop(owner, None)
    if holds.quota is not None:
        holds.quota.set_lease(owner, 0)
