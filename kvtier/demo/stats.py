"""Per-request records of the demo and the summary computed from them.

Token accounting keeps three counts apart for every request (a hit rate
computed only at load time always reads 100%):
``engine_hit_tokens`` (vLLM's own prefix cache already had them),
``kvtier_hit_tokens`` (kvtier supplied them) and ``computed_tokens`` (prefill
ran on them); they sum to ``prompt_tokens``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

PHASE_OFF = "off"
PHASE_ON = "on"
PHASE_RESTART = "restart"
PHASES = (PHASE_OFF, PHASE_ON, PHASE_RESTART)


@dataclass
class RequestRecord:
    """What one request did.

    Attributes:
        phase: ``"off"`` (kvtier off), ``"on"`` (kvtier on, fresh disk tier) or
            ``"restart"`` (new process, kvtier on, phase 2's disk tier).
        seq: position in the phase's visit order (0-based).
        doc_id: document id.
        question_index: 0-based question index within the document.
        first_visit: first request about this document in the phase.
        repeat: an immediate resubmission of the previous prompt, measuring an
            engine-resident prefix-cache hit; excluded from workload stats.
        prompt_tokens: prompt length (tokens).
        engine_hit_tokens: tokens vLLM's own prefix cache held (tokens).
        kvtier_hit_tokens: tokens kvtier supplied (tokens).
        tier_tokens: tokens kvtier supplied per tier, e.g. ``{"cpu": 0, "disk": 2048}``.
        ttft_s: time from submitting the request to its first generated token (seconds).
        answer: greedy answer text.
        answer_token_ids: greedy answer token ids.
    """

    phase: str
    seq: int
    doc_id: str
    question_index: int
    first_visit: bool
    repeat: bool
    prompt_tokens: int
    engine_hit_tokens: int
    kvtier_hit_tokens: int
    tier_tokens: dict[str, int]
    ttft_s: float
    answer: str
    answer_token_ids: list[int] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens prefill actually computed."""
        return max(0, self.prompt_tokens - self.engine_hit_tokens - self.kvtier_hit_tokens)

    @property
    def tier(self) -> str:
        """The tier(s) that served kvtier's hit: ``"cpu"``, ``"disk"``, ``"cpu+disk"`` or ``"none"``."""
        served = [t for t in ("cpu", "disk") if self.tier_tokens.get(t, 0) > 0]
        served += sorted(t for t, n in self.tier_tokens.items() if n > 0 and t not in ("cpu", "disk"))
        return "+".join(served) if served else "none"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, derived fields included."""
        out = asdict(self)
        out["computed_tokens"] = self.computed_tokens
        out["tier"] = self.tier
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestRecord":
        """Inverse of :meth:`to_json` (derived fields ignored)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def _median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def cached_tokens(r: RequestRecord) -> int:
    """Prompt tokens whose KV the request did not compute (engine-held plus kvtier-supplied)."""
    return r.engine_hit_tokens + r.kvtier_hit_tokens


def reference_for(r: RequestRecord, records: Sequence[RequestRecord]) -> RequestRecord | None:
    """The kvtier-off request that computed ``r``'s prompt with the same split, or None.

    Greedy answers in bf16 depend on where prefill starts: vLLM's own prefix-cache
    hit already changes some answers versus a cold prefill, because the suffix is
    computed by other kernel paths. So a kvtier hit is compared with the phase
    ``off`` run of the same (document, question) whose cached prefix had the same
    length: the cold run for a miss, the engine-resident probe for a hit. Equal
    answers then mean kvtier's KV is what vLLM itself would have held.
    """
    same = [
        o
        for o in records
        if o.phase == PHASE_OFF
        and (o.doc_id, o.question_index) == (r.doc_id, r.question_index)
        and cached_tokens(o) == cached_tokens(r)
    ]
    same.sort(key=lambda o: o.repeat)  # prefer the workload run over a probe
    return same[0] if same else None


@dataclass
class AnswerCheck:
    """Outcome of comparing kvtier-on answers with kvtier-off answers.

    Attributes:
        identical: every comparable kvtier-on answer equals its kvtier-off reference.
        compared: kvtier-on requests with a reference of the same split.
        mismatches: descriptions of the answers that differ.
        not_comparable: kvtier-on requests without a kvtier-off run of the same split.
        equal_to_cold_off: kvtier-on answers equal to the cold kvtier-off answer (information).
        engine_hits_equal_to_cold_off: engine-resident probe answers equal to the cold answer (information).
        engine_hits: number of engine-resident probes.
    """

    identical: bool
    compared: int
    mismatches: list[str]
    not_comparable: list[str]
    equal_to_cold_off: int
    engine_hits_equal_to_cold_off: int
    engine_hits: int


def check_answers(records: Sequence[RequestRecord]) -> AnswerCheck:
    """Compare each kvtier-on answer (token ids) with the kvtier-off answer of the same split."""
    cold = {(r.doc_id, r.question_index): r for r in records if r.phase == PHASE_OFF and not r.repeat}
    mismatches: list[str] = []
    not_comparable: list[str] = []
    compared = equal_cold = 0
    for r in records:
        if r.phase == PHASE_OFF or r.repeat:
            continue
        name = f"{r.phase} {r.doc_id} q{r.question_index + 1} (cached {cached_tokens(r)})"
        base = cold.get((r.doc_id, r.question_index))
        if base is not None and base.answer_token_ids == r.answer_token_ids:
            equal_cold += 1
        ref = reference_for(r, records)
        if ref is None:
            not_comparable.append(name)
            continue
        compared += 1
        if ref.answer_token_ids != r.answer_token_ids:
            mismatches.append(f"{name}: {r.answer!r} != off {ref.answer!r}")
    probes = [r for r in records if r.phase == PHASE_OFF and r.repeat]
    probes_equal = sum(
        1
        for p in probes
        if (c := cold.get((p.doc_id, p.question_index))) is not None and c.answer_token_ids == p.answer_token_ids
    )
    return AnswerCheck(
        identical=not mismatches,
        compared=compared,
        mismatches=mismatches,
        not_comparable=not_comparable,
        equal_to_cold_off=equal_cold,
        engine_hits_equal_to_cold_off=probes_equal,
        engine_hits=len(probes),
    )


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The demo's summary numbers.

    Medians are over: phase ``off`` non-repeat requests (``ttft_off_median_s``);
    phase ``on`` revisits served only from the CPU tier (``ttft_cpu_hit_median_s``);
    phase ``restart`` requests with any tokens from the disk tier
    (``ttft_disk_hit_median_s``); phase ``off`` repeats (``ttft_engine_hit_median_s``).
    Medians are ``None`` when no request qualifies; ratios are ``None`` then too.
    Token counts and ``hit_rate`` (kvtier-supplied / prompt tokens) cover phases
    ``on`` and ``restart``, non-repeat requests. ``answers_identical`` is True when
    at least one kvtier-on answer could be compared and all compared ones equal
    their kvtier-off reference (see :func:`reference_for`).
    """
    work = [r for r in records if not r.repeat]
    off = [r for r in work if r.phase == PHASE_OFF]
    on = [r for r in work if r.phase == PHASE_ON]
    restart = [r for r in work if r.phase == PHASE_RESTART]
    kv = on + restart

    off_med = _median(r.ttft_s for r in off)
    cpu_med = _median(r.ttft_s for r in on if not r.first_visit and r.tier == "cpu")
    disk_med = _median(r.ttft_s for r in restart if r.tier_tokens.get("disk", 0) > 0)
    restart_cpu_med = _median(r.ttft_s for r in restart if r.tier == "cpu")
    engine_med = _median(r.ttft_s for r in records if r.phase == PHASE_OFF and r.repeat and r.engine_hit_tokens > 0)
    on_first_med = _median(r.ttft_s for r in on if r.first_visit)

    prompt = sum(r.prompt_tokens for r in kv)
    kvtier_tok = sum(r.kvtier_hit_tokens for r in kv)
    answers = check_answers(records)

    def phase_tokens(rs: Sequence[RequestRecord]) -> dict[str, int]:
        return {
            "prompt_tokens": sum(r.prompt_tokens for r in rs),
            "engine_hit_tokens": sum(r.engine_hit_tokens for r in rs),
            "kvtier_hit_tokens": sum(r.kvtier_hit_tokens for r in rs),
            "cpu_hit_tokens": sum(r.tier_tokens.get("cpu", 0) for r in rs),
            "disk_hit_tokens": sum(r.tier_tokens.get("disk", 0) for r in rs),
            "computed_tokens": sum(r.computed_tokens for r in rs),
            "requests": len(rs),
        }

    return {
        "ttft_off_median_s": off_med,
        "ttft_cpu_hit_median_s": cpu_med,
        "ttft_disk_hit_median_s": disk_med,
        "ttft_engine_hit_median_s": engine_med,
        "ttft_on_first_visit_median_s": on_first_med,
        "ttft_restart_cpu_hit_median_s": restart_cpu_med,
        "speedup_cpu_hit_vs_off": _ratio(off_med, cpu_med),
        "speedup_disk_hit_vs_off": _ratio(off_med, disk_med),
        "speedup_engine_hit_vs_off": _ratio(off_med, engine_med),
        "cpu_hit_ttft_over_engine_hit_ttft": _ratio(cpu_med, engine_med),
        "disk_hit_ttft_over_engine_hit_ttft": _ratio(disk_med, engine_med),
        "hit_rate": (kvtier_tok / prompt) if prompt else 0.0,
        "prompt_tokens": prompt,
        "engine_hit_tokens": sum(r.engine_hit_tokens for r in kv),
        "kvtier_hit_tokens": kvtier_tok,
        "computed_tokens": sum(r.computed_tokens for r in kv),
        "disk_hit_tokens": sum(r.tier_tokens.get("disk", 0) for r in restart),
        "tokens_by_phase": {p: phase_tokens([r for r in work if r.phase == p]) for p in PHASES},
        "answers_identical": answers.identical and answers.compared > 0,
        "answers_compared": answers.compared,
        "answer_mismatches": answers.mismatches,
        "answers_not_comparable": answers.not_comparable,
        "answers_equal_to_cold_off": answers.equal_to_cold_off,
        "engine_hit_answers_equal_to_cold_off": answers.engine_hits_equal_to_cold_off,
        "engine_hit_probes": answers.engine_hits,
    }


def failures(summary: dict[str, Any]) -> list[str]:
    """Reasons the demo must exit non-zero (empty when it passed)."""
    out = []
    if summary["answer_mismatches"]:
        out.append("answers with kvtier differ from answers without it")
    elif not summary["answers_identical"]:
        out.append("no kvtier-on answer could be compared with a kvtier-off answer")
    if summary["disk_hit_tokens"] <= 0:
        out.append("no disk-tier hits after the restart")
    return out
