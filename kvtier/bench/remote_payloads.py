"""The chunks ``kvtier bench remote`` moves, for every remote tier it measures (Redis in
:mod:`kvtier.bench.remote`, Mooncake Store in :mod:`kvtier.bench.remote_mooncake`)."""

from __future__ import annotations

import numpy as np

#: Bytes of one 256-token SmolLM2-135M chunk (bf16 K and V).
CHUNK_BYTES = 5_898_240
EXISTS_KEYS = 32


def payloads(n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` chunk payloads of finite bf16 values (uint8 arrays)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal(CHUNK_BYTES // 2, dtype=np.float32)
        out.append((x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
    return out
