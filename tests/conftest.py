"""Shared fixtures for kvtier's unit tests.

Everything here is deliberately tiny: a layout of 2 layers x 1 KV head x 8 dims
in float16 is 64 bytes per token, so a 32-token chunk is 2 KiB and a disk file
4 KiB + 2 KiB. Tests therefore move kilobytes, never megabytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature

#: Tokens per chunk in the small namespace (two 16-token engine blocks).
CHUNK = 32


def small_layout(**changes: object) -> LayoutSignature:
    """A 64-bytes-per-token layout; keyword arguments replace single fields."""
    fields: dict[str, object] = dict(
        engine="test",
        attn_backend="TEST_ATTN",
        kv_layout="LBHNC",
        block_size=16,
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        dtype="float16",
    )
    fields.update(changes)
    return LayoutSignature(**fields)  # type: ignore[arg-type]


def small_namespace(**changes: object) -> KeyNamespace:
    """A 32-token-chunk namespace (2,048-byte chunks); keyword arguments replace fields."""
    fields: dict[str, object] = dict(model="test/tiny-model", layout=small_layout(), chunk_size=CHUNK)
    fields.update(changes)
    return KeyNamespace(**fields)  # type: ignore[arg-type]


def payload_for(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic uint8 payload of ``nbytes`` derived from ``key`` (distinct per key)."""
    reps = -(-nbytes // len(key))
    data = np.frombuffer(key * reps, dtype=np.uint8)[:nbytes].copy()
    data[: min(8, nbytes)] ^= np.arange(min(8, nbytes), dtype=np.uint8)
    return data


@pytest.fixture
def namespace() -> KeyNamespace:
    return small_namespace()


@pytest.fixture
def hasher(namespace: KeyNamespace) -> ChunkHasher:
    return ChunkHasher(namespace)


@pytest.fixture
def chunk_bytes(namespace: KeyNamespace) -> int:
    assert namespace.chunk_bytes == 2048
    return namespace.chunk_bytes


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """An empty directory for one disk tier."""
    d = tmp_path / "disk"
    d.mkdir()
    return d


@pytest.fixture
def make_key() -> Callable[[int], bytes]:
    """Distinct 32-byte keys by integer (for tier tests that need no real prompt)."""

    def make(i: int) -> bytes:
        return i.to_bytes(4, "little") * 8

    return make


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., KVTierConfig]:
    """KVTierConfig for the small namespace: ``cpu_chunks``/``disk_chunks`` size the tiers in chunks.

    ``disk_chunks=0`` leaves the disk tier off. Other keyword arguments pass through.
    """

    def make(cpu_chunks: int = 8, disk_chunks: int = 0, **kw: object) -> KVTierConfig:
        chunk_bytes = small_namespace().chunk_bytes
        fields: dict[str, object] = dict(chunk_size=CHUNK, cpu_capacity=cpu_chunks * chunk_bytes)
        if disk_chunks:
            from kvtier.tiers.disk import HEADER_BYTES

            fields.update(
                disk_path=tmp_path / "mgr-disk",
                disk_capacity=disk_chunks * (HEADER_BYTES + chunk_bytes),
            )
        fields.update(kw)
        return KVTierConfig(**fields)  # type: ignore[arg-type]

    return make


@pytest.fixture
def fleet(tmp_path: Path):
    """Fleet keys of members ``a``, ``b``, ``c`` and their members file (kvtier.testing.fleet_keys):
    ``fleet.config("a")`` is member a's ``fleet_key``/``fleet_members`` settings."""
    from kvtier.testing.fleet_keys import make_fleet

    return make_fleet(tmp_path / "fleet-keys", ["a", "b", "c"])
