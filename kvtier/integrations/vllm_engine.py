"""Starting vLLM engines with kvtier: the one place that knows the CPU-backend settings.

Used by the demo, the benchmarks and the end-to-end tests, so every engine they
start is configured the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

#: kv_transfer_config names of the connector. kvtier's own tools (demos, benchmarks, tests, ``kvtier
#: serve``) ask vLLM to recompute the blocks of a failed load (vLLM's default, "fail", ends the
#: request with an error; see kvtier.integrations.vllm.failure_policy).
CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def cpu_list() -> str:
    """The CPUs this process may use, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` range list (e.g. ``0-1``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return "auto"
    ranges: list[str] = []
    start = prev = cpus[0]
    for c in cpus[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def engine_env(base: Mapping[str, str], in_process: bool = True) -> dict[str, str]:
    """Environment for a process that runs vLLM's CPU backend (values already in ``base`` win).

    ``in_process`` forces ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in
    the calling process: exact TTFT timing, and ``request_hits`` can see it).
    ``VLLM_CPU_KVCACHE_SPACE`` counts whole GiB (1 is far more than SmolLM2 needs;
    ``num_gpu_blocks_override`` bounds the KV space used).
    """
    env = dict(base)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list())
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    pkg_root = str(Path(__file__).resolve().parents[2])  # child processes import this kvtier
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


def kv_transfer_config(extra: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvtier with ``extra`` as ``kv_connector_extra_config``."""
    return {**CONNECTOR, **fields, "kv_connector_extra_config": dict(extra)}


#: x86 CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) without native bf16 kernels.
SLOW_BF16_X86 = ("AVX2", "DEFAULT")


def engine_dtype() -> str:
    """The dtype kvtier runs vLLM's CPU backend in here: ``"bfloat16"`` where the CPU has native bf16
    kernels (AVX-512 and up; vLLM's CPU docs list AVX-512 for BF16), ``"float32"`` elsewhere.

    On an AVX2-only x86 CPU torch has no vectorised bf16 GEMM: a ``[512, 576] @ [576, 1536]`` matmul took
    774 ms in bf16 and 17 ms in fp32 (45x, measured on this project's 2-core AMD EPYC machine,
    2026-12-02), and the demo's cold phase ran past 20 minutes instead of about 2. The weights are
    bf16 either way (vLLM casts them); the KV cache takes the dtype, so are kvtier's chunks and keys.
    """
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "bfloat16"  # (ARM's BF16 path is vLLM's own; not measured here)
    try:
        import torch

        capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - no torch, or an old one: keep vLLM's CPU default
        return "bfloat16"
    return "float32" if capability in SLOW_BF16_X86 else "bfloat16"


def build_llm(model: str, kvtier: Mapping[str, Any] | None = None, **overrides: Any) -> Any:
    """A ``vllm.LLM`` on the CPU backend, with kvtier's connector when ``kvtier`` is given.

    Defaults: :func:`engine_dtype` (bf16 where the CPU has native bf16), eager mode, ``gpu_memory_utilization=0.5`` (on the CPU backend it
    is the share of the NUMA node's memory reserved; the default 0.92 refuses to
    start on a shared machine), seed 0. ``overrides`` are passed to ``LLM``.
    """
    from vllm import LLM

    kwargs: dict[str, Any] = dict(dtype=engine_dtype(), enforce_eager=True, gpu_memory_utilization=0.5, seed=0)
    kwargs.update(overrides)
    if kvtier is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(kvtier)
    return LLM(model=model, **kwargs)
