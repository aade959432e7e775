"""What every fleet operation runs on: the fleet state, the endpoint, the op pool and tracker.

:class:`OpContext` resolves targets, hashes tokens into chunk keys, submits an operation
body to the worker pool (its record reaches done | failed) and runs one instance op within
a record's deadline. The operation bodies (:mod:`.ops_lookup`, :mod:`.ops_cache`,
:mod:`.ops_move`) take it as their first argument; :class:`~kvtier.controller.operations.FleetOps`
is one.
"""

from __future__ import annotations

import sys
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from kvtier.controller.endpoint import Endpoint, InstanceOpError
from kvtier.controller.errors import BadRequest, UnknownInstance
from kvtier.controller.registry import InstanceRecord, NamespaceEntry
from kvtier.controller.state import FleetState
from kvtier.controller.tracker import DEFAULT_HISTORY, OpRecord, OpTracker

#: Default deadline of one fleet operation (seconds).
DEFAULT_OP_DEADLINE_S = 10.0
#: ``array`` type code of an unsigned 32-bit int ('I' on every platform kvtier runs on).
_U32 = "I" if array("I").itemsize == 4 else "L"
_FAST_U32 = array(_U32).itemsize == 4 and sys.byteorder == "little"


class OpContext:
    """State, endpoint, worker pool and tracker shared by the fleet operations.

    Args:
        state: fleet state (registry + index).
        endpoint: sends instance operations.
        deadline_s: default deadline of one operation (seconds).
        workers: operations run at once; more wait pending.
        history: terminal records kept (see :class:`~kvtier.controller.tracker.OpTracker`).
    """

    def __init__(self, state: FleetState, endpoint: Endpoint, deadline_s: float = DEFAULT_OP_DEADLINE_S,
                 workers: int = 8, history: int = DEFAULT_HISTORY):
        self.state = state
        self.endpoint = endpoint
        self.deadline_s = deadline_s
        self.tracker = OpTracker(history)
        #: (instance, pin_id) -> (namespace digest, keys): the pins this controller made
        #: (read and written under ``state.lock``).
        self.pins: dict[tuple[str, str], tuple[bytes, set[bytes]]] = {}
        state.on_drop.append(self._forget_pins)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-controller-op")

    def close(self) -> None:
        """Stop the worker pool; queued operations are cancelled (their records fail by deadline)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_pins(self, instance: str) -> None:
        with self.state.lock:
            for k in [k for k in self.pins if k[0] == instance]:
                del self.pins[k]

    def targets(self, instance: str | None, tier: str | None = None) -> list[InstanceRecord]:
        """The named instance, or every registered one (having ``tier`` when given).

        Raises:
            UnknownInstance: ``instance`` is not registered.
            BadRequest: the named instance has no tier ``tier``.
        """
        with self.state.lock:
            if instance is not None:
                rec = self.state.registry.get(instance)
                if rec is None:
                    raise UnknownInstance(instance)
                if tier is not None and tier not in rec.tiers:
                    raise BadRequest(f"instance {instance!r} has no tier {tier!r} (it has {sorted(rec.tiers)})", "tier")
                return [rec]
            recs = self.state.registry.records()
        return [r for r in recs if tier is None or tier in r.tiers]

    @staticmethod
    def keys(entry: NamespaceEntry, tokens: Sequence[int] | np.ndarray, cache_salt: str | None) -> list[bytes]:
        """The 32-byte chunk keys of ``tokens`` in ``entry``'s namespace.

        Raises:
            BadRequest: tokens the hasher refuses.
        """
        try:
            return entry.hasher.keys(tokens, cache_salt=cache_salt)
        except ValueError as exc:
            raise BadRequest(str(exc), "tokens") from None

    @staticmethod
    def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token ids as ``<u4`` (a list goes through ``array('I')``: 4x faster than numpy's conversion).

        Raises:
            BadRequest: an id that is not an integer in ``[0, 2**32)``.
        """
        if isinstance(tokens, np.ndarray) or not _FAST_U32:
            return np.asarray(tokens)
        try:
            return np.frombuffer(array(_U32, tokens), dtype="<u4")
        except (OverflowError, TypeError) as exc:
            raise BadRequest(f"token ids must be integers in [0, 2**32): {exc}", "tokens") from None

    def hash_all(self, recs: list[InstanceRecord], tokens: Sequence[int] | None, keys: list[bytes] | None,
                 cache_salt: str | None) -> dict[bytes, list[bytes]]:
        """Namespace digest -> chunk keys of ``tokens`` (or ``keys`` as given), for every namespace of ``recs``.

        Raises:
            BadRequest: bad token ids.
        """
        out: dict[bytes, list[bytes]] = {}
        ids: Sequence[int] | np.ndarray = () if keys is not None else self.token_array(tokens if tokens is not None else [])
        for r in recs:
            for digest, entry in r.namespaces.items():
                if digest not in out:
                    out[digest] = list(keys) if keys is not None else self.keys(entry, ids, cache_salt)
        return out

    def submit(self, op: str, params: dict[str, Any], fn: Callable[[OpRecord], dict[str, Any]]) -> OpRecord:
        """Track a new operation and run ``fn(record)`` on the pool; its return is the result.

        ``InstanceOpError`` and ``BadRequest`` fail the record with their
        text, any other exception as an internal error; never raised to the caller.
        """
        rec = self.tracker.create(op, params, self.deadline_s)

        def run() -> None:
            if time.monotonic() > rec.deadline:
                self.tracker.failed(rec, f"timeout: {op} waited past its deadline before it could start")
                return
            self.tracker.running(rec)
            try:
                result = fn(rec)
            except (InstanceOpError, BadRequest) as exc:
                self.tracker.failed(rec, str(exc))
            except Exception as exc:  # noqa: BLE001 - reported as the op's failure
                self.tracker.failed(rec, f"internal error: {type(exc).__name__}: {exc}")
            else:
                self.tracker.done(rec, result)

        self._pool.submit(run)
        return rec

    def call(self, rec: OpRecord, instance: str, op: str, ns: bytes, args: dict[str, Any]) -> dict[str, Any]:
        """Run one instance op within ``rec``'s deadline; its result map.

        Raises:
            InstanceOpError: not answered in time, unreachable, or answered ``ok=False``.
        """
        remaining = rec.deadline - time.monotonic()
        if remaining <= 0:
            raise InstanceOpError(f"timeout: no time left for {op} on instance {instance!r}")
        fut = self.endpoint.request(instance, op, ns, args, remaining)
        try:
            res = fut.result(timeout=remaining + 1.0)
        except TimeoutError:
            raise InstanceOpError(f"timeout: instance {instance!r} did not answer {op} within {remaining:.3g} s") from None
        if not res.ok:
            raise InstanceOpError(f"instance {instance!r}: {op} failed: {res.error or 'no reason given'}")
        return dict(res.result)
