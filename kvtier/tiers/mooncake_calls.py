"""The Mooncake client of one tier, and every call to it off the caller's thread, bounded.

Mooncake's client blocks where kvtier may not: ``setup()`` against a dead master
blocks ~90 s, and with the master down each call blocks ~4 s while
``health_check()`` may still say healthy (measured with 0.3.13.post1). So:

- the client is opened (``setup()``) on a thread of its own, at construction and
  again after a failure once the circuit breaker's back-off allows; calls miss
  until it is open (a call made while it opens waits for it within its own deadline);
- every call runs as a job on one of ``workers`` long-lived worker threads and the caller
  waits at most until its deadline: a job not started by then is cancelled, a job running
  then is waited for a grace (gets and puts: Mooncake cannot stop a transfer that reads or
  writes the caller's memory) and its result dropped; a worker stays busy until Mooncake
  returns;
- the master's circuit breaker counts a timeout or an RPC failure as a failure
  (an answer about a key, even "absent" or "full", is a success); while it is open
  calls miss without touching the store;
- ``close()`` closes the client on a thread of its own (against a dead master it
  blocks while Mooncake tries to unmount its segment) and waits at most ``timeout_s``.

Invariant (under ``self._lock``): ``_busy`` == jobs a worker runs now. A job starts only if its
caller still waits for it (``Future.set_running_or_notify_cancel``), so no job starts after
its caller returned.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence, TypeVar

from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.mooncake_url import MooncakeTierOptions

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Mooncake return codes that are answers about one key (the store works), not failures.
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
NO_AVAILABLE_HANDLE = -200  # no room: the store is full (eviction runs in the background)
INVALID_PARAMS = -600  # e.g. a destination smaller than the stored value
TRANSFER_FAIL = -800  # the bytes could not be moved (e.g. the segment's owner is gone)
RPC_FAIL = -900  # the master did not answer
ANSWERS = frozenset({OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, -705, -703, NO_AVAILABLE_HANDLE, INVALID_PARAMS,
                     TRANSFER_FAIL, -10, -400, -500, -700, -701, -702})


def is_failure(code: int) -> bool:
    """True if a Mooncake return code means the store did not answer (RPC failure, internal
    error, an unknown negative code), False for a success or an answer about the key."""
    return code < 0 and code not in ANSWERS


def codes_answered(codes: Any) -> bool:
    """A batch's codes carry an answer: a non-empty list with at least one non-failure code."""
    return isinstance(codes, list) and any(not is_failure(c) for c in codes)


class Unavailable(Exception):
    """A call did not reach the store: not open, breaker open, every worker busy, closed."""


class TimedOut(Exception):
    """A call outlived its deadline (its worker goes on until Mooncake returns)."""


def set_client_environment(local_hostname: str) -> None:
    """Defaults for Mooncake's process-wide settings, set before it is first imported (a
    value already in the environment wins): ``MC_TCP_BIND_ADDRESS`` = ``local_hostname``
    (0.3.13.post1 still listens on 0.0.0.0, see the README), ``GLOG_minloglevel=2``
    (Mooncake's INFO/WARNING lines stay out of the engine's stderr) and
    ``MC_STORE_CLIENT_SETUP_RETRIES=1``."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
    os.environ.setdefault("GLOG_minloglevel", "2")
    # One attempt: a master that dies between probe_master and setup() then costs ~4.6 s of a
    # setup that holds the GIL, instead of ~90 s (measured).
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


class TransferRelay:
    """The transfers of one batch's parts, one at a time in part order.

    Part ``j`` transfers once part ``j - 1``'s transfer has ended (or failed), so exactly
    one transfer of the batch is in flight, as with one batched call, while the other
    parts' CPU work (checksums of the records to put or just read) runs beside it on
    other workers. A part whose turn has not come by ``deadline`` moves nothing (the time
    bound of :mod:`kvtier.tiers.mooncake_tier`: no part starts after the deadline).

    Invariant: every part's job passes its turn in a ``finally`` however it ends (the tier's
    job wrapper does, and the part once its transfer is over; passing twice is harmless), so
    a part that failed or skipped never holds up its successors.
    """

    def __init__(self, parts: int, deadline: float):
        self.deadline = deadline
        self._ended = [threading.Event() for _ in range(parts)]

    def wait_turn(self, j: int) -> bool:
        """Wait for part ``j - 1``'s transfer to end; True if part ``j`` may start its own
        now, False if the deadline (monotonic seconds) came first."""
        if j > 0 and not self._ended[j - 1].wait(max(0.0, self.deadline - time.monotonic())):
            return False
        return time.monotonic() < self.deadline

    def pass_turn(self, j: int) -> None:
        """Part ``j``'s transfer has ended (or will not happen): the next part's turn."""
        self._ended[j].set()


class MooncakeCalls:
    """One Mooncake client (``MooncakeDistributedStore``) and bounded calls to it.

    Args:
        opts: the tier's options (timeouts, workers, segment, addresses).
        master: the master's ``host:port``.
        on_error: called with 1 per failed call (timeout, RPC failure) for the tier's counters.

    Raises:
        ImportError: Mooncake is not installed (``pip install 'kvtier[mooncake]'``).
    """

    def __init__(self, opts: MooncakeTierOptions, master: str, on_error: Callable[[int], None]):
        set_client_environment(opts.local_hostname)
        from mooncake.store import MooncakeDistributedStore  # noqa: F401  (fail here if missing)

        self.opts = opts
        self.master = master
        self.breaker = CircuitBreaker(
            opts.breaker_failures, opts.breaker_backoff_s, opts.breaker_max_backoff_s, name=f"mooncake {master}"
        )
        self._on_error = on_error
        self._lock = threading.Lock()
        self._store: Any = None
        self._opening: threading.Event | None = None
        self._closed = False
        self._busy = 0
        self.setups = 0  # successful setup() calls
        self.late_calls = 0  # calls that outlived their deadline
        self.overruns = 0  # jobs still running past their deadline plus grace
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"kvtier-mooncake-{i}", daemon=True) for i in range(opts.workers)
        ]
        for t in self._threads:
            t.start()
        self._start_open()

    # -- the client ------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._store is not None and not self._closed

    def _start_open(self) -> threading.Event | None:
        """Start ``setup()`` on its own thread unless it runs or the client is open; the event it sets."""
        with self._lock:
            if self._closed or self._store is not None:
                return None
            if self._opening is not None:
                return self._opening
            done = self._opening = threading.Event()
        threading.Thread(target=self._open, args=(done,), name="kvtier-mooncake-setup", daemon=True).start()
        return done

    def _open(self, done: threading.Event) -> None:
        from mooncake.store import MooncakeDistributedStore

        o = self.opts
        t0 = time.monotonic()
        store = None
        rc = probe_master(self.master, min(o.setup_timeout_s, max(o.timeout_s, 1.0)))
        if rc == 0:  # the master answered a moment ago: setup() returns quickly
            store = MooncakeDistributedStore()
            try:
                rc = store.setup(o.local_hostname, o.metadata, o.segment_bytes, 0, o.protocol, "", self.master)
            except Exception as exc:  # a binding error is a failed setup, not a crash
                log.warning("kvtier mooncake %s: setup raised %s", self.master, exc)
                rc = -1
        took = time.monotonic() - t0
        with self._lock:
            self._opening = None
            keep = rc == 0 and not self._closed
            if keep:
                self._store = store
                self.setups += 1
        if keep:
            self.breaker.success()
            log.info("kvtier mooncake: client open on master %s (%.2f s)", self.master, took)
        else:
            if rc != 0:
                self.breaker.failure()
                log.warning("kvtier mooncake %s: setup failed (code %s after %.1f s); its calls miss", self.master, rc, took)
            if store is not None:
                _park(store)  # its close() would hold the GIL while it fails to unmount
        done.set()

    def _client(self, deadline: float) -> Any:
        """The open client, opening it (within ``deadline``) when the breaker allows.

        Raises:
            Unavailable: closed, the breaker is open, or it did not open in time.
        """
        if self._closed:
            raise Unavailable("closed")
        store = self._store
        if store is not None:
            return store
        if self._opening is None and not self.breaker.allow():
            raise Unavailable("breaker open")
        done = self._start_open()
        if done is not None:
            done.wait(max(0.0, min(deadline, time.monotonic() + self.opts.setup_timeout_s) - time.monotonic()))
        store = self._store
        if store is None:
            raise Unavailable("client not open")
        return store

    # -- calls -------------------------------------------------------------------------
    def call(self, fn: Callable[[Any], T], deadline: float, answered: Callable[[T], bool] = lambda r: True) -> T:
        """``fn(client)`` on a worker thread, waited for until ``deadline`` (monotonic seconds).

        ``answered(result)`` tells whether the master answered (reported to the breaker as a
        success) or the result carries only failures (reported as a failure; the result is
        still returned).

        Raises:
            Unavailable: the call was not made (see :meth:`_client`; every worker busy).
            TimedOut: it outlived ``deadline`` (counted as a failure).
        """
        (result,) = self.call_parts([fn], deadline, answered)
        if result is None:
            raise TimedOut(f"no answer within the deadline from master {self.master}")
        return result

    def call_parts(self, fns: Sequence[Callable[[Any], T]], deadline: float,
                   answered: Callable[[T], bool] = lambda r: True, grace_s: float = 0.0) -> list[T | None]:
        """Each ``fn(client)`` as its own worker job, at once (the parts of one batch, so one
        part's transfer overlaps another's checksums), all waited for until ``deadline``.

        A job not started by ``deadline`` is cancelled (it never runs). A job running then may
        be moving bytes to or from the caller's memory, which Mooncake cannot stop: it is
        waited for ``grace_s`` more; one still running after that is counted in ``overruns``.

        Returns each part's result, None for a part that did not finish in time or failed.
        The breaker hears one success if any part answered, else one failure.

        Raises:
            Unavailable: nothing was started (closed, breaker open, client not open).
        """
        if self._store is not None and not self.breaker.allow():
            raise Unavailable("breaker open")
        store = self._client(deadline)
        futs: list[Future[Any]] = []
        for fn in fns:
            fut: Future[Any] = Future()
            self._jobs.put((functools.partial(fn, store), fut))
            futs.append(fut)
        results: list[T | None] = []
        late = False
        for fut in futs:
            try:
                try:
                    results.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
                except TimeoutError:
                    late = True
                    if fut.cancel():  # never started, and now never will
                        results.append(None)
                        continue
                    try:
                        results.append(fut.result(timeout=max(0.0, deadline + grace_s - time.monotonic())))
                    except TimeoutError:
                        self.overruns += 1
                        results.append(None)
            except Exception as exc:  # a Mooncake binding error is a failed part, never the caller's
                log.warning("kvtier mooncake %s: a call failed: %r", self.master, exc)
                results.append(None)
        if late:
            self.late_calls += 1
        if any(r is not None and answered(r) for r in results):
            self.breaker.success()
        else:
            self.failed()
        return results

    @property
    def idle(self) -> int:
        """Workers free for a new call now."""
        return max(0, self.opts.workers - self._busy)

    def failed(self) -> None:
        """Report a failed call (timeout, RPC failure) to the breaker and the error count."""
        self.breaker.failure()
        self._on_error(1)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue  # its caller gave up before it started
            with self._lock:
                self._busy += 1
            try:
                fut.set_result(fn())
            except BaseException as exc:  # surfaced to the caller, who may have gone
                fut.set_exception(exc)
            finally:
                with self._lock:
                    self._busy -= 1

    @property
    def busy(self) -> int:
        """Workers running a call now (a stalled store keeps them busy past their deadlines)."""
        return self._busy

    def close(self) -> None:
        """Stop taking calls and close the client within ``timeout_s`` (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        for _ in self._threads:
            self._jobs.put(None)
        if store is None:
            return
        # close() unmounts this client's segment at the master and holds the GIL while it does:
        # ~35 s against a hung or dead master (measured). Close only an idle client whose master
        # answers; otherwise keep it referenced until the process exits (its segment then
        # expires at the master after client_ttl).
        # A call still in flight (its deadline passed) must not meet a closing client.
        idle_by = time.monotonic() + self.opts.timeout_s
        while self._busy and time.monotonic() < idle_by:
            time.sleep(0.01)
        if self._busy == 0 and self.breaker.state == "closed" and self._healthy(store):
            t = threading.Thread(target=_close_quietly, args=(store,), name="kvtier-mooncake-close", daemon=True)
            t.start()
            t.join(self.opts.timeout_s)
        else:
            _park(store)

    def _healthy(self, store: Any) -> bool:
        """The client's own view of its master (``health_check()`` is 0), asked on a worker-free
        thread within ``timeout_s``; False if it does not answer."""
        box: list[int] = []
        t = threading.Thread(target=lambda: box.append(int(store.health_check())), daemon=True)
        t.start()
        t.join(self.opts.timeout_s)
        return box == [0]


def probe_master(master: str, timeout_s: float) -> int:
    """0 if an RPC server answers at ``master`` (``host:port``) within ``timeout_s`` seconds.

    ``setup()`` holds the GIL for as long as it blocks (~90 s against a dead master, for ever
    against one that accepts and never answers; measured with 0.3.13.post1), so it is only
    called right after this check: connect, send 32 zero bytes, and wait for the server to
    react. Mooncake's master (coro_rpc) drops a connection that opens with a bad header at
    once; a hung (SIGSTOPped) master or a silent port never reacts. Returns -1 (refused or no
    such host) or -2 (no reaction in time).
    """
    host, _, port = master.rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.sendall(bytes(32))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return -2
                sock.settimeout(left)
                if not sock.recv(4096):
                    return 0  # closed on the bad header: an RPC server is there and answers
    except socket.timeout:
        return -2
    except (OSError, ValueError):
        return -1


def _park(store: Any) -> None:
    """Keep ``store`` referenced by a daemon thread until the process exits: neither its
    ``close()`` nor its destructor runs (both hold the GIL while failing to reach the master)."""
    never = threading.Event()
    threading.Thread(target=lambda: (never.wait(), store), name="kvtier-mooncake-parked", daemon=True).start()


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception:  # pragma: no cover - defensive
        log.debug("kvtier mooncake: close failed", exc_info=True)
