"""Issue 23 item 1 on the real model (SmolLM2-135M-Instruct, vLLM CPU, in-process engine).

Chunk = block = 128 tokens. a = A+B+[x] and b = A+C+[y]; a is stored; the engine's
prefix cache is reset; a and b are sent together and the read of chunk A fails
once, so b computes its chunk 1 over the block vLLM hands it while a's load of A
is still to fill it. The chunk b stores (after vLLM's recompute) is compared byte
for byte with the one a reference run stores: kvtier empty, a and b sent together,
so that step computes exactly what the recompute step did (same batch, same
split). Then b is sent again with the prefix cache reset (its first 256 tokens
from kvtier) in both runs, and the greedy tokens are compared. Done twice: with
kvtier as it is, and with its guard removed (the negative control: b's stored
chunk 1 is then computed over the unloaded block).

    python tests/vllm_load_failure_scenario.py    # prints RESULT {json}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvtier.integrations.vllm_engine import engine_env  # noqa: E402  (no vLLM import)

os.environ.update(engine_env(os.environ, in_process=True))

BLOCK = 128


def _failing_first_read(manager, key: bytes) -> dict:
    """The next read of ``key`` through ``manager`` fails (a miss), once; returns the counter."""
    original = manager.open_read_many
    state = {"failed": 0}

    def open_read_many(items):
        handles = original(items)
        out = []
        for (k, _), h in zip(items, handles):
            if h is not None and k == key and not state["failed"]:
                h.close()
                state["failed"] = 1
                h = None
            out.append(h)
        return out

    manager.open_read_many = open_read_many
    return state


def _stored(manager, key: bytes) -> list[int] | None:
    """The bytes kvtier holds for ``key`` (CPU tier), as a list, or None."""
    buf = manager.cpu.acquire(key)
    if buf is None:
        return None
    try:
        return buf.tolist()
    finally:
        manager.cpu.release(key)


def run(llm, tokens: list[int], offset: int, fail: bool) -> dict:
    """a and b in one step; with ``fail``, a's chunks are stored first and the read of A fails.

    Without ``fail`` kvtier starts empty, so the step computes exactly what the step after
    the failure recomputes (a from token 0, b from 128 over a's block A, which vLLM hands b
    as a local hit): the chunk b stores is the reference, computed in the same batch.
    """
    from kvtier.storage import registry
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_scenarios import _generate, _hits

    A = tokens[offset : offset + BLOCK]
    B = tokens[offset + BLOCK : offset + 2 * BLOCK]
    C = tokens[offset + 2 * BLOCK : offset + 3 * BLOCK]
    a, b = A + B + [tokens[offset + 3 * BLOCK]], A + C + [tokens[offset + 3 * BLOCK + 1]]
    (manager,) = registry.active_managers()
    manager.clear()
    llm.reset_prefix_cache()
    state = {"failed": 0}
    if fail:
        _generate(llm, a)  # stores chunks A and A+B
        assert manager.flush(30)
        llm.reset_prefix_cache()
        state = _failing_first_read(manager, manager.keys(a)[0])
    outs = llm.generate([TokensPrompt(prompt_token_ids=a), TokensPrompt(prompt_token_ids=b)],
                        SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    shared = {"a": _hits(outs[0].request_id), "b": _hits(outs[1].request_id)}
    if fail:
        del manager.open_read_many  # back to the class's method
    assert manager.flush(30)
    b1 = _stored(manager, manager.keys(b)[1])
    llm.reset_prefix_cache()
    hit, _, rid = _generate(llm, b)  # b's first 256 tokens from kvtier
    return {"failed_reads": state["failed"], "shared": shared, "b1": b1, "hit": hit, "hit_hits": _hits(rid)}


def compare(failed: dict, clean: dict) -> dict:
    """The failed-load run against the reference run: b's stored chunk 1 and the tokens of a hit on it."""
    import numpy as np
    import torch

    from kvtier.integrations.vllm_engine import engine_dtype

    kv_dtype = getattr(torch, engine_dtype())  # the chunk's bytes are the engine's KV dtype (bf16 or fp32)

    def floats(raw: list[int] | None) -> np.ndarray | None:
        if raw is None:
            return None
        return torch.tensor(raw, dtype=torch.uint8).view(kv_dtype).float().numpy()

    raw_f, raw_c = failed.pop("b1"), clean.pop("b1")
    f, c = floats(raw_f), floats(raw_c)
    out = {"failed": failed, "clean": clean, "b1_stored": f is not None, "b1_equal": None, "b1_max_abs_diff": None}
    if f is not None and c is not None:
        out["b1_equal"] = raw_f == raw_c  # "stored right": the same bytes as the reference run's
        out["b1_max_abs_diff"] = float(np.nanmax(np.abs(f - c))) if f.size else 0.0
    return out


def main() -> dict:
    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm_engine import build_llm
    from vllm_scenarios import _prompt

    tokens = _prompt()
    cfg = {"cpu_capacity": "256MiB", "chunk_size": BLOCK}
    llm = build_llm(str(prepare_model().path), cfg, max_model_len=4096, num_gpu_blocks_override=40,
                    max_num_batched_tokens=2048)
    guarded = compare(run(llm, tokens, 0, fail=True), run(llm, tokens, 0, fail=False))
    from kvtier.integrations.vllm.validity import BlockValidity

    BlockValidity.clean = lambda self, specs: specs  # the negative control: the guard removed
    unguarded = compare(run(llm, tokens, 4 * BLOCK, fail=True), run(llm, tokens, 4 * BLOCK, fail=False))
    return {"guarded": guarded, "unguarded": unguarded}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
