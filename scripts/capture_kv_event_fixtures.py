"""Capture golden KV event payloads from the installed vLLM (tests/fixtures/kv_events/).

The ``vllm_*.msgpack`` files are encoded by vLLM's own classes
(``vllm.distributed.kv_events``) and encoder, so the tests pin kvtier's decoder (and its
byte-identical encoder) to what vLLM really puts on the wire. The ``legacy_*.msgpack`` files
are the other encodings publishers have used, built from plain msgpack:

* ``legacy_map_batch``: the batch as a map ``{"ts", "events", "data_parallel_rank"}``, each
  event a map tagged ``{"type": "BlockStored", ...fields}``;
* ``legacy_array_events``: events as tagged arrays (vLLM releases whose events were
  ``array_like``): ``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
  medium]``, one of them from before ``medium`` existed, one with an extra trailing field.

``manifest.json`` records the vLLM version and each file's description.

Usage: ``python scripts/capture_kv_event_fixtures.py [OUT_DIR]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import msgspec

TS = 1767225600.25  # fixed: fixtures are byte-stable
H = [bytes([i]) * 32 for i in range(1, 6)]  # 32-byte block hashes (kvtier chunk-key sized)


def vllm_batches() -> dict[str, tuple[object, str]]:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    stored = BlockStored(block_hashes=[H[0], H[1]], parent_block_hash=None,
                         token_ids=list(range(8)), block_size=4, lora_id=None, medium="CPU",
                         lora_name=None)
    stored_child = BlockStored(block_hashes=[H[2]], parent_block_hash=H[1],
                               token_ids=[8, 9, 10, 11], block_size=4, lora_id=None,
                               medium="CPU", lora_name=None)
    return {
        "vllm_stored_cpu": (KVEventBatch(ts=TS, events=[stored, stored_child],
                                         data_parallel_rank=0),
                            "two BlockStored (bytes hashes, parent, token ids, medium CPU)"),
        "vllm_removed": (KVEventBatch(ts=TS, events=[
            BlockRemoved(block_hashes=[H[2]], medium="CPU"),
            BlockRemoved(block_hashes=[123456789, 2**64 - 1], medium="GPU")]),
            "BlockRemoved with bytes hashes (CPU) and int hashes (GPU), no dp rank"),
        "vllm_cleared": (KVEventBatch(ts=TS, events=[AllBlocksCleared()], data_parallel_rank=1),
                         "AllBlocksCleared, dp rank 1"),
        "vllm_lora_extra": (KVEventBatch(ts=TS, events=[BlockStored(
            block_hashes=[H[3], H[4]], parent_block_hash=H[0], token_ids=list(range(100, 108)),
            block_size=4, lora_id=7, medium="STORAGE", lora_name="adapter-a",
            extra_keys=[("adapter-a", "salt"), None], group_idx=0,
            kv_cache_spec_kind="full_attention", locality="LOCAL", session_id="s-1")]),
            "BlockStored with lora_name, extra_keys and cache-group metadata, medium STORAGE"),
    }


def legacy_payloads() -> dict[str, tuple[bytes, str]]:
    map_batch = {
        "ts": TS,
        "events": [
            {"type": "BlockStored", "block_hashes": [H[0]], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [H[0]], "medium": "GPU",
             "some_future_field": 42},
            {"type": "AllBlocksCleared"},
        ],
        "data_parallel_rank": 2,
    }
    array_events = [
        TS,
        [
            ["BlockStored", [H[0], H[1]], None, list(range(8)), 4, None, "CPU"],
            ["BlockStored", [11, 12], 10, [5, 6, 7, 8, 9, 10], 3, None],  # before `medium`
            ["BlockRemoved", [H[1]], "STORAGE"],
            ["BlockRemoved", [H[0]], "CPU", None, None, None, "a-future-field"],
            ["AllBlocksCleared"],
        ],
    ]
    return {
        "legacy_map_batch": (msgpack.packb(map_batch, use_bin_type=True),
                             "batch and events as maps; an unknown event field"),
        "legacy_array_events": (msgpack.packb(array_events, use_bin_type=True),
                                "events as tagged arrays (older vLLM), short and long rows"),
    }


def main(out_dir: str = "tests/fixtures/kv_events") -> None:
    import vllm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, object] = {"vllm_version": vllm.__version__, "files": {}}
    files: dict[str, str] = {}
    for name, (batch, desc) in vllm_batches().items():
        (out / f"{name}.msgpack").write_bytes(msgspec.msgpack.encode(batch))
        files[f"{name}.msgpack"] = desc
    for name, (payload, desc) in legacy_payloads().items():
        (out / f"{name}.msgpack").write_bytes(payload)
        files[f"{name}.msgpack"] = desc
    manifest["files"] = files
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(files)} fixtures to {out}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
