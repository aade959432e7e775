"""The serving benchmark's answer check: kvtier's hits give vLLM's own greedy tokens.

Why a separate, serial check: under concurrent load, vLLM's greedy answers in bf16 depend
on what else is in the batch and on where each prefill was split (a prefix-cache hit
computes the suffix with other kernel shapes). Two runs of vLLM *alone* at concurrency 2
already disagree on a share of the multi-round answers (the JSON reports it as
``concurrent_answer_agreement``), so comparing the measured phases answer by answer would
test batching, not kvtier.

The check therefore runs one request at a time, on fresh users (``u1000``...), two
questions per user, each question asked on ``system prompt + the user's context``
(no history): every user's first question (a cold prefill), then every user's second
question. The second question shares the first one's prompt up to the question, so it
is a hit at the same split everywhere: in ``vllm@fits`` (the reference, engine KV holding
everything) it is an engine-resident prefix-cache hit; in ``kvtier-cpu`` and
``kvtier-cpu-disk`` (engine KV bounded, the other users' contexts have evicted it) the
engine's missing blocks come from kvtier's tiers. kvtier runs with its chunk size equal
to the engine block size (128 tokens) in this benchmark, so both hits end on the same
token. Identical token streams then mean kvtier returned exactly the KV vLLM had
computed (the rule of ``kvtier demo-server``).

``vllm`` (engine KV bounded) runs the check too, in *paired* order (each user's second
question right after its first): its second question is then an engine-resident hit at
the same split, so it is the reference when ``vllm@fits`` is not run, and its TTFT is the
isolated-hit baseline (``isolated_hit_ttft_ratio_vs_vllm``: kvtier's hit from its CPU tier
over vLLM's own hit on the same prompt). ``lmcache-mp`` runs it like kvtier; its answers
are reported beside kvtier's (``answers_identical_lmcache``), not judged with them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx

from kvtier.bench.serve.client import OnDone, RequestRecord, run_sync, stream_request
from kvtier.bench.serve.workload import Session, Tokenizer, WorkloadSpec, build_sessions

#: First user index of the check's users (disjoint from the measured workload's).
CHECK_USER_OFFSET = 1000
#: Configurations whose answers are the reference, the first one run wins.
REFERENCES = ("vllm@fits", "vllm")
#: Configurations that run the check (when they are measured).
CHECKED = ("vllm", "vllm@fits", "kvtier-cpu", "kvtier-cpu-disk", "kvtier-cpu@fits", "lmcache-mp")
#: Configurations that run it in paired order (second question right after the first).
PAIRED = ("vllm",)


def check_sessions(spec: WorkloadSpec, tokenizer: Tokenizer, users: int) -> list[Session]:
    """``users`` fresh users (indices from :data:`CHECK_USER_OFFSET`), two questions each."""
    return build_sessions(replace(spec, users=users, rounds=2, user_offset=CHECK_USER_OFFSET), tokenizer)


def check_requests(sessions: Sequence[Session], paired: bool = False) -> list[tuple[str, list[dict[str, str]]]]:
    """``(request id, chat messages)`` in issue order: every first question, then every second
    (``paired``: each user's two questions one after the other)."""
    def msgs(s: Session, q: int) -> tuple[str, list[dict[str, str]]]:
        return (f"check-u{s.user}-q{q}", [{"role": "system", "content": s.system},
                                          {"role": "user", "content": f"{s.context}\n\nQuestion: {s.questions[q]}"}])

    if paired:
        return [msgs(s, q) for s in sessions for q in range(2)]
    return [msgs(s, q) for q in range(2) for s in sessions]


async def _serial(url: str, model: str, reqs: Sequence[tuple[str, list[dict[str, str]]]], max_tokens: int,
                  on_done: OnDone | None) -> list[RequestRecord]:
    t0 = time.perf_counter()
    out = []
    async with httpx.AsyncClient(timeout=None) as client:
        for rid, msgs in reqs:
            rec = await stream_request(client, url, model, rid, messages=msgs, max_tokens=max_tokens, t0=t0)
            out.append(rec)
            if on_done:
                on_done(rec)
    return out


def run_check(url: str, model: str, sessions: Sequence[Session], max_tokens: int,
              on_done: OnDone | None = None, paired: bool = False) -> list[RequestRecord]:
    """Send the check's requests to ``url`` one at a time; their records in issue order
    (``paired``: see :func:`check_requests`). Failed requests are records with ok=False
    (never raises for one)."""
    return run_sync(_serial(url, model, check_requests(sessions, paired), max_tokens, on_done))


def hit_ttft(records: Sequence[RequestRecord]) -> float | None:
    """Mean TTFT (seconds) of the check's second questions (the hits); None if none succeeded."""
    xs = [r.ttft for r in records if r.ok and r.request_id.endswith("-q1")]
    return sum(xs) / len(xs) if xs else None


def compare_answers(runs: dict[str, Sequence[RequestRecord]], reference: str | None = None) -> dict[str, Any]:
    """Compare every configuration's check answers with the reference's, request by request.

    ``reference``: default the first of :data:`REFERENCES` in ``runs``. kvtier's
    configurations (``kvtier-*``) are judged together; every other one (``lmcache-mp``,
    ``vllm`` against ``vllm@fits``) is reported on its own under ``others``.

    Returns ``{"reference", "compared", "mismatches": [{config, request_id, reference, got,
    error}], "identical", "others": {config: {"compared", "mismatches", "identical"}}}``;
    ``identical`` is None when the reference or every kvtier configuration is missing. A
    failed request on either side is a mismatch.
    """
    if reference is None:
        reference = next((r for r in REFERENCES if r in runs), REFERENCES[0])
    ref = {r.request_id: r for r in runs.get(reference, ())}
    per: dict[str, tuple[int, list[dict[str, str]]]] = {}
    for name, recs in runs.items():
        if name == reference:
            continue
        compared, mism = 0, []
        for r in recs:
            b = ref.get(r.request_id)
            if b is None:
                continue
            compared += 1
            if not (r.ok and b.ok) or r.answer != b.answer:
                mism.append({"config": name, "request_id": r.request_id, "reference": b.answer, "got": r.answer,
                             "error": r.error or b.error})
        per[name] = (compared, mism)
    kv = {k: v for k, v in per.items() if k.startswith("kvtier")}
    compared = sum(c for c, _ in kv.values())
    mism = [m for _, ms in kv.values() for m in ms]
    others = {k: {"compared": c, "mismatches": ms, "identical": (not ms) if c else None}
              for k, (c, ms) in per.items() if k not in kv}
    return {"reference": reference, "compared": compared, "mismatches": mism,
            "identical": (not mism) if compared else None, "others": others}


def concurrent_agreement(phases: dict[str, Any], baseline: str = "vllm") -> dict[str, dict[str, int]]:
    """Information only: per configuration, how many measured (concurrent) answers equal
    ``baseline``'s for the same request id (``X@fits`` against ``vllm@fits``, and
    ``vllm@fits`` against ``vllm``: vLLM alone against itself)."""
    out: dict[str, dict[str, int]] = {}
    for name, ph in phases.items():
        if name.endswith("@noreuse") or name == baseline:
            continue
        base = "vllm@fits" if name.endswith("@fits") and name != "vllm@fits" else baseline
        if base not in phases:
            continue
        ref = {r.request_id: r.answer for r in phases[base].records if r.ok}
        pairs = [(r.answer, ref[r.request_id]) for r in ph.records if r.ok and r.request_id in ref]
        out[name] = {"equal": sum(a == b for a, b in pairs), "of": len(pairs), "baseline": base}  # type: ignore[dict-item]
    return out
