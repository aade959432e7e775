"""``locate``: which live instances can serve a run of chunk keys to a peer, and where.

The controller-directed P2P tier (:mod:`kvtier.transfer.directed_peer`) asks this on a
local miss instead of asking every peer: the answer lists every live instance that
registered a ``peer_url`` and stores the namespace, each with the leading asked keys its
own CPU/disk tiers hold (what its peer server serves, bounded by its declared capacity),
longest first. Only authenticated members are listed, with their public key, so the asker's
peer tier dials exactly that member (issue 24); an unauthenticated registration (an open,
loopback controller) is listed only with a ``shm://`` URL, which the asker accepts only from a
process of its own user. It is read from the
controller's index only (no instance is contacted): O(len(keys) x instances) dict look-ups
under the state lock.
"""

from __future__ import annotations

from kvtier.controller.errors import BadRequest
from kvtier.controller.op_context import OpContext
from kvtier.protocol.fleet import MAX_LOCATE_KEYS, LocateReply, PeerLocation


def locate(ctx: OpContext, keys: list[bytes], namespace: bytes, exclude_instance: str | None = None,
           exclude_host: str | None = None, exclude_pid: int | None = None) -> LocateReply:
    """Live peer-serving instances of ``namespace`` and the leading ``keys`` each holds locally.

    Args:
        keys: 32-byte chunk keys in prompt order (at most :data:`MAX_LOCATE_KEYS`).
        namespace: the 32-byte namespace digest the keys belong to.
        exclude_instance: the asker's instance id (never listed).
        exclude_host / exclude_pid: the asker's process (both given: instances registered from that
            host and pid are never listed: an instance never pulls from itself, whatever its id).

    Returns:
        :class:`~kvtier.protocol.fleet.LocateReply`, longest run first (ties: instance id order).

    Raises:
        BadRequest: a key or digest that is not 32 bytes, or too many keys.
    """
    if len(namespace) != 32:
        raise BadRequest("namespace must be a 32-byte digest", "namespace")
    if len(keys) > MAX_LOCATE_KEYS:
        raise BadRequest(f"at most {MAX_LOCATE_KEYS} keys", "keys")
    if any(len(k) != 32 for k in keys):
        raise BadRequest("every key must be 32 bytes", "keys")
    rows: list[PeerLocation] = []
    with ctx.state.lock:
        for rec in ctx.state.registry.records():
            if not rec.peer_url or namespace not in rec.namespaces or rec.instance == exclude_instance:
                continue
            if exclude_host is not None and exclude_pid is not None and (rec.host, rec.pid) == (exclude_host, exclude_pid):
                continue
            if not rec.authenticated and not rec.peer_url.startswith("shm://"):
                continue  # a claim nobody proved: never pointed at
            rows.append(PeerLocation(rec.instance, rec.peer_url, ctx.state.index.local_run(rec.instance, namespace, keys),
                                     rec.member_key))
    rows.sort(key=lambda r: (-r.chunks, r.instance))
    return LocateReply(namespace.hex(), rows)
