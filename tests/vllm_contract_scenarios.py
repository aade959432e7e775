"""vLLM 0.32 contract scenarios on the real CPU engine (SmolLM2-135M-Instruct), for tests/test_vllm_contract.py.

Each runs in its own process (vLLM binds threads and installs signal handlers) with vLLM's
in-process engine core, and prints one JSON line prefixed with ``RESULT ``.

    python tests/vllm_contract_scenarios.py SCENARIO WORK_DIR [ARG]
"""

from __future__ import annotations

import gc
import json
import os
import sys

from kvtier.integrations.vllm_engine import engine_env  # noqa: E402  (no vLLM import)

os.environ.update(engine_env(os.environ, in_process=True))

BLOCK = 32  # vLLM block = kvtier chunk (vLLM CPU attention: multiples of 32): a 64-token prompt hits 32
MAX_TOKENS = 8


def _tokens(n: int) -> list[int]:
    from transformers import AutoTokenizer

    from kvtier.demo.model import prepare_model

    tok = AutoTokenizer.from_pretrained(str(prepare_model().path))
    ids = tok(open("/usr/share/common-licenses/Apache-2.0").read())["input_ids"]
    return ids[:n]


def _kv_config(extra: dict, policy: str | None, multi: bool) -> dict:
    from kvtier.integrations.vllm_engine import kv_transfer_config

    kvtier = kv_transfer_config(extra)
    kvtier.pop("kv_load_failure_policy")
    if not multi:
        return {**kvtier, **({"kv_load_failure_policy": policy} if policy else {})}
    out = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"connectors": [kvtier]}}
    return {**out, **({"kv_load_failure_policy": policy} if policy else {})}


def _llm(model: str, kv: dict, **kw):
    from vllm import LLM

    args = dict(dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.5, seed=0, max_model_len=512,
                num_gpu_blocks_override=64, block_size=BLOCK, kv_transfer_config=kv)
    args.update(kw)
    return LLM(model=model, **args)


def _generate(llm, tokens: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm import flush_all, request_hits

    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                       use_tqdm=False)[0]
    flush_all()
    c = out.outputs[0]
    return {"tokens": list(c.token_ids), "finish_reason": c.finish_reason, "hits": request_hits(out.request_id)}


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _model() -> str:
    from kvtier.demo.model import prepare_model

    return str(prepare_model().path)


def scenario_reset(work: str, _arg: str | None) -> dict:
    """Cold, an engine-only reset (kvtier hits 48 of 64), then reset_prefix_cache(reset_connector=True)."""
    tokens = _tokens(64)
    llm = _llm(_model(), _kv_config({"chunk_size": BLOCK, "cpu_capacity": "64MiB",
                                     "disk_path": os.path.join(work, "disk")}, "recompute", False))
    cold = _generate(llm, tokens)
    llm.reset_prefix_cache()
    warm = _generate(llm, tokens)
    ok = llm.reset_prefix_cache(reset_connector=True)
    after = _generate(llm, tokens)
    return {"cold": cold, "warm": warm, "reset_ok": ok, "after": after}


def scenario_policy(work: str, arg: str | None) -> dict:
    """Each kv_load_failure_policy, kvtier alone and inside MultiConnector: a load that fails."""
    from kvtier.storage import registry

    tokens = _tokens(64)
    out = {}
    for multi in (False, True):
        for policy in ("recompute", "fail"):
            kv = _kv_config({"chunk_size": BLOCK, "cpu_capacity": "64MiB", "model_id": f"policy-{policy}-{multi}"},
                            policy, multi)
            llm = _llm(_model(), kv, async_scheduling=False)
            sched = _scheduler(llm)
            cold = _generate(llm, tokens)
            llm.reset_prefix_cache()
            (manager,) = registry.active_managers()
            manager.open_read_many = lambda items: [None] * len(items)  # every load fails (a store read error)
            failed = _generate(llm, tokens)
            out[f"{'multi' if multi else 'alone'}-{policy}"] = {
                "cold": cold, "failed": failed, "recompute": sched.recompute_kv_load_failures,
                "requires_kv_delivery": sched.requires_kv_delivery,
                "policy_seen_by_kvtier": _kvtier_config(sched).kv_load_failure_policy,
            }
            del llm, sched, manager
            gc.collect()
    return out


def _kvtier_config(sched):
    conn = sched.connector
    for c in getattr(conn, "_connectors", [conn]):
        if type(c).__name__ == "KVTierConnector":
            return c._kv_transfer_config
    raise AssertionError("no kvtier connector")


def make_hybrid_model(path: str, window: int = 64, seed: int = 0) -> str:
    """A tiny random Llama (4 layers: sliding-window, full, sliding-window, full attention, via the
    config's ``layer_types``, which vLLM's Llama reads) with SmolLM2's tokenizer, in bf16 safetensors."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = _model()
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = json.load(open(os.path.join(src, "config.json")))
    cfg = LlamaConfig(vocab_size=tok["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tok.get("bos_token_id"),
                      eos_token_id=tok.get("eos_token_id"), sliding_window=window,
                      layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # larger weights than the 0.02 init: tokens that depend on the context
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path


def _corrupt(manager, layers: list[int], chunks: list[bytes]) -> int:
    """Scribble over the given layers of the given stored CPU chunks (finite, wrong KV)."""
    n = 0
    for key in chunks:
        buf = manager.cpu.acquire(key)
        if buf is None:
            continue
        view = buf.reshape(manager.namespace.layout.num_layers, -1)
        for layer in layers:
            view[layer, 1::2] = 0x3F
        manager.cpu.release(key)
        n += 1
    return n


def scenario_hybrid(work: str, _arg: str | None) -> dict:
    """A hybrid model (sliding window 64 + full attention) under vLLM's hybrid KV cache manager:
    cold, vLLM's own prefix hit, kvtier's hit (engine cache reset), then corrupted groups."""
    from kvtier.integrations.vllm import flush_all
    from kvtier.storage import registry

    model = make_hybrid_model(os.path.join(work, "tiny-hybrid"))
    tokens = _tokens(320)
    llm = _llm(model, _kv_config({"chunk_size": BLOCK, "cpu_capacity": "64MiB"}, "recompute", False),
               num_gpu_blocks_override=128)
    sched = _scheduler(llm)
    groups = [(type(g.kv_cache_spec).__name__, list(g.layer_names)) for g in sched.kv_cache_config.kv_cache_groups]
    cold = _generate(llm, tokens)
    engine_hit = _generate(llm, tokens)  # vLLM's own hybrid prefix cache, same split
    llm.reset_prefix_cache()
    warm = _generate(llm, tokens)
    (manager,) = registry.active_managers()
    keys = manager.keys(tokens)[: (len(tokens) - 1) // BLOCK]
    layer_of = {name: i for i, name in enumerate(sorted({n for _, names in groups for n in names},
                                                        key=lambda n: int(n.split(".")[2])))}
    by_kind = {kind: [layer_of[n] for n in names] for kind, names in groups}
    out = {"groups": groups, "cold": cold, "engine_hit": engine_hit, "warm": warm,
           "hybrid_manager_on": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager}
    flush_all()
    # negative controls: wrong KV in one group's layers must change the answer
    for kind in by_kind:
        snapshot = {k: manager.cpu.acquire(k).copy() for k in keys}
        for k in keys:
            manager.cpu.release(k)
        last = keys[-2:] if kind == "SlidingWindowSpec" else keys[:2]  # in the window / early context
        out[f"corrupted_{kind}"] = _corrupt(manager, by_kind[kind], last)
        llm.reset_prefix_cache()
        out[f"bad_{kind}"] = _generate(llm, tokens)
        for k, v in snapshot.items():  # restore for the next control
            buf = manager.cpu.acquire(k)
            buf[:] = v
            manager.cpu.release(k)
    llm.reset_prefix_cache()
    out["again"] = _generate(llm, tokens)
    # a failed load with two KV cache groups: reported as the request (failed_recving), recomputed
    manager.open_read_many = lambda items: [None] * len(items)
    llm.reset_prefix_cache()
    out["failed"] = _generate(llm, tokens)
    return out


SCENARIOS = {"reset": scenario_reset, "policy": scenario_policy, "hybrid": scenario_hybrid}

if __name__ == "__main__":
    name, work = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](work, sys.argv[3] if len(sys.argv) > 3 else None)
    print("RESULT " + json.dumps(result), flush=True)
