"""A short TTFT demo of kvtier on GPU vLLM: cold prefill vs a kvtier hit of a long shared prefix.

``python -m kvtier.integrations.vllm.gpu.ttft_demo --model PATH [--json OUT]``

One in-process ``vllm.LLM`` with kvtier's connector (CPU tier only). For each of
``--rounds`` distinct documents of ``--prefix-tokens`` tokens: a cold request
(prefill, stores the chunks through the layer-wise saver), then vLLM's own prefix
cache is reset so the second request's hit can only come from kvtier (layer-wise
loads), then the same prompt again. TTFT is the wall time of ``generate`` with
``max_tokens=1`` (in-process: no HTTP). The greedy answers of a cold and a hit
run (16 tokens) are compared. Prints one JSON object; ratios are measured side
by side in the same process, no threshold is asserted here.

Raises (exit 2): vLLM is not a CUDA build, or no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 20_000) for _ in range(n)]


def run(model: str, prefix_tokens: int, rounds: int, cpu_gib: float) -> dict[str, Any]:
    """Measure cold and hit TTFT (seconds) over ``rounds`` documents; see the module docstring."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm_engine import kv_transfer_config

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: this demo is for GPU vLLM")
    extra = {"chunk_size": 256, "cpu_capacity": int(cpu_gib * 2**30), "model_id": "gpu-ttft-demo"}
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.3, seed=0, max_model_len=prefix_tokens + 64,
              kv_transfer_config=kv_transfer_config(extra))
    startup_s = time.perf_counter() - t0
    one = SamplingParams(max_tokens=1, temperature=0.0)
    answer = SamplingParams(max_tokens=16, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=_prompt(999, 64))], one)  # warm-up (graphs, kernels)
    cold, hit, identical = [], [], []
    for r in range(rounds):
        prompt = TokensPrompt(prompt_token_ids=_prompt(r, prefix_tokens))
        t = time.perf_counter()
        cold_out = llm.generate([prompt], answer if r == 0 else one)
        cold.append(time.perf_counter() - t)
        llm.reset_prefix_cache()  # the hit must come from kvtier, not vLLM's GPU prefix cache
        t = time.perf_counter()
        hit_out = llm.generate([prompt], answer if r == 0 else one)
        hit.append(time.perf_counter() - t)
        llm.reset_prefix_cache()
        if r == 0:
            identical.append(cold_out[0].outputs[0].token_ids == hit_out[0].outputs[0].token_ids)
    cold_ms, hit_ms = statistics.median(cold[1:] or cold) * 1e3, statistics.median(hit[1:] or hit) * 1e3
    return {
        "device": torch.cuda.get_device_name(0),
        "model": os.path.basename(model.rstrip("/")),
        "prefix_tokens": prefix_tokens,
        "rounds": rounds,
        "startup_s": round(startup_s, 1),
        "ttft_cold_ms": round(cold_ms, 1),
        "ttft_hit_ms": round(hit_ms, 1),
        "ttft_speedup": round(cold_ms / hit_ms, 2) if hit_ms > 0 else None,
        "answers_identical": all(identical),
        "note": "first round includes 16 generated tokens (answer check); medians exclude it when rounds > 1",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cpu-gib", type=float, default=4.0)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    try:
        out = run(a.model, a.prefix_tokens, a.rounds, a.cpu_gib)
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}))
        return 2
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
