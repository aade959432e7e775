"""The namespaces an agent reports, and its subscriptions to their storage managers' tier changes.

Each namespace is a digest -> (its :class:`~kvtier.protocol.fleet.NamespaceInfo`, its
:class:`~kvtier.storage.instance_ops.InstanceOps`). Attaching one subscribes a
:class:`~kvtier.fleet.changes.ChangeQueue` listener to the storage manager behind the ops
(``ops.m``) where it has ``subscribe``; detaching or closing unsubscribes it. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvtier.fleet.changes import ChangeQueue
from kvtier.fleet.identity import manager_of
from kvtier.fleet.op_runner import OpsLike
from kvtier.protocol import fleet as F

log = logging.getLogger(__name__)


class NamespaceSet:
    """The reported namespaces of one agent.

    Args:
        changes: the queue the tier-change listeners feed.
    """

    def __init__(self, changes: ChangeQueue):
        self._changes = changes
        self._lock = threading.Lock()  # guards _namespaces and _unsubs
        self._namespaces: dict[bytes, tuple[F.NamespaceInfo, OpsLike]] = {}
        self._unsubs: dict[bytes, Callable[[], None]] = {}

    def __contains__(self, digest: object) -> bool:
        with self._lock:
            return digest in self._namespaces

    def attach(self, digest: bytes, info: F.NamespaceInfo, ops: OpsLike) -> None:
        """Add a namespace and subscribe to its manager's tier changes (no-op if known)."""
        with self._lock:
            if digest in self._namespaces:
                return
            self._namespaces[digest] = (info, ops)
        manager = manager_of(ops)
        subscribe = getattr(manager, "subscribe", None)
        if subscribe is None:
            return
        listener = self._changes.listener(digest)
        subscribe(listener)

        def unsub() -> None:
            fn = getattr(manager, "unsubscribe", None)
            if fn is not None:
                fn(listener)

        with self._lock:
            self._unsubs[digest] = unsub

    def detach(self, digest: bytes) -> bool:
        """Remove a namespace and unsubscribe its listener; True if it was there.

        Raises:
            whatever the manager's ``unsubscribe`` raises.
        """
        with self._lock:
            entry = self._namespaces.pop(digest, None)
            unsub = self._unsubs.pop(digest, None)
        if unsub is not None:
            unsub()
        return entry is not None

    def snapshot(self) -> dict[bytes, tuple[F.NamespaceInfo, OpsLike]]:
        """A copy of digest -> (info, ops)."""
        with self._lock:
            return dict(self._namespaces)

    def infos(self) -> list[F.NamespaceInfo]:
        """The namespaces' infos (for ``Register``)."""
        with self._lock:
            return [info for info, _ in self._namespaces.values()]

    def unsubscribe_all(self) -> None:
        """Remove every listener (the namespaces stay); a failing unsubscribe is logged, never raised."""
        with self._lock:
            unsubs, self._unsubs = list(self._unsubs.values()), {}
        for unsub in unsubs:
            try:
                unsub()
            except Exception:
                log.exception("kvtier fleet agent: unsubscribing failed")
