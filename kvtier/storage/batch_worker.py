"""A background thread that drains a bounded queue in batches (write-behind, prefetch).

Invariants (kept under ``self._cond``):
- At most ``max_queue`` items wait; ``submit`` beyond that refuses the item
  (the caller still owns it and counts the drop) and never blocks.
- ``_busy`` is True exactly while a batch taken from the queue is being
  handled, so ``flush`` returns only when every accepted item was handled.
- After ``close`` nothing is accepted; the thread ends once the queue is empty
  (or, with ``drain=False``, items still waiting are handed to ``on_discard``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BatchWorker(Generic[T]):
    """Runs ``handle(batch)`` on a daemon thread for items given to :meth:`submit`.

    Args:
        name: thread name (for logs and debuggers).
        handle: called with 1..``max_batch`` items in submission order. It owns
            the items (must release whatever they hold, also when it fails); an
            exception it raises is logged and the worker goes on.
        max_queue: items that may wait; more are refused by :meth:`submit`.
        max_batch: most items handed to one ``handle`` call.
        on_discard: called with each item never handled (``close(drain=False)``).

    Raises:
        ValueError: ``max_queue`` or ``max_batch`` below 1.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[list[T]], None],
        max_queue: int,
        max_batch: int = 8,
        on_discard: Callable[[T], None] | None = None,
    ):
        if max_queue < 1 or max_batch < 1:
            raise ValueError("max_queue and max_batch must be at least 1")
        self._handle = handle
        self._on_discard = on_discard
        self.max_queue = max_queue
        self.max_batch = max_batch
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.dropped = 0
        self.handled = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> bool:
        """Queue ``item``; False (counted in ``dropped``) if the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._items) >= self.max_queue:
                self.dropped += 1
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    @property
    def pending(self) -> int:
        """Items waiting or being handled."""
        with self._cond:
            return len(self._items) + (1 if self._busy else 0)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every accepted item was handled; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._items or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout_s: float | None = 30.0, drain: bool = True) -> bool:
        """Stop accepting items; handle (``drain``) or discard the waiting ones; join.

        Returns False if the thread did not finish within ``timeout_s``.
        """
        with self._cond:
            self._closed = True
            discarded = [] if drain else list(self._items)
            if not drain:
                self._items.clear()
            self._cond.notify_all()
        for item in discarded:
            self._discard(item)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _discard(self, item: T) -> None:
        if self._on_discard is not None:
            try:
                self._on_discard(item)
            except Exception:  # pragma: no cover - defensive
                log.exception("kvtier: discarding a queued item failed")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:  # closed and drained
                    self._cond.notify_all()
                    return
                batch = [self._items.popleft() for _ in range(min(self.max_batch, len(self._items)))]
                self._busy = True
            try:
                self._handle(batch)
            except Exception:  # the worker must survive a failing handler
                log.exception("kvtier: background batch failed")
            finally:
                with self._cond:
                    self._busy = False
                    self.handled += len(batch)
                    self._cond.notify_all()
