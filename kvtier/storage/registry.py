"""Process-local sharing of storage managers.

vLLM builds two connector objects per engine: one on the scheduler side (lookup,
leases) and one on the worker side (copies). With one worker (TP=1) both live in
the engine-core process and must use the *same* tiers, or the scheduler would
promise chunks the worker cannot load. They meet here: a reference-counted map
from (namespace digest, config) to manager, the only process-wide state in
kvtier. The last ``release`` closes the manager (flushes write-behind).
"""

from __future__ import annotations

import atexit
import threading

from kvtier.config import KVTierConfig
from kvtier.index.keys import KeyNamespace
from kvtier.storage.manager import StorageManager

_lock = threading.Lock()
_managers: dict[tuple[bytes, str], list] = {}  # key -> [manager, refcount]


def _key(config: KVTierConfig, namespace: KeyNamespace) -> tuple[bytes, str]:
    return namespace.digest(), config.model_dump_json()


def acquire(config: KVTierConfig, namespace: KeyNamespace) -> StorageManager:
    """The process's manager for ``(config, namespace)``, created on first use."""
    k = _key(config, namespace)
    with _lock:
        slot = _managers.get(k)
        if slot is None:
            slot = _managers[k] = [StorageManager(config, namespace), 0]
        slot[1] += 1
        return slot[0]


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
