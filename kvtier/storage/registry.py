"""Process-local directory of storage managers, by engine id.

vLLM builds two connector objects per engine: the scheduler side (lookup,
leases) and the worker side (copies, owner of the tiers). When both live in one
process (in-process engine core) the scheduler side finds the worker's manager
here and calls it directly; otherwise it reaches it over the lookup RPC
(``kvtier.service.lookup_endpoint``). This map is the only process-wide state
in kvtier. The last ``release`` of a manager closes it (flushes write-behind).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable

from kvtier.storage.manager import StorageManager

_lock = threading.Lock()
_managers: dict[str, list[Any]] = {}  # engine id -> [manager, refcount]


def acquire(name: str, factory: Callable[[], StorageManager]) -> StorageManager:
    """The process's manager registered as ``name``, created by ``factory`` on first use."""
    with _lock:
        slot = _managers.get(name)
        if slot is None:
            slot = _managers[name] = [factory(), 0]
        slot[1] += 1
        manager: StorageManager = slot[0]
        return manager


def get(name: str) -> StorageManager | None:
    """The manager registered as ``name`` in this process, if any (no reference taken)."""
    with _lock:
        slot = _managers.get(name)
        return None if slot is None else slot[0]


def release(manager: StorageManager) -> None:
    """Drop one reference; the last one closes the manager."""
    with _lock:
        for k, slot in list(_managers.items()):
            if slot[0] is manager:
                slot[1] -= 1
                if slot[1] <= 0:
                    del _managers[k]
                    manager.close()
                return


def active_managers() -> list[StorageManager]:
    """Managers alive in this process (for inspection: demo, stats)."""
    with _lock:
        return [slot[0] for slot in _managers.values()]


@atexit.register
def _close_all_at_exit() -> None:
    """Flush write-behind of managers the engine never shut down."""
    with _lock:
        slots = list(_managers.values())
        _managers.clear()
    for slot in slots:
        try:
            slot[0].close()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            pass
