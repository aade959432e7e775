"""One demo phase in its own Python process: start vLLM, run the visits, write records.

Run as ``python -m kvtier.demo.phase SPEC.json PROGRESS_FD``. The spec (written by
``kvtier.demo.run``) names the model, the prompts as token ids, the KV block
budget and the kvtier settings (``null`` = kvtier off). Progress goes to the
inherited file descriptor as JSON lines; vLLM's own logs go to stdout/stderr,
which the parent sends to a log file. Records go to the spec's ``result_path``.

A fresh process per phase makes the "restart" phase real: nothing of the
previous phase survives except files on disk.

TTFT is measured around vLLM's in-process engine (``LLM.llm_engine``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one request at a time, from
``add_request`` to the first ``step()`` that returns a generated token.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvtier.demo.stats import RequestRecord


@dataclass(frozen=True)
class PhaseSpec:
    """Everything a phase process needs (JSON-serialisable).

    Attributes:
        phase: phase name (see ``kvtier.demo.stats.PHASES``).
        model: bf16 model folder.
        visits: ``[{"doc_id", "question_index", "first_visit", "prompt_token_ids"}]`` in order.
        warmup_token_ids: a short prompt run first and not recorded (one-time kernel set-up).
        max_tokens: greedy answer length (tokens).
        num_blocks: engine KV blocks (``num_gpu_blocks_override``).
        block_size: engine block size (tokens).
        max_model_len: engine context limit (tokens).
        kvtier: ``kv_connector_extra_config`` for kvtier, or None for kvtier off.
        probe_engine_hits: after each first visit, submit every question about
            that document twice more as engine-resident prefix-cache hits (document
            cached, then its own whole prompt cached).
        result_path: where to write ``{"records": [...], ...}``.
    """

    phase: str
    model: str
    visits: list[dict[str, Any]]
    warmup_token_ids: list[int]
    max_tokens: int
    num_blocks: int
    block_size: int
    max_model_len: int
    kvtier: dict[str, Any] | None
    probe_engine_hits: bool
    result_path: str


class _Progress:
    """JSON lines to the parent's progress pipe (missing pipe: silent)."""

    def __init__(self, stream: IO[str] | None):
        self._stream = stream

    def send(self, **event: Any) -> None:
        if self._stream is None:
            return
        try:
            self._stream.write(json.dumps(event) + "\n")
            self._stream.flush()
        except OSError:
            self._stream = None


def _build_llm(spec: PhaseSpec) -> Any:
    from kvtier.integrations.vllm_engine import build_llm

    return build_llm(
        spec.model,
        spec.kvtier,
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        num_gpu_blocks_override=spec.num_blocks,
        enable_prefix_caching=True,
    )


def _run_one(engine: Any, request_id: str, token_ids: list[int], params: Any) -> tuple[float, Any]:
    """Submit one request and step until it finishes; returns (TTFT seconds, final RequestOutput)."""
    from vllm.inputs import TokensPrompt

    ttft: float | None = None
    final = None
    t0 = time.perf_counter()
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=token_ids), params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs and len(out.outputs[0].token_ids) > 0:
                ttft = time.perf_counter() - t0
            if out.finished and out.request_id.startswith(request_id):
                final = out
    if final is None or ttft is None:
        raise RuntimeError(f"request {request_id} finished without output")
    return ttft, final


def _hits(spec: PhaseSpec, request_id: str, prompt_tokens: int, final: Any) -> tuple[int, int, dict[str, int]]:
    """(engine hit tokens, kvtier hit tokens, per-tier tokens) for a finished request."""
    cached = int(final.num_cached_tokens or 0)
    if spec.kvtier is None:
        return cached, 0, {}
    from kvtier.integrations.vllm import request_hits

    info = request_hits(request_id)
    if info is None:  # kvtier has no record: count everything vLLM cached as engine-held
        return cached, 0, {}
    tiers = {str(k): int(v) for k, v in (info.get("tiers") or {}).items()}
    return int(info["engine_hit_tokens"]), int(info["kvtier_hit_tokens"]), tiers


def run_phase(spec: PhaseSpec, progress: _Progress) -> dict[str, Any]:
    """Run one phase and return its result dict (also written to ``spec.result_path``)."""
    progress.send(event="status", text="importing vLLM")
    t_import = time.perf_counter()
    from vllm import SamplingParams

    progress.send(event="status", text="starting engine")
    t_start = time.perf_counter()
    llm = _build_llm(spec)
    engine = llm.llm_engine
    engine_start_s = time.perf_counter() - t_start
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=False)

    progress.send(event="status", text="warm-up request")
    _run_one(engine, f"{spec.phase}-warmup", spec.warmup_token_ids, params)

    # Engine-resident probes: right after a document's first visit, every question
    # about it is submitted twice while vLLM's own prefix cache still holds the
    # document: first with the document cached, then again with its own whole prompt
    # cached (a hit in vLLM's prefix cache for the same prompt). They time
    # engine-resident hits, and their answers are the references for kvtier hits at
    # the same prefix lengths (see stats.check_answers).
    probes: dict[int, list[int]] = {}
    if spec.probe_engine_hits:
        for seq, v in enumerate(spec.visits):
            if v["first_visit"]:
                probes[seq] = [j for j, w in enumerate(spec.visits) if w["doc_id"] == v["doc_id"]]
    total = len(spec.visits) + 2 * sum(len(p) for p in probes.values())
    progress.send(event="start", total=total)
    records: list[RequestRecord] = []

    def run_and_record(seq: int, rid: str, repeat: bool) -> None:
        v = spec.visits[seq]
        ids = list(v["prompt_token_ids"])
        ttft, final = _run_one(engine, rid, ids, params)
        engine_hit, kvtier_hit, tiers = _hits(spec, rid, len(ids), final)
        rec = RequestRecord(
            phase=spec.phase,
            seq=seq,
            doc_id=v["doc_id"],
            question_index=int(v["question_index"]),
            first_visit=bool(v["first_visit"]),
            repeat=repeat,
            prompt_tokens=len(ids),
            engine_hit_tokens=engine_hit,
            kvtier_hit_tokens=kvtier_hit,
            tier_tokens=tiers,
            ttft_s=ttft,
            answer=final.outputs[0].text,
            answer_token_ids=[int(t) for t in final.outputs[0].token_ids],
        )
        records.append(rec)
        progress.send(event="request", record=rec.to_json())

    for seq in range(len(spec.visits)):
        run_and_record(seq, f"{spec.phase}-r{seq}", repeat=False)
        for j in probes.get(seq, []):
            run_and_record(j, f"{spec.phase}-p{seq}x{j}", repeat=True)
            run_and_record(j, f"{spec.phase}-p{seq}x{j}-again", repeat=True)

    kvtier_stats: list[dict[str, Any]] = []
    flushed = True
    if spec.kvtier is not None:
        progress.send(event="status", text="flushing kvtier write-behind")
        from kvtier.integrations.vllm import flush_all, stats_all

        flushed = bool(flush_all())
        kvtier_stats = stats_all()
    result = {
        "phase": spec.phase,
        "records": [r.to_json() for r in records],
        "engine_start_s": engine_start_s,
        "import_s": t_start - t_import,
        "kvtier_flushed": flushed,
        "kvtier_stats": kvtier_stats,
    }
    Path(spec.result_path).write_text(json.dumps(result, indent=1))
    progress.send(event="done")
    # Shut the engine down explicitly so kvtier's manager closes (and flushes) its tiers.
    try:
        engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exits next anyway
        pass
    return result


def main(argv: list[str]) -> int:
    """Entry point: ``python -m kvtier.demo.phase SPEC.json [PROGRESS_FD]``."""
    if len(argv) not in (1, 2):
        print("usage: python -m kvtier.demo.phase SPEC.json [PROGRESS_FD]", file=sys.stderr)
        return 2
    spec = PhaseSpec(**json.loads(Path(argv[0]).read_text()))
    stream = os.fdopen(int(argv[1]), "w", buffering=1) if len(argv) == 2 else None
    run_phase(spec, _Progress(stream))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
