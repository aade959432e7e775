"""Per-request accounting on the scheduler side: engine hits, kvtier hits by tier, load failures.

Accounting is an engine concern: the storage layer never sees request ids. The
scheduler side knows everything needed: the engine's own hit
(``num_computed_tokens`` at lookup), the tokens it planned to load from each
tier, and the blocks the worker reported failed (``invalid_block_ids``).

Records are bounded (oldest dropped first). :func:`active_ledgers` lists the
ledgers of scheduler-side connectors alive in this process, newest first (weak
references: the only process-wide state of this package, for in-process
inspection by the demo; a shut-down engine's records stay readable until its
connector is garbage-collected).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from kvtier.integrations.vllm.types import RequestHits

#: Records kept per ledger (oldest dropped first).
MAX_RECORDS = 10_000

_ledgers: "list[weakref.ref[RequestLedger]]" = []  # creation order
_ledgers_lock = threading.Lock()


class RequestLedger:
    """Bounded ``request id -> RequestHits`` of one scheduler-side connector."""

    def __init__(self, max_records: int = MAX_RECORDS):
        if max_records <= 0:
            raise ValueError(f"max_records must be positive, got {max_records}")
        self.max_records = max_records
        self._records: OrderedDict[str, RequestHits] = OrderedDict()
        self._lock = threading.Lock()  # get() may run on another thread (demo, tests)
        self.load_failures_total = 0  # loads that reported failed blocks, all requests
        self.hit_tokens_total: dict[str, int] = {}  # tier -> tokens loaded (planned minus failed)
        self.planned_tokens_total: dict[str, int] = {}  # tier -> tokens of planned loads (monotonic)
        self.failed_tokens_total: dict[str, int] = {}  # tier -> tokens reported failed (monotonic)
        with _ledgers_lock:
            _ledgers[:] = [r for r in _ledgers if r() is not None]
            _ledgers.append(weakref.ref(self))

    def on_lookup(self, req_id: str, prompt_tokens: int, engine_hit_tokens: int) -> None:
        """A lookup: the request's hits are those of its latest attempt.

        A repeated lookup (after preemption, or after a failed load rewound the
        request to no computed tokens) starts the hit counts afresh: what earlier
        attempts loaded was freed or recomputed. Load failures add up over attempts.
        """
        with self._lock:
            old = self._records.pop(req_id, None)
            self._records[req_id] = RequestHits(prompt_tokens, engine_hit_tokens,
                                                load_failures=old.load_failures if old else 0)
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    def on_load_planned(self, req_id: str, tier: str, num_tokens: int) -> None:
        """``num_tokens`` are to be loaded from ``tier`` (counted as hits unless reported failed)."""
        with self._lock:
            self.hit_tokens_total[tier] = self.hit_tokens_total.get(tier, 0) + num_tokens
            self.planned_tokens_total[tier] = self.planned_tokens_total.get(tier, 0) + num_tokens
            rec = self._records.get(req_id)
            if rec is not None:
                rec.kvtier_hit_tokens += num_tokens
                rec.tiers[tier] = rec.tiers.get(tier, 0) + num_tokens

    def on_load_failed(self, req_id: str, failed_tokens_by_tier: dict[str, int]) -> None:
        """The worker reported blocks of a planned load unfilled: they were recomputed."""
        with self._lock:
            self.load_failures_total += 1
            for tier, n in failed_tokens_by_tier.items():
                self.hit_tokens_total[tier] = max(0, self.hit_tokens_total.get(tier, 0) - n)
                self.failed_tokens_total[tier] = self.failed_tokens_total.get(tier, 0) + n
            rec = self._records.get(req_id)
            if rec is None:
                return
            rec.load_failures += 1
            for tier, n in failed_tokens_by_tier.items():
                n = min(n, rec.tiers.get(tier, 0))
                rec.tiers[tier] = rec.tiers.get(tier, 0) - n
                rec.kvtier_hit_tokens -= n
                if not rec.tiers[tier]:
                    del rec.tiers[tier]
            assert rec.kvtier_hit_tokens == sum(rec.tiers.values()) >= 0

    def get(self, request_id: str) -> RequestHits | None:
        """The record of ``request_id``, or of the newest vLLM-internal id ``<request_id>-<8 chars>``."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None:
                prefix = request_id + "-"
                for rid in reversed(self._records):
                    if rid.startswith(prefix) and len(rid) == len(prefix) + 8:
                        rec = self._records[rid]
                        break
            return None if rec is None else RequestHits(**{**rec.__dict__, "tiers": dict(rec.tiers)})

    def totals(self) -> dict[str, int]:
        """``{"hit_tokens_<tier>": tokens, ..., "load_failures": n}`` over every request so far."""
        with self._lock:
            out = {f"hit_tokens_{t}": n for t, n in self.hit_tokens_total.items()}
            out["load_failures"] = self.load_failures_total
            return out

    def counters(self) -> tuple[dict[str, int], dict[str, int], int]:
        """Monotonic ``(planned tokens by tier, failed tokens by tier, load failures)`` (for metrics)."""
        with self._lock:
            return dict(self.planned_tokens_total), dict(self.failed_tokens_total), self.load_failures_total

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


def active_ledgers() -> list[RequestLedger]:
    """Ledgers of the scheduler-side connectors alive in this process, newest first."""
    with _ledgers_lock:
        return [led for led in (r() for r in reversed(_ledgers)) if led is not None]
