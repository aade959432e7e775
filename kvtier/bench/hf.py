"""``kvtier bench hf``: time to first token of Hugging Face transformers, cold vs a kvtier hit.

Workload: the real model (SmolLM2-135M-Instruct, bf16, CPU; :func:`kvtier.demo.model.prepare_model`),
a shared prefix of ``prefix_tokens`` tokens (default 2,048: eight 256-token chunks, from a
demo document) followed by a distinct short question per repetition.

- cold: plain ``model.generate(max_new_tokens=1)`` over the whole prompt (kvtier off);
- hit: :class:`~kvtier.integrations.transformers.KVTierHF` ``.generate(max_new_tokens=1)``
  after the prefix was stored once (embedded CPU tier): the prefix comes from kvtier and
  only the question is prefilled.

TTFT is the wall time of that call (seconds), median over ``reps``; ``ttft_speedup_2k`` =
cold median / hit median, measured side by side in one run (target >= 5).
``answers_identical``: every hit's greedy answer (``answer_tokens`` tokens) equals a cold
run split at the same position (:func:`~kvtier.integrations.transformers.cold_generate_split`);
``answers_equal_unsplit`` counts those also equal to the unsplit cold run (bf16 may round
a split prefill differently; not required). Exit code 0 when both targets are met, else 1.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

#: Target ratio of cold to hit TTFT medians.
TARGET_SPEEDUP = 5.0


def _prompts(tok: Any, prefix_tokens: int, reps: int) -> tuple[list[int], list[list[int]]]:
    docs = Path(__file__).resolve().parents[1] / "demo" / "documents"
    text = "\n".join((docs / name).read_text() for name in ("GPL-2.txt", "MPL-2.0.txt"))
    prefix = tok(text, add_special_tokens=False).input_ids[:prefix_tokens]
    if len(prefix) < prefix_tokens:
        from kvtier.bench.common import BenchUsageError

        raise BenchUsageError(f"--prefix-tokens {prefix_tokens}: the demo documents have only {len(prefix)} tokens")
    questions = json.loads((docs / "questions.json").read_text())
    qs = [q["question"] for doc in questions["documents"] if doc.get("file") in ("GPL-2.txt", "MPL-2.0.txt")
          for q in doc.get("questions", [])] or ["What does this section say?"]
    suffixes = [tok(f"\n\nQuestion {i}: {qs[i % len(qs)]}\nAnswer:", add_special_tokens=False).input_ids
                for i in range(reps)]
    return prefix, suffixes


def measure(reps: int = 3, prefix_tokens: int = 2048, answer_tokens: int = 16) -> dict[str, Any]:
    """Run the benchmark; returns every measured number (see the module docstring)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtier.config import KVTierConfig
    from kvtier.demo.model import prepare_model
    from kvtier.integrations.transformers import KVTierHF, cold_generate_split

    path = str(prepare_model().path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prefix, suffixes = _prompts(tok, prefix_tokens, reps)
    prompts = [torch.tensor([prefix + s]) for s in suffixes]
    gen = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    config = KVTierConfig(chunk_size=256, cpu_capacity=max(64 << 20, 4 * prefix_tokens * 23040))
    out: dict[str, Any] = dict(model=Path(path).name, dtype="bfloat16", transformers=transformers.__version__,
                               torch_threads=torch.get_num_threads(), reps=reps, prefix_tokens=prefix_tokens,
                               prompt_tokens=[p.shape[1] for p in prompts], answer_tokens=answer_tokens)
    with torch.no_grad(), KVTierHF(model, config) as kv:
        model.generate(prompts[0][:, :64], max_new_tokens=1, **gen)  # warm-up (first-call allocations)
        cold = []
        for p in prompts:
            t0 = time.perf_counter()
            model.generate(p, max_new_tokens=1, **gen)
            cold.append(time.perf_counter() - t0)
        kv.generate(torch.tensor([prefix + [tok.eos_token_id]]), max_new_tokens=1, **gen)  # store the prefix
        hit, hit_tokens = [], []
        for p in prompts:
            t0 = time.perf_counter()
            kv.generate(p, max_new_tokens=1, **gen)
            hit.append(time.perf_counter() - t0)
            hit_tokens.append(kv.last_hit_tokens[0])
        identical, unsplit = 0, 0
        for p in prompts:
            answer = kv.generate(p, max_new_tokens=answer_tokens, **gen)
            split = kv.last_hit_tokens[0]
            identical += bool(torch.equal(answer, cold_generate_split(model, p, None, split, max_new_tokens=answer_tokens, **gen)))
            unsplit += bool(torch.equal(answer, model.generate(p, max_new_tokens=answer_tokens, **gen)))
        stats = kv.store.stats()
    cold_med, hit_med = statistics.median(cold), statistics.median(hit)
    out.update(ttft_cold_s=cold, ttft_hit_s=hit, ttft_cold_median_s=cold_med, ttft_hit_median_s=hit_med,
               ttft_speedup_2k=cold_med / hit_med if hit_med > 0 else float("inf"), hit_tokens=hit_tokens,
               answers_compared=len(prompts), answers_identical=identical == len(prompts) and bool(prompts),
               answers_equal_unsplit=unsplit, stored_chunks=stats.get("stored_chunks", 0), target_speedup=TARGET_SPEEDUP)
    return out


def run_bench_hf(json_path: Path | None = None, reps: int = 3, prefix_tokens: int = 2048, answer_tokens: int = 16) -> int:
    """CLI entry: measure, print a summary, write JSON; 0 if ``ttft_speedup_2k`` >= 5 and answers are identical."""
    from kvtier.bench.common import BenchUsageError, write_json

    if reps < 1 or prefix_tokens < 256:
        raise BenchUsageError("--reps must be >= 1 and --prefix-tokens >= 256 (one chunk)")
    r = measure(reps=reps, prefix_tokens=prefix_tokens, answer_tokens=answer_tokens)
    print(f"transformers {r['transformers']} {r['model']} bf16 CPU, {r['prefix_tokens']}-token shared prefix, "
          f"{reps} reps")
    print(f"TTFT cold median {r['ttft_cold_median_s'] * 1e3:.0f} ms  hit median {r['ttft_hit_median_s'] * 1e3:.0f} ms  "
          f"speedup {r['ttft_speedup_2k']:.1f}x (target >= {TARGET_SPEEDUP:g})  hit tokens {r['hit_tokens']}")
    print(f"answers identical to a cold run at the same split: {r['answers_identical']} "
          f"({r['answers_equal_unsplit']}/{r['answers_compared']} also equal to the unsplit cold run)")
    write_json(json_path, r)
    return 0 if r["ttft_speedup_2k"] >= TARGET_SPEEDUP and r["answers_identical"] else 1
