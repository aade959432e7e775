"""A small bounded pool of I/O threads: several chunk reads or writes of one batch in flight.

The disk tier's file I/O (``os.preadv``/``os.pwritev``, ``open``, ``rename``)
releases the GIL, so a few threads keep several chunk I/Os queued at the device
or the page cache while another thread checksums. At most ``threads`` jobs run
at once; the rest of a batch waits in the queue holding only references to the
caller's buffers, so the memory a batch pins (one staging buffer per thread)
does not grow with the batch.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: Default I/O threads of a disk tier (LMCache's disk backend also keeps 4 busy).
DEFAULT_IO_THREADS = 4


class IOPool:
    """Runs per-chunk jobs on up to ``threads`` worker threads, results in input order.

    Args:
        threads: most jobs in flight at once (>= 1); 1 runs every job inline on the
            caller's thread (no worker threads at all).
        name: thread name prefix.

    Raises:
        ValueError: ``threads`` < 1.

    Thread-safe: several callers may share one pool (their jobs share the ``threads`` workers).
    Jobs must not call back into the pool (they never wait on other jobs).
    """

    def __init__(self, threads: int = DEFAULT_IO_THREADS, name: str = "kvtier-disk-io"):
        if threads < 1:
            raise ValueError(f"io threads must be >= 1, got {threads}")
        self.threads = int(threads)
        self._name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def _get_executor(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed or self.threads == 1:
                return None
            if self._executor is None:  # started on first use: a tier that is never used costs no threads
                self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=self._name)
            return self._executor

    def ordered(self, fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
        """Yield ``fn(item)`` for each item, in order, with up to ``threads`` jobs running at once.

        A job's exception is re-raised when its result is due (jobs should return
        errors as values). Jobs submitted before the consumer stops iterating still run
        to completion before the generator is closed (no job outlives the call).
        """
        ex = self._get_executor() if len(items) > 1 else None
        if ex is None:
            for it in items:
                yield fn(it)
            return
        futures: deque[Future[R]] = deque()
        try:
            # All queued at once (a queued job holds no memory; it runs when a worker is
            # free, so at most ``threads`` run); results are taken in input order.
            for it in items:
                try:
                    futures.append(ex.submit(fn, it))
                except RuntimeError:  # pool shut down meanwhile (tier closed): run inline
                    f: Future[R] = Future()
                    try:
                        f.set_result(fn(it))
                    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                        f.set_exception(exc)
                    futures.append(f)
            while futures:
                yield futures.popleft().result()
        finally:
            for f in futures:  # never leave a job running on a caller's buffer after returning
                if not f.cancel():
                    try:
                        f.result()
                    except BaseException:  # noqa: BLE001 - its result is no longer wanted
                        pass

    def close(self) -> None:
        """Stop the workers once their jobs are done; later calls run inline. Idempotent."""
        with self._lock:
            self._closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=False)
