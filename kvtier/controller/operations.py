"""Fleet operations composed from instance operations: the :class:`FleetOps` facade.

``lookup``, ``locate``, ``instances`` and ``health`` answer from the controller's own state. Every
other operation (clear, pin, unpin, move, compress, decompress) is asynchronous: it is
validated synchronously (bad input raises :class:`BadRequest` / :class:`UnknownInstance`
before anything is sent), gets an ``event_id`` and runs on a worker thread; its record
goes pending -> running -> done | failed (with a reason) and always reaches a terminal
state by its deadline (:meth:`OpTracker.get` fails an overdue record itself).

Instance operations (``OpRequest.args``): ``keys``/``parents`` are binaries of ``n * 32``
bytes, tiers are labels (``cpu``/``disk``/``remote``), plus ``codec``, ``ttl_s``,
``pin_id``, ``copy``, ``src``, ``dst``, ``tier``.

Where the parts live: :mod:`.errors` (the errors), :mod:`.tracker` (records and their
tracker), :mod:`.op_context` (what every operation runs on), :mod:`.ops_lookup`
(lookup, instances, health), :mod:`.ops_cache` (clear, pin, unpin), :mod:`.ops_move`
(move, compress). Their public names are importable from here too.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.controller import ops_cache, ops_locate, ops_lookup, ops_move
from kvtier.controller.errors import BadRequest, UnknownInstance
from kvtier.controller.op_context import DEFAULT_OP_DEADLINE_S, OpContext
from kvtier.controller.ops_lookup import REPORTED_TIERS
from kvtier.controller.tracker import DEFAULT_HISTORY, TERMINAL, OpRecord, OpTracker
from kvtier.protocol.fleet import LocateReply

__all__ = [
    "DEFAULT_HISTORY", "DEFAULT_OP_DEADLINE_S", "REPORTED_TIERS", "TERMINAL",
    "BadRequest", "FleetOps", "OpContext", "OpRecord", "OpTracker", "UnknownInstance",
]


class FleetOps(OpContext):
    """The fleet operations (see the module docstring); each method is documented in its module.

    Args:
        state: fleet state (registry + index).
        endpoint: sends instance operations.
        deadline_s: default deadline of one operation (seconds).
        workers: operations run at once; more wait pending.
        history: terminal operation records kept for :meth:`check_finish`.
    """

    # -- synchronous (:mod:`.ops_lookup`) -------------------------------------------

    def lookup(self, tokens: Sequence[int] | None = None, keys: list[bytes] | None = None,
               cache_salt: str | None = None, instance: str | None = None) -> dict[str, Any]:
        """Longest cached prefix per instance (:func:`.ops_lookup.lookup`).

        Raises:
            UnknownInstance, BadRequest.
        """
        return ops_lookup.lookup(self, tokens, keys, cache_salt, instance)

    def locate(self, keys: list[bytes], namespace: bytes, exclude_instance: str | None = None,
               exclude_host: str | None = None, exclude_pid: int | None = None) -> LocateReply:
        """Live peer-serving instances and the leading ``keys`` each holds (:func:`.ops_locate.locate`).

        Raises:
            BadRequest.
        """
        return ops_locate.locate(self, keys, namespace, exclude_instance, exclude_host, exclude_pid)

    def instances(self) -> list[dict[str, Any]]:
        """Registered instances (:func:`.ops_lookup.instances`)."""
        return ops_lookup.instances(self)

    def health(self, instance: str | None = None, live: bool = False) -> dict[str, Any]:
        """Per-instance tier health (:func:`.ops_lookup.health`).

        Raises:
            UnknownInstance.
        """
        return ops_lookup.health(self, instance, live)

    def check_finish(self, event_id: str) -> dict[str, Any] | None:
        """The operation's record as JSON, or None if unknown (never issued or forgotten)."""
        return self.tracker.get(event_id)

    # -- asynchronous (:mod:`.ops_cache`, :mod:`.ops_move`) ---------------------------

    def clear(self, instance: str | None = None, tier: str | None = None, cache_salt: str | None = None) -> OpRecord:
        """Clear every chunk of the scope (:func:`.ops_cache.clear`).

        Raises:
            UnknownInstance, BadRequest.
        """
        return ops_cache.clear(self, instance, tier, cache_salt)

    def pin(self, tokens: Sequence[int], instance: str | None = None, ttl_s: float | None = None,
            cache_salt: str | None = None) -> OpRecord:
        """Pin the cached prefix of ``tokens`` (:func:`.ops_cache.pin`).

        Raises:
            UnknownInstance, BadRequest.
        """
        return ops_cache.pin(self, tokens, instance, ttl_s, cache_salt)

    def unpin(self, tokens: Sequence[int] | None = None, instance: str | None = None, pin_id: str | None = None,
              cache_salt: str | None = None) -> OpRecord:
        """Release pins (:func:`.ops_cache.unpin`).

        Raises:
            UnknownInstance, BadRequest.
        """
        return ops_cache.unpin(self, tokens, instance, pin_id, cache_salt)

    def move(self, tokens: Sequence[int], src_instance: str, dst_tier: str, dst_instance: str | None = None,
             src_tier: str | None = None, copy: bool = False, cache_salt: str | None = None) -> OpRecord:
        """Move (or copy) the cached prefix of ``tokens`` (:func:`.ops_move.move`).

        Raises:
            UnknownInstance, BadRequest.
        """
        return ops_move.move(self, tokens, src_instance, dst_tier, dst_instance, src_tier, copy, cache_salt)

    def compress(self, tokens: Sequence[int], codec: str, instance: str | None = None, tier: str | None = None,
                 cache_salt: str | None = None) -> OpRecord:
        """Re-encode the cached prefix of ``tokens`` with ``codec`` (:func:`.ops_move.compress`).

        Raises:
            UnknownInstance, BadRequest.
        """
        return ops_move.compress(self, tokens, codec, instance, tier, cache_salt)
