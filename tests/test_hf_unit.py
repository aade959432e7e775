"""kvtier's transformers integration on a tiny random Llama (CPU, float32 and bfloat16; seconds).

The real-model acceptance tests (SmolLM2, identical greedy tokens, hit after a restart)
are in tests/test_hf_e2e.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.index.keys import ChunkHasher  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    KVTierHF,
    UnsupportedModel,
    cold_generate_split,
    hf_namespace,
)
from kvtier.storage.manager import StorageManager  # noqa: E402

CHUNK = 32
GEN: dict[str, Any] = dict(max_new_tokens=6, do_sample=False)


def tiny(dtype: torch.dtype = torch.float32, **cfg: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=0, **cfg)
    return LlamaForCausalLM(config).to(dtype).eval()


def config(**kw: Any) -> KVTierConfig:
    return KVTierConfig(chunk_size=CHUNK, cpu_capacity="16MiB", **kw)


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - r.shape[1]:] = r[0]
        mask[i, T - r.shape[1]:] = 1
    return ids, mask


def test_namespace_is_not_vllms() -> None:
    m = tiny()
    ns = hf_namespace(m, CHUNK, model_id="tiny")
    assert ns.layout.engine == "hf-transformers" and ns.layout.kv_layout == "L2HTD"
    assert ns.chunk_bytes == CHUNK * 2 * 2 * 2 * 16 * 4  # tokens * (K,V) * layers * heads * dim * fp32
    vllm_like = ns.__class__(model="tiny", layout=ns.layout.__class__(**{**ns.layout.__dict__, "engine": "vllm"}),
                             chunk_size=CHUNK)
    toks = list(range(CHUNK))
    assert ChunkHasher(ns).keys(toks) != ChunkHasher(vllm_like).keys(toks)
    assert hf_namespace(tiny(torch.bfloat16), CHUNK, "tiny") != ns  # dtype is part of the layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hit_equals_cold_at_same_split(dtype: torch.dtype) -> None:
    m = tiny(dtype)
    ids = prompt(100)
    with KVTierHF(m, config(), model_id="tiny") as kv, torch.no_grad():
        cold = m.generate(ids, **GEN)
        first = kv.generate(ids, **GEN)
        assert kv.last_hit_tokens == [0] and torch.equal(first, cold)
        assert kv.store.stats()["stored_chunks"] == 3  # 100 tokens: 3 full chunks stored
        second = kv.generate(ids, **GEN)
        assert kv.last_hit_tokens == [96]
        assert torch.equal(second, cold_generate_split(m, ids, None, 96, **GEN))
        if dtype == torch.float32:
            assert torch.equal(second, cold)
        # The loaded KV is the model's KV of those positions (a tiny random model's greedy tokens
        # barely depend on it, so check the tensors themselves).
        got = kv.load_prefix(ids)
        ref = DynamicCache(config=m.config)
        m(ids[:, :96], past_key_values=ref, use_cache=True)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for mine, theirs in zip(got.cache.layers, ref.layers):
            assert mine.keys.shape == theirs.keys.shape == (1, 2, 96, 16)
            assert torch.allclose(mine.keys, theirs.keys, atol=tol) and torch.allclose(mine.values, theirs.values, atol=tol)


def test_batched_left_padding_with_different_hits() -> None:
    m = tiny()
    a, b = prompt(100, seed=1), prompt(75, seed=2)
    ids, mask = left_pad([a, b])
    with KVTierHF(m, config(), model_id="tiny") as kv, torch.no_grad():
        kv.generate(a, **GEN)  # stores a's 3 chunks only
        out = kv.generate(ids, attention_mask=mask, **GEN)
        # Row b (25 pads) hit nothing, so the shared cached length is 25: row a uses 25 of its 96 tokens.
        assert kv.last_hit_tokens == [25, 0]
        assert torch.equal(out, cold_generate_split(m, ids, mask, 25, **GEN))
        out2 = kv.generate(ids, attention_mask=mask, **GEN)  # b's 2 chunks are stored now
        assert kv.last_hit_tokens == [89, 64]
        assert torch.equal(out2, cold_generate_split(m, ids, mask, 89, **GEN))
        assert torch.equal(out2, m.generate(ids, attention_mask=mask, **GEN))  # fp32: equal to unsplit too
        got = kv.load_prefix(ids, mask)  # row b's cached tokens sit after its 25 pads; the pads hold zeros
        ref = DynamicCache(config=m.config)
        m(b[:, :64], past_key_values=ref, use_cache=True)
        assert not got.cache.layers[0].keys[1, :, :25].any()
        assert torch.allclose(got.cache.layers[1].keys[1, :, 25:89], ref.layers[1].keys[0], atol=1e-5)


def test_prompt_shorter_than_a_chunk_and_prefill_cache() -> None:
    m = tiny()
    short = prompt(CHUNK - 5)
    with KVTierHF(m, config(), model_id="tiny") as kv, torch.no_grad():
        assert torch.equal(kv.generate(short, **GEN), m.generate(short, **GEN))
        assert kv.last_hit_tokens == [0] and kv.store.stats()["stored_chunks"] == 0
        ids = prompt(70)
        cache, hit = kv.prefill_cache(ids)
        assert hit == [0] and cache.get_seq_length() == 69
        assert kv.store.stats()["stored_chunks"] == 2  # chunks within the first 69 tokens
        assert torch.equal(m.generate(ids, past_key_values=cache, **GEN), m.generate(ids, **GEN))
        cache2, hit2 = kv.prefill_cache(ids)
        assert hit2 == [64] and cache2.get_seq_length() == 69
        for l1, l2 in zip(cache.layers, cache2.layers):
            # cache grew during generate; its first 69 positions are the prompt's
            assert torch.allclose(l1.keys[:, :, :69], l2.keys, atol=1e-5)
            assert torch.allclose(l1.values[:, :, :69], l2.values, atol=1e-5)


def test_bad_input_is_a_clear_error() -> None:
    m = tiny()
    ids = prompt(40)
    with KVTierHF(m, config(), model_id="tiny") as kv:
        right = torch.ones_like(ids)
        right[0, -3:] = 0
        with pytest.raises(ValueError, match="left padding"):
            kv.generate(ids, attention_mask=right, **GEN)
        with pytest.raises(ValueError, match="past_key_values"):
            kv.generate(ids, past_key_values=object(), **GEN)
        with pytest.raises(ValueError, match="batch, tokens"):
            kv.load_prefix(ids[0])


def test_unsupported_models_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedModel, match="sliding|full attention"):
        hf_namespace(tiny(layer_types=["full_attention", "sliding_attention"], sliding_window=16), CHUNK, "x")
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.40.0")
    with pytest.raises(UnsupportedModel, match="4.40.0 is not supported"):
        hf_namespace(tiny(), CHUNK, "x")


def test_given_store_must_match_namespace(tmp_path: Path) -> None:
    m = tiny()
    ns = hf_namespace(m, CHUNK, "tiny")
    mgr = StorageManager(config(), ns)
    try:
        KVTierHF(m, mgr, model_id="tiny")  # same namespace: fine
        with pytest.raises(ValueError, match="namespace"):
            KVTierHF(tiny(torch.bfloat16), mgr, model_id="tiny")
        with pytest.raises(TypeError):
            KVTierHF(m, object())  # type: ignore[arg-type]
    finally:
        mgr.close()


class _Broken:
    """A store whose every call fails (a dead tier/server): generation must go on, uncached."""

    def __init__(self, ns: Any):
        self.namespace, self.chunk_bytes = ns, ns.chunk_bytes

    def __getattr__(self, name: str) -> Any:
        def fail(*a: Any, **k: Any) -> Any:
            raise ConnectionError("store down")
        return fail


def test_failing_store_is_a_miss() -> None:
    m = tiny()
    kv = KVTierHF(m, _Broken(hf_namespace(m, CHUNK, "tiny")), model_id="tiny")  # type: ignore[arg-type]
    ids = prompt(80)
    with torch.no_grad():
        assert torch.equal(kv.generate(ids, **GEN), m.generate(ids, **GEN))
    assert kv.last_hit_tokens == [0]


def test_through_a_kvtier_server(tmp_path: Path) -> None:
    """The same integration against a shared ``kvtier server`` (in-process, Unix socket): a second
    engine object (another client) hits what the first stored."""
    import shutil
    import tempfile

    from kvtier.service.server import CacheServer, ServerOptions

    d = Path(tempfile.mkdtemp(prefix="kvhf-", dir="/tmp"))  # short socket path
    server = CacheServer(config(), ServerOptions(socket_path=str(d / "s.sock"))).start()
    try:
        m = tiny()
        ids = prompt(100)
        cfg = config(server=f"unix://{d / 's.sock'}", server_timeout_s=5.0)
        with torch.no_grad():
            cold = m.generate(ids, **GEN)
            with KVTierHF(m, cfg, model_id="tiny") as a:
                assert a.store.__class__.__name__ == "ServiceClient"
                assert torch.equal(a.generate(ids, **GEN), cold) and a.last_hit_tokens == [0]
                a.store.flush(10)
            with KVTierHF(m, cfg, model_id="tiny") as b:
                assert torch.equal(b.generate(ids, **GEN), cold) and b.last_hit_tokens == [96]
    finally:
        server.close()
        shutil.rmtree(d, ignore_errors=True)
