"""The agent's operation pool: runs the controller's ``OpRequest``\\ s and the health refresh.

:class:`OpRunner` runs each ``OpRequest`` on a small thread pool against its namespace's
:class:`~kvtier.storage.instance_ops.InstanceOps`; the answer (an ``OpResult``, ``ok=False``
with the error text for any exception or a passed deadline) is queued for the agent thread
to send (:meth:`OpRunner.results`). Health is computed on the same pool, never on the agent
thread. Nothing here blocks: a full pool answers ``busy`` at once.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from kvtier.protocol import fleet as F

#: OpRequest ``op`` -> InstanceOps method name (where they differ).
_METHODS = {"import": "import_"}
#: Args that carry key lists (a binary of n * 32 bytes, or a list of 32-byte keys).
_KEY_ARGS = ("keys",)
_PARENT_ARGS = ("parents",)


class OpsLike(Protocol):
    """What the agent needs of :class:`kvtier.storage.instance_ops.InstanceOps`."""

    def snapshot(self) -> Mapping[str, Sequence[tuple[bytes, bytes | None]]]: ...

    def pinned_keys(self) -> Any: ...

    def health(self) -> dict[str, Any]: ...

    def run(self, op: str, args: dict[str, Any]) -> dict[str, Any]: ...


class OpStats(Protocol):
    """The counters the runner increments (:class:`~kvtier.fleet.agent.AgentStats` has them)."""

    ops: int
    ops_refused: int


def call_op(ops: OpsLike, op: str, args: dict[str, Any]) -> Any:
    """``ops.run(op, args)`` (InstanceOps checks the op and its args); key binaries become key lists.

    ``args`` is changed in place. An object without ``run`` gets ``getattr(ops, op)(**args)``.

    Raises:
        ValueError: an unknown op (without ``run``); whatever the op raises.
    """
    for name in _KEY_ARGS + _PARENT_ARGS:
        v = args.get(name)
        if isinstance(v, (bytes, bytearray)):
            keys = F.split_keys(bytes(v))
            args[name] = [None if (name in _PARENT_ARGS and k == F.NO_PARENT) else k for k in keys]
    run = getattr(ops, "run", None)
    if run is not None:
        return run(op, args)
    if op not in F.OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(F.OPS)}")
    return getattr(ops, _METHODS.get(op, op))(**args)


class OpRunner:
    """The op pool of one agent.

    Args:
        namespaces: returns the agent's namespace digest -> (info, InstanceOps) now.
        stats: counters (``ops`` on each successful op, ``ops_refused`` on each ``busy``).
        workers: pool threads; at most ``64 * workers`` operations in flight (more: ``busy``).
    """

    def __init__(self, namespaces: Callable[[], dict[bytes, tuple[F.NamespaceInfo, OpsLike]]], stats: OpStats,
                 workers: int = 2):
        self._namespaces = namespaces
        self._stats = stats
        self._results: queue.SimpleQueue[F.OpResult] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kvtier-fleet-op")
        self._inflight = 0
        self._lock = threading.Lock()
        self._max_inflight = 64 * max(1, workers)
        #: The last health report (for the heartbeat); see :meth:`refresh_health`.
        self.health: dict[str, Any] = {}
        self._health_busy = False
        self._last_health = 0.0

    def close(self) -> None:
        """Stop the pool; running operations are abandoned, queued ones cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, req: F.OpRequest) -> None:
        """Run ``req`` on the pool (its result is queued), or queue ``busy`` at once if too many are in flight."""
        with self._lock:
            busy = self._inflight >= self._max_inflight
            if not busy:
                self._inflight += 1
        if busy:
            self._stats.ops_refused += 1
            self._results.put(F.OpResult(req.op_id, False, error="busy: too many operations in flight"))
            return
        received = time.monotonic()
        try:
            self._pool.submit(self._run, req, received)
        except RuntimeError:  # closing
            with self._lock:
                self._inflight -= 1

    def _run(self, req: F.OpRequest, received: float) -> None:
        try:
            self._results.put(self.execute(req, received))
        finally:
            with self._lock:
                self._inflight -= 1

    def results(self) -> Iterator[F.OpResult]:
        """The queued results, oldest first, until none is left (never blocks)."""
        while True:
            try:
                yield self._results.get_nowait()
            except queue.Empty:
                return

    def execute(self, req: F.OpRequest, received: float | None = None) -> F.OpResult:
        """Run one operation against its namespace's InstanceOps (any failure is an ``ok=False`` result).

        ``req.timeout_s`` counts from ``received`` (``time.monotonic()`` when it arrived; default now) on
        this machine's clock: a duration, so clocks of the two machines never meet. (The absolute
        ``deadline`` of older controllers is not used: a clock ahead of the controller's failed everything.)
        """
        start = time.monotonic() if received is None else received
        late = (lambda: time.monotonic() > start + req.timeout_s) if req.timeout_s > 0 else (lambda: False)
        if late():
            return F.OpResult(req.op_id, False, error="deadline")
        try:
            out = self._dispatch(req)
        except Exception as exc:  # OpError and anything else: reported, never raised
            return F.OpResult(req.op_id, False, error=f"{type(exc).__name__}: {exc}"[:4096])
        if late():
            return F.OpResult(req.op_id, False, error="deadline")
        self._stats.ops += 1
        return F.OpResult(req.op_id, True, result=out if isinstance(out, dict) else {"value": out})

    def _dispatch(self, req: F.OpRequest) -> Any:
        spaces = self._namespaces()
        if not req.namespace and req.op in ("health", "stats") and len(spaces) != 1:
            return {d.hex(): call_op(ops, req.op, {}) for d, (_, ops) in spaces.items()}
        if not req.namespace and len(spaces) == 1:
            ops = next(iter(spaces.values()))[1]
        elif req.namespace in spaces:
            ops = spaces[req.namespace][1]
        else:
            raise KeyError(f"namespace {req.namespace.hex()[:16] or '(none)'} is not on this instance")
        return call_op(ops, req.op, dict(req.args))

    def refresh_health(self, now: float) -> None:
        """Recompute :attr:`health` on the pool (at most once a second; ``now``: ``time.monotonic()``)."""
        if self._health_busy or now - self._last_health < 1.0:
            return
        self._health_busy = True
        self._last_health = now

        def work() -> None:
            try:
                spaces = self._namespaces()
                if len(spaces) == 1:
                    self.health = dict(next(iter(spaces.values()))[1].health())
                else:
                    self.health = {d.hex(): ops.health() for d, (_, ops) in spaces.items()}
            except Exception as exc:
                self.health = {"error": f"{type(exc).__name__}: {exc}"[:512]}
            finally:
                self._health_busy = False

        try:
            self._pool.submit(work)
        except RuntimeError:
            self._health_busy = False
