"""``kvtier bench serve``: vLLM's OpenAI server alone, with kvtier, and two instances behind
``kvtier router``, driven side by side by real streaming clients (multi-round QA, a no-reuse
slice, and vLLM's own ``vllm bench serve`` client). See :mod:`kvtier.bench.serve.run`.

Modules: :mod:`.workload` (sessions, working set), :mod:`.client` (async streaming client,
TTFT/TPOT/ITL), :mod:`.configs` (configurations, /metrics, routing oracle),
:mod:`.vllm_client` (vLLM's benchmark client), :mod:`.run` (the run, table, JSON, plot).
"""

from __future__ import annotations

from kvtier.bench.serve.run import (
    DEFAULT_CONFIGS,
    ServeBenchOptions,
    Target,
    parse_target,
    run_bench_serve,
)

__all__ = ["DEFAULT_CONFIGS", "ServeBenchOptions", "Target", "parse_target", "run_bench_serve"]
