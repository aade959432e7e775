"""Records of asynchronous fleet operations and their bounded tracker.

A record goes pending -> running -> done | failed (with a reason) and always reaches a
terminal state by its deadline: :meth:`OpTracker.get` (and :meth:`OpTracker.counts`)
fail an overdue record itself.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

#: Terminal operation records kept for ``check_finish``.
DEFAULT_HISTORY = 10000
#: The terminal states of a record.
TERMINAL = ("done", "failed")


@dataclass
class OpRecord:
    """One asynchronous operation.

    Attributes:
        event_id: its id (hex).
        op: operation name.
        state: ``pending``, ``running``, ``done`` or ``failed``.
        reason: why it failed ("" otherwise).
        result: the outcome (per instance, tokens affected).
        created_at / finished_at: wall-clock seconds (finished_at 0 until terminal).
        deadline: ``time.monotonic()`` by which it is terminal.
    """

    event_id: str
    op: str
    params: dict[str, Any]
    deadline: float
    state: str = "pending"
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "op": self.op, "state": self.state, "reason": self.reason,
                "result": self.result, "params": self.params, "created_at": self.created_at,
                "finished_at": self.finished_at}


class OpTracker:
    """Operation records by id, bounded (the oldest terminal records are forgotten first)."""

    def __init__(self, history: int = DEFAULT_HISTORY, grace_s: float = 1.0):
        self._ops: OrderedDict[str, OpRecord] = OrderedDict()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._history = history
        self._grace_s = grace_s

    def create(self, op: str, params: dict[str, Any], deadline_s: float) -> OpRecord:
        rec = OpRecord(os.urandom(8).hex(), op, params, time.monotonic() + deadline_s)
        with self._lock:
            self._ops[rec.event_id] = rec
            if len(self._ops) > self._history:
                for k in [k for k, r in self._ops.items() if r.state in TERMINAL][: len(self._ops) - self._history]:
                    del self._ops[k]
        return rec

    def _finish(self, rec: OpRecord, state: str, reason: str = "", result: dict[str, Any] | None = None) -> None:
        with self._lock:
            if rec.state in TERMINAL:
                return
            rec.state = state
            rec.reason = reason
            if result is not None:
                rec.result = result
            rec.finished_at = time.time()
            self._cond.notify_all()

    def running(self, rec: OpRecord) -> None:
        with self._lock:
            if rec.state == "pending":
                rec.state = "running"

    def done(self, rec: OpRecord, result: dict[str, Any]) -> None:
        self._finish(rec, "done", result=result)

    def failed(self, rec: OpRecord, reason: str, result: dict[str, Any] | None = None) -> None:
        self._finish(rec, "failed", reason, result)

    def _overdue(self, rec: OpRecord, now: float) -> None:
        if rec.state not in TERMINAL and now > rec.deadline + self._grace_s:
            self._finish(rec, "failed", f"timeout: {rec.op} did not finish by its deadline")

    def get(self, event_id: str) -> dict[str, Any] | None:
        """The record as JSON, or None if unknown (never issued or forgotten)."""
        with self._lock:
            rec = self._ops.get(event_id)
        if rec is None:
            return None
        self._overdue(rec, time.monotonic())
        with self._lock:
            return rec.to_json()

    def wait(self, event_id: str, timeout_s: float) -> dict[str, Any] | None:
        """Wait until the record is terminal or ``timeout_s`` passes; the record as JSON."""
        end = time.monotonic() + timeout_s
        with self._lock:
            rec = self._ops.get(event_id)
            while rec is not None and rec.state not in TERMINAL and time.monotonic() < end:
                self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))
        return self.get(event_id)

    def counts(self) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            recs = list(self._ops.values())
        out = {"pending": 0, "running": 0, "done": 0, "failed": 0}
        for rec in recs:
            self._overdue(rec, now)
            out[rec.state] = out.get(rec.state, 0) + 1
        return out
