"""Routing policies: rank the healthy backends for one request.

* ``kv-aware`` (default): ``score = cached-prefix tokens weighted by tier (engine > CPU >
  DISK > REMOTE) - weights.load x load tokens``; ties go to the least loaded, then the least
  recently assigned, then the first configured: never random.
* ``round-robin``: the healthy backends in turn (configured order).
* ``least-loaded``: the least load tokens, then least recently assigned, then configured order.

The ranking is a total order, so a request that cannot reach its first choice retries on
the second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from kvtier.router.config import Weights
    from kvtier.router.prefix_index import PrefixIndex

#: Two scores closer than this are a tie.
EPS = 1e-9


def weighted_hit(segments: Sequence[tuple[int, float]], prefixes: Sequence[tuple[int, float]]) -> tuple[int, float]:
    """Cached tokens and their weighted value, from two sources of prefix knowledge.

    Args:
        segments: consecutive runs ``(end_token, weight)`` starting at token 0 (the events
            index: each block's best medium).
        prefixes: ``(length, weight)``: the first ``length`` tokens are cached at ``weight``
            (the controller's per-tier longest prefixes).

    Returns:
        ``(tokens, score)``: the longest prefix cached anywhere, and the sum over its tokens
        of the best weight covering each token.
    """
    bounds = sorted({e for e, _ in segments} | {n for n, _ in prefixes if n > 0})
    total = 0.0
    prev = 0
    for end in bounds:
        best = 0.0
        start = 0
        for e, w in segments:
            if start <= prev < e:
                best = max(best, w)
                break
            start = e
        for n, w in prefixes:
            if n >= end:
                best = max(best, w)
        total += best * (end - prev)
        prev = end
    return prev, total


#: Tiers of the fleet controller's ``/lookup`` rows, weighed like the event media of the same name.
CONTROLLER_TIERS = ("CPU", "DISK", "REMOTE")


def predicted_hit(index: PrefixIndex, backend: str, tokens: Sequence[int] | np.ndarray, keys_by_bs: dict[int, list[bytes]],
                  weights: Weights, row: Mapping[str, Any] | None = None,
                  extra_keys: Sequence[object | None] | None = None) -> tuple[int, float, dict[str, int]]:
    """What ``backend`` holds of a prompt: ``(hit tokens, tier-weighted score, tokens per tier)``.

    The events index (``index``, keyed by the router's chain keys at the backend's block
    size; ``keys_by_bs`` memoizes the prompt's keys per block size across backends) and the
    fleet controller's ``/lookup`` row for the backend (``row``: tier -> cached prefix tokens;
    ``None``: no row) are combined by :func:`weighted_hit`. ``extra_keys``: per block, extra
    hash inputs of the prompt's keys (vLLM's ``(cache_salt,)`` on block 0; ``None``: none). No I/O: the HTTP router and the
    offline fleet replay (:mod:`kvtier.sim.fleet`) both call it.
    """
    from kvtier.router.prefix_index import chain_keys

    segments: list[tuple[int, float]] = []
    per_tier: dict[str, int] = {}
    bs = index.block_size(backend)
    if bs:
        if bs not in keys_by_bs:
            keys_by_bs[bs] = chain_keys(tokens, bs, extra_keys=extra_keys)
        m = index.match(backend, keys_by_bs[bs], bs)
        segments = [(end, weights.medium(med)) for end, med in m.segments]
        per_tier = {k.lower() if k != "GPU" else "engine": v for k, v in m.per_medium.items()}
    prefixes: list[tuple[int, float]] = []
    if isinstance(row, Mapping):
        for tier in CONTROLLER_TIERS:
            n = row.get(tier)
            if isinstance(n, int) and n > 0:
                prefixes.append((min(n, len(tokens)), weights.medium(tier)))
                per_tier[f"controller_{tier.lower()}"] = n
    hit_tokens, hit_score = weighted_hit(segments, prefixes)
    return hit_tokens, hit_score, per_tier


@dataclass(frozen=True)
class Candidate:
    """One healthy backend as the policy sees it.

    Attributes:
        name: backend name; index: configured position.
        hit_tokens: predicted cached prefix (tokens); hit_score: its tier-weighted value.
        per_tier: predicted cached tokens by tier (for reporting).
        load_tokens: load term (:mod:`kvtier.router.load`).
        last_assigned: assignment number of its last request (-1: never).
    """

    name: str
    index: int
    hit_tokens: int = 0
    hit_score: float = 0.0
    per_tier: dict[str, int] = field(default_factory=dict)
    load_tokens: float = 0.0
    last_assigned: int = -1

    def score(self, load_weight: float) -> float:
        return self.hit_score - load_weight * self.load_tokens


@dataclass(frozen=True)
class Decision:
    """A routing decision: ``order[0]`` is the choice, the rest the retry order.

    Attributes:
        policy: the policy used; reason: why ``order[0]`` won (``prefix``, ``load``,
            ``tie-least-loaded``, ``tie-least-recent``, ``tie-order``, ``only``,
            ``round-robin``, ``least-loaded``).
        order: candidates, best first; scores: ``name -> score`` (kv-aware) or load.
    """

    policy: str
    reason: str
    order: tuple[Candidate, ...]
    scores: dict[str, float]

    @property
    def choice(self) -> Candidate:
        return self.order[0]


def _tie_reason(a: Candidate, b: Candidate) -> str:
    if abs(a.load_tokens - b.load_tokens) > EPS:
        return "tie-least-loaded"
    if a.last_assigned != b.last_assigned:
        return "tie-least-recent"
    return "tie-order"


def rank(policy: str, candidates: Sequence[Candidate], load_weight: float, rr_next: int = 0) -> Decision:
    """Rank ``candidates`` (non-empty) under ``policy``.

    Args:
        policy: ``kv-aware``, ``round-robin`` or ``least-loaded``.
        candidates: the healthy backends.
        load_weight: penalty per load token (kv-aware).
        rr_next: round-robin: the configured index to start from.

    Raises:
        ValueError: an unknown policy or no candidate.
    """
    if not candidates:
        raise ValueError("no healthy backend")
    if policy == "round-robin":
        n = 1 + max(c.index for c in candidates)
        order = sorted(candidates, key=lambda c: (c.index - rr_next) % n)
        return Decision(policy, "round-robin", tuple(order), {c.name: float(c.load_tokens) for c in candidates})
    if policy == "least-loaded":
        order = sorted(candidates, key=lambda c: (c.load_tokens, c.last_assigned, c.index))
        return Decision(policy, "least-loaded", tuple(order), {c.name: float(c.load_tokens) for c in candidates})
    if policy != "kv-aware":
        raise ValueError(f"unknown policy {policy!r}")
    scores = {c.name: c.score(load_weight) for c in candidates}
    # Round scores so float noise cannot break a tie, then the deterministic tie-breaks.
    order = sorted(candidates, key=lambda c: (-round(scores[c.name], 6), c.load_tokens, c.last_assigned, c.index))
    if len(order) == 1:
        reason = "only"
    else:
        a, b = order[0], order[1]
        if abs(round(scores[a.name], 6) - round(scores[b.name], 6)) <= EPS:
            reason = _tie_reason(a, b)
        elif a.hit_score > b.hit_score + EPS:
            reason = "prefix"
        else:
            reason = "load"
    return Decision(policy, reason, tuple(order), scores)
