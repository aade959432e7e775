"""One engine run of ``kvtier bench miss-overhead``, in its own Python process.

Run as ``python -m kvtier.bench.engine_run SPEC.json``. Starts vLLM's in-process
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the parent) on the spec's
model, with kvtier's connector or without it (``kvtier: null``), runs the
warm-up prompts unrecorded, then each prompt alone (add, step until finished),
timing each with ``perf_counter``. Writes ``{"requests": [...], ...}`` to the
spec's ``result_path``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineRunSpec:
    """Everything one run needs (JSON-serialisable).

    Attributes:
        label: configuration name, e.g. ``"off"`` or ``"cpu"``.
        model: model folder.
        prompts: token ids of the timed prompts, run one at a time in order.
        warmup: token ids of unrecorded warm-up prompts.
        output_tokens: tokens generated per request (EOS ignored, so every run
            generates exactly as many).
        max_model_len: engine context limit (tokens).
        kvtier: ``kv_connector_extra_config`` for kvtier, or None for no connector.
        result_path: where to write the result JSON.
    """

    label: str
    model: str
    prompts: list[list[int]]
    warmup: list[list[int]]
    output_tokens: int
    max_model_len: int
    kvtier: dict[str, Any] | None
    result_path: str


#: KVTierConnector methods the engine calls on its own thread (scheduler and worker side).
_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
)


def _time_connector_hooks(total: list[float]) -> None:
    """Wrap the connector's engine-thread methods to add their seconds to ``total[0]``.

    This measures kvtier's synchronous cost inside the engine's step in the same
    process and under the same load as the request itself, so it is far less
    noisy than comparing two engine runs. It does not see kvtier's background
    threads (disk write-behind, async loads), which compete for the CPUs instead.
    Only ever done in this benchmark subprocess.
    """
    import functools

    from kvtier.integrations.vllm import KVTierConnector

    for name in _HOOKS:
        fn = KVTierConnector.__dict__.get(name)
        if fn is None:
            continue

        def wrap(f: Any) -> Any:
            @functools.wraps(f)
            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return f(*args, **kwargs)
                finally:
                    total[0] += time.perf_counter() - t0

            return timed

        setattr(KVTierConnector, name, wrap(fn))


def _build_llm(spec: EngineRunSpec) -> Any:
    from kvtier.integrations.vllm_engine import build_llm

    return build_llm(spec.model, spec.kvtier, max_model_len=spec.max_model_len)


def _run_one(engine: Any, request_id: str, token_ids: list[int], params: Any) -> tuple[float, int, int]:
    """Run one request alone; returns (seconds, prompt tokens vLLM found in its own cache, output tokens)."""
    from vllm.inputs import TokensPrompt

    final = None
    t0 = time.perf_counter()
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=token_ids), params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    elapsed = time.perf_counter() - t0
    if final is None:
        raise RuntimeError(f"request {request_id} finished without output")
    return elapsed, int(final.num_cached_tokens or 0), len(final.outputs[0].token_ids)


def run(spec: EngineRunSpec) -> dict[str, Any]:
    """Run the spec and return (and write) its result."""
    from vllm import SamplingParams

    hook_s = [0.0]
    if spec.kvtier is not None:
        _time_connector_hooks(hook_s)
    t0 = time.perf_counter()
    llm = _build_llm(spec)
    engine = llm.llm_engine
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_tokens, ignore_eos=True)
    for i, w in enumerate(spec.warmup):
        _run_one(engine, f"warmup{i}", w, params)
    requests = []
    for i, p in enumerate(spec.prompts):
        before = hook_s[0]
        seconds, cached, out_tokens = _run_one(engine, f"r{i}", p, params)
        requests.append(
            {
                "prompt_tokens": len(p),
                "output_tokens": out_tokens,
                "engine_cached_tokens": cached,
                "seconds": seconds,
                "connector_seconds": hook_s[0] - before,
            }
        )
    stats: list[dict[str, Any]] = []
    flush_s = 0.0
    if spec.kvtier is not None:
        from kvtier.integrations.vllm import flush_all, stats_all

        t1 = time.perf_counter()
        flush_all()
        flush_s = time.perf_counter() - t1
        stats = stats_all()
    result = {
        "label": spec.label,
        "engine_start_s": start_s,
        "requests": requests,
        "flush_s": flush_s,
        "kvtier_stats": stats,
    }
    Path(spec.result_path).write_text(json.dumps(result, indent=1))
    try:  # close kvtier's tiers (flush, release the disk directory)
        engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exits next
        pass
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvtier.bench.engine_run SPEC.json", file=sys.stderr)
        return 2
    run(EngineRunSpec(**json.loads(Path(argv[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
