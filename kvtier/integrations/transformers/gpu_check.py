"""The transformers step of the GPU check: kvtier's ``KVTierHF`` on a SmolLM2-shaped model.

No weights travel to the accelerator machine, so the model is SmolLM2-135M's
architecture (``LlamaForCausalLM``: 30 layers, hidden 576, 9 query / 3 KV heads of 64,
vocabulary 49,152, tied embeddings; the values of its published ``config.json``)
initialised from that config with a fixed seed, and prompts are seeded random token
ids (no tokenizer). Checks, each reported in the JSON:

1. **identical**: a hit gives the same greedy tokens as a cold run whose prefill is
   split at the same position (:func:`~kvtier.integrations.transformers.cold_generate_split`;
   the stored chunks are computed by a prefill of the same ``[0, split)``, so the loaded KV
   bytes (``kv_bytes_equal``) and every step's logits (``logits_equal``) must be equal too:
   greedy tokens of a randomly initialised model can agree even over wrong KV);
2. **restart**: a second process (fresh CPU tier) hits the same prefix through the disk
   tier, with the same tokens;
3. **negative control**: one chunk stored with perturbed K/V (a valid record under the
   right key, so nothing but the output can tell) changes the output, i.e. the checks
   above can fail;
4. **TTFT**: an 8,192-token prefix (+ 64 question tokens), ``max_new_tokens=1``, cold
   ``model.generate`` vs ``KVTierHF.generate`` on a hit (CPU tier), medians (ms).

Run: ``python -m kvtier.integrations.transformers.gpu_check --device cuda --json OUT.json``
(``--small`` uses a 2-layer model and short prompts: the CPU smoke run of
``scripts/gpu-check.sh``). Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.config import KVTierConfig
from kvtier.integrations.transformers.engine import KVTierHF
from kvtier.integrations.transformers.reference import cold_generate_split

#: SmolLM2-135M-Instruct's architecture (its config.json); ``max_position_embeddings`` raised
#: from 8,192 so the 8k-token TTFT prefix plus its question fits.
SMOLLM2: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
#: The ``--small`` model (CPU smoke run): same family, 2 layers.
SMALL: dict[str, Any] = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
             rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
MODEL_ID = "smollm2-135m-shaped-seed0"
CHUNK = 256


def build_model(small: bool, device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """The seeded random model (initialised on the CPU, so every process gets the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**(SMALL if small else SMOLLM2))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    # transformers declares PreTrainedModel.to through functools.wraps(torch.nn.Module.to), which
    # its stubs turn into an unbound call (mypy: missing self).
    return LlamaForCausalLM(cfg).to(dtype=dtype).to(device).eval()  # type: ignore[call-arg]


def prompt(model: Any, ntokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, ntokens), generator=gen).to(model.device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _config(disk: Path | None, cpu: str) -> KVTierConfig:
    return KVTierConfig(chunk_size=CHUNK, cpu_capacity=cpu, disk_path=disk)


def _gen(model: Any) -> dict[str, Any]:
    return dict(max_new_tokens=16, do_sample=False, pad_token_id=0)


def check_identical(model: Any, ids: torch.Tensor, disk: Path) -> dict[str, Any]:
    """Checks 1 and 3, and the stored chunks the restart check reads (``disk``)."""
    T = ids.shape[1]
    split = (T - 1) // CHUNK * CHUNK
    gen = _gen(model)
    out: dict[str, Any] = {"prompt_tokens": T, "split": split}
    scores: dict[str, Any] = dict(output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = cold_generate_split(model, ids, None, split, **gen, **scores)
        reference = ref.sequences
        with KVTierHF(model, _config(disk, "256MiB"), model_id=MODEL_ID) as kv:
            kv.prefill_cache(ids[:, : split + 1])  # computes [0, split) in one pass and stores it
            got = kv.load_prefix(ids)
            cold_cache = _prefix_cache(model, ids, split)
            out["kv_bytes_equal"] = got.cached_len == split and all(
                torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                for a, b in zip(got.cache.layers, cold_cache.layers))
            hit = kv.generate(ids, **gen, **scores)
            out["hit_tokens"] = kv.last_hit_tokens[0]
            # Same KV bytes and the same computation of [split, T): the logits of every step are
            # bit-identical too (greedy tokens of a random model can agree even over wrong KV).
            out["logits_equal"] = all(torch.equal(a, b) for a, b in zip(hit.scores, ref.scores))
            out["identical"] = bool(torch.equal(hit.sequences, reference)) and out["hit_tokens"] == split
    out["reference"] = reference[0, T:].tolist()
    out["negative_control"] = negative_control(model, ids, split, reference)
    return out


def _prefix_cache(model: Any, ids: torch.Tensor, split: int) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :split], past_key_values=cache, use_cache=True)
    return cache


def negative_control(model: Any, ids: torch.Tensor, split: int, reference: torch.Tensor) -> dict[str, Any]:
    """One stored chunk with perturbed K/V (valid record, right key) must change the output."""
    gen = _gen(model)
    with torch.no_grad(), KVTierHF(model, _config(None, "256MiB"), model_id=MODEL_ID) as kv:
        cache = _prefix_cache(model, ids, split)
        j = (split // CHUNK) // 2 * CHUNK  # a chunk in the middle of the prefix
        g = torch.Generator(device=ids.device).manual_seed(7)
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                noise = torch.randn(t[:, :, j:j + CHUNK].shape, generator=g, device=t.device, dtype=torch.float32)
                t[:, :, j:j + CHUNK] = (noise * 4 * t.float().std()).to(t.dtype)
        stored = kv.store_prompt_chunks(cache, ids, [0], upto=split)
        hit = kv.generate(ids, **gen, output_scores=True, return_dict_in_generate=True)
        ref = cold_generate_split(model, ids, None, split, **gen, output_scores=True, return_dict_in_generate=True)
    tokens_differ = not torch.equal(hit.sequences, reference)
    score_diff = float((hit.scores[0].float() - ref.scores[0].float()).abs().max())
    return {"stored_chunks": stored, "hit_tokens": kv.last_hit_tokens[0], "tokens_differ": tokens_differ,
            "first_logits_max_abs_diff": score_diff, "changed": tokens_differ or score_diff > 0.05}


def check_restart(model: Any, ids: torch.Tensor, disk: Path, reference: list[int]) -> dict[str, Any]:
    """Check 2 (run in a fresh process): the disk tier alone serves the prefix; tokens equal."""
    T = ids.shape[1]
    with torch.no_grad(), KVTierHF(model, _config(disk, "256MiB"), model_id=MODEL_ID) as kv:
        cpu_before = kv.store.stats().get("cpu_chunks", 0)
        hit = kv.generate(ids, **_gen(model))
        hit_tokens = kv.last_hit_tokens[0]
        promoted = kv.store.stats().get("promoted_chunks", 0)
    split = (T - 1) // CHUNK * CHUNK
    return {"cpu_chunks_at_start": cpu_before, "hit_tokens": hit_tokens, "promoted_chunks": promoted,
            "identical": hit[0, T:].tolist() == reference and hit_tokens == split and cpu_before == 0}


def check_ttft(model: Any, prefix: int, rounds: int) -> dict[str, Any]:
    """Check 4: TTFT (ms) of a ``prefix`` + 64-token prompt, cold vs a CPU-tier hit."""
    device = str(model.device)
    ids = prompt(model, prefix + 64, seed=11)
    one: dict[str, Any] = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)

    def timed(fn: Any) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return (time.perf_counter() - t0) * 1e3

    cold, hit, load = [], [], []
    with torch.no_grad():
        model.generate(prompt(model, prefix + 64, seed=12), **one)  # warm the kernels up
        for _ in range(rounds):
            cold.append(timed(lambda: model.generate(ids, **one)))
        need = (prefix + 64) * model.config.num_hidden_layers * 2 * 2 * model.config.num_key_value_heads * (
            model.config.hidden_size // model.config.num_attention_heads)
        with KVTierHF(model, _config(None, f"{max(64, 2 * need >> 20)}MiB"), model_id=MODEL_ID) as kv:
            kv.generate(ids, **one)  # stores the prefix
            for _ in range(rounds):
                hit.append(timed(lambda: kv.generate(ids, **one)))
                load.append(timed(lambda: kv.load_prefix(ids)))
            hit_tokens = kv.last_hit_tokens[0]
    c, h = statistics.median(cold), statistics.median(hit)
    return {"prompt_tokens": ids.shape[1], "hit_tokens": hit_tokens, "cold_ms": round(c, 2), "hit_ms": round(h, 2),
            "load_prefix_ms": round(statistics.median(load), 2), "speedup": round(c / h, 2),
            "cold_ms_all": [round(x, 2) for x in cold], "hit_ms_all": [round(x, 2) for x in hit]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="2-layer model, short prompts (CPU smoke run)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="tokens of the identity-check prompt")
    ap.add_argument("--ttft-prefix", type=int, default=None, help="prefix tokens of the TTFT check (default 8192)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--restart-phase", type=Path, default=None, help=argparse.SUPPRESS)  # internal: the second process
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    ntok = args.prompt_tokens or (700 if args.small else 2000)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model(args.small, args.device, dtype)
    ids = prompt(model, ntok, seed=3)
    if args.restart_phase is not None:  # the child: read the disk folder and the reference, answer on stdout
        state = json.loads((args.restart_phase / "state.json").read_text())
        print(json.dumps(check_restart(model, ids, args.restart_phase / "disk", state["reference"])))
        return 0
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                              "layers": model.config.num_hidden_layers, "small": args.small}
    with tempfile.TemporaryDirectory(prefix="kvtier-hf-gpu-") as tmp:
        work = Path(tmp)
        result["identical"] = check_identical(model, ids, work / "disk")
        (work / "state.json").write_text(json.dumps({"reference": result["identical"]["reference"]}))
        cmd = [sys.executable, "-m", "kvtier.integrations.transformers.gpu_check", "--device", args.device,
               "--prompt-tokens", str(ntok), "--restart-phase", str(work)] + (["--small"] if args.small else [])
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        child = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        try:
            result["restart"] = json.loads(child.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            result["restart"] = {"identical": False, "error": (child.stderr or child.stdout)[-2000:]}
    result["ttft"] = check_ttft(model, args.ttft_prefix or (1024 if args.small else 8192), args.rounds)
    ident = result["identical"]
    result["pass"] = bool(ident["identical"] and ident["kv_bytes_equal"] and ident["logits_equal"]
                          and result["restart"].get("identical")
                          and ident["negative_control"]["changed"] and result["ttft"]["hit_tokens"] > 0)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    t = result["ttft"]
    print(f"transformers on {result['device']}: identical={ident['identical']} kv_bytes_equal={ident['kv_bytes_equal']} logits_equal={ident['logits_equal']} "
          f"restart={result['restart'].get('identical')} negative_control_changed={ident['negative_control']['changed']} "
          f"ttft cold {t['cold_ms']} ms / hit {t['hit_ms']} ms ({t['speedup']}x, {t['hit_tokens']} of "
          f"{t['prompt_tokens']} tokens from kvtier) -> {'PASS' if result['pass'] else 'FAIL'}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
