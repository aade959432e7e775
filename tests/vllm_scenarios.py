"""End-to-end scenarios on the real model (SmolLM2-135M-Instruct) in vLLM.

Each scenario runs in its own process (vLLM binds threads and installs signal
handlers, so it stays out of the pytest process) and prints one JSON line
prefixed with ``RESULT ``. Used by tests/test_vllm_e2e.py.

    python tests/vllm_scenarios.py SCENARIO DISK_DIR [EXPECTED_JSON]
"""

from __future__ import annotations

import json
import os
import sys

from kvtier.integrations.vllm_engine import engine_env  # noqa: E402  (no vLLM import)

os.environ.update(engine_env(os.environ, in_process=False))

QUESTION = "\n\nQuestion: Under this license, what must you give recipients when you redistribute the Work?\nAnswer:"
MAX_TOKENS = 24
#: The license text is cut to its first DOC_TOKENS tokens (prompt ~1,030 tokens: 4 full 256-token
#: chunks, 8 of 128): every scenario's hits and splits as with the whole text, at ~40% of its
#: prefill work (float32 on an AVX2-only CPU; the LoRA scenario alone runs 5 prefills).
DOC_TOKENS = 1000


def _prompt() -> list[int]:
    from kvtier.demo.model import prepare_model

    from transformers import AutoTokenizer

    path = prepare_model().path
    tok = AutoTokenizer.from_pretrained(str(path))
    text = open("/usr/share/common-licenses/Apache-2.0").read()
    if not text:
        raise SystemExit("missing document")
    return tok(tok.decode(tok(text)["input_ids"][:DOC_TOKENS]) + QUESTION)["input_ids"]


def _llm(disk_dir: str, extra: dict | None = None):
    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm_engine import build_llm

    cfg = {"disk_path": disk_dir, "cpu_capacity": "256MiB", **(extra or {})}
    return build_llm(str(prepare_model().path), cfg, max_model_len=4096, num_gpu_blocks_override=40)


def _generate(llm, tokens: list[int]) -> tuple[list[int], int, str]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        use_tqdm=False,
    )[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), out.request_id


def _hits(request_id: str) -> dict | None:
    from kvtier.integrations.vllm import request_hits

    return request_hits(request_id)


def scenario_inprocess(disk_dir: str) -> dict:
    """Cold run, then (engine prefix cache reset) a kvtier hit, then a hit on corrupted KV."""
    from kvtier.integrations.vllm import flush_all, stats_all
    from kvtier.storage import registry

    tokens = _prompt()
    llm = _llm(disk_dir)
    cold, cold_cached, rid = _generate(llm, tokens)
    cold_hits = _hits(rid)
    flush_all()
    llm.reset_prefix_cache()
    warm, warm_cached, rid = _generate(llm, tokens)
    warm_hits = _hits(rid)
    # Negative control: scribble over every stored chunk in the CPU tier, keep the
    # disk copies out of reach, and load again. The answer must change.
    (manager,) = registry.active_managers()
    for key in list(manager.cpu._entries):
        buf = manager.cpu.acquire(key)
        if buf is not None:
            buf[::2] = 0x3F  # bf16 ~0.75 in every high byte: wrong, finite KV
            manager.cpu.release(key)
    llm.reset_prefix_cache()
    bad, _, rid = _generate(llm, tokens)
    bad_hits = _hits(rid)
    return {
        "prompt_tokens": len(tokens),
        "cold": cold,
        "cold_hits": cold_hits,
        "warm": warm,
        "warm_hits": warm_hits,
        "warm_cached": warm_cached,
        "bad": bad,
        "bad_hits": bad_hits,
        "stats": stats_all()[0],
    }


def scenario_restart(disk_dir: str) -> dict:
    """A fresh engine process on the same disk tier: hits come from disk."""
    tokens = _prompt()
    llm = _llm(disk_dir)
    out, cached, rid = _generate(llm, tokens)
    return {"tokens": out, "hits": _hits(rid), "cached": cached}


def scenario_multiprocess(disk_dir: str) -> dict:
    """vLLM's default multi-process engine core: cold, reset engine cache, hit."""
    tokens = _prompt()
    llm = _llm(disk_dir)
    cold, _, _ = _generate(llm, tokens)
    llm.reset_prefix_cache()
    warm, warm_cached, _ = _generate(llm, tokens)
    return {"cold": cold, "warm": warm, "warm_cached": warm_cached, "prompt_tokens": len(tokens)}


def _write_adapter(model_path: str, path: str, seed: int) -> str:
    """A tiny random LoRA adapter (rank 8, q_proj and v_proj of every layer), PEFT file layout."""
    import torch
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(model_path, "config.json")))
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = hidden // cfg["num_attention_heads"]
    outs = {"q_proj": hidden, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for mod, out in outs.items():
            base = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{base}.lora_A.weight"] = (torch.randn(8, hidden, generator=gen) * 0.02).to(torch.bfloat16)
            tensors[f"{base}.lora_B.weight"] = (torch.randn(out, 8, generator=gen) * 0.02).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": model_path}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def scenario_lora(disk_dir: str) -> dict:
    """Adapter A cold (stores), A again on vLLM's own prefix cache (the reference), then B, the base
    model and A again on kvtier's hit, the engine's prefix cache reset before each of those.

    The kvtier chunk equals vLLM's block size (128) so a kvtier hit splits the prefill exactly where
    an engine hit does. (On vLLM's CPU backend a cold LoRA prefill gives other tokens than any
    prefix hit under the same adapter, vLLM's own included: the reference is vLLM's own hit.)
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm import flush_all
    from kvtier.integrations.vllm_engine import build_llm

    model = str(prepare_model().path)
    tokens = _prompt()
    a = LoRARequest("adapter-a", 1, _write_adapter(model, os.path.join(disk_dir, "..", "lora-a"), 1))
    b = LoRARequest("adapter-b", 2, _write_adapter(model, os.path.join(disk_dir, "..", "lora-b"), 2))
    llm = build_llm(model, {"disk_path": disk_dir, "cpu_capacity": "256MiB", "chunk_size": 128}, max_model_len=4096,
                    num_gpu_blocks_override=40, enable_lora=True, max_lora_rank=8, max_loras=2, block_size=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

    def run(lora, reset: bool = True) -> tuple[list[int], dict | None, int]:
        if reset:
            llm.reset_prefix_cache()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, lora_request=lora, use_tqdm=False)[0]
        flush_all()
        return list(out.outputs[0].token_ids), _hits(out.request_id), int(out.num_cached_tokens or 0)

    _, a_cold_hits, _ = run(a)
    a_ref, _, a_ref_cached = run(a, reset=False)  # vLLM's own prefix-cache hit under A
    _, b_hits, _ = run(b)
    _, base_hits, _ = run(None)
    a_again, a_again_hits, _ = run(a)
    return {"prompt_tokens": len(tokens), "a_cold_hits": a_cold_hits, "a_ref": a_ref, "a_ref_cached": a_ref_cached,
            "b_hits": b_hits, "base_hits": base_hits, "a_again": a_again, "a_again_hits": a_again_hits}


SCENARIOS = {
    "inprocess": scenario_inprocess,
    "restart": scenario_restart,
    "multiprocess": scenario_multiprocess,
    "lora": scenario_lora,
}

if __name__ == "__main__":
    name, disk = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](disk)
    print("RESULT " + json.dumps(result), flush=True)
