"""Re-encoding and checking stored chunks: the bodies of ``compress`` and ``verify``.

Arguments are already checked (:mod:`kvtier.storage.ops_args`) and the caller
holds the operations lock (:class:`kvtier.storage.instance_ops.InstanceOps`).
Every chunk is read into a scratch buffer (uint8 ``[chunk_bytes]``), never the
engine's. A failing tier is a miss.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from kvtier.serde.base import Codec
from kvtier.storage.lower_tiers import chunk_spec
from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import OpError, Tier
from kvtier.storage.ops_staging import flush, held, label, read_lower
from kvtier.tiers.base import ChunkWrite, LowerTier

log = logging.getLogger(__name__)

__all__ = ["max_abs_error", "recode", "stored_sizes", "verify_keys"]


def recode(m: StorageManager, keys: list[bytes], tier: LowerTier, codec: Codec) -> dict[str, Any]:
    """Rewrite the chunks ``keys`` of ``tier`` with ``codec`` and read them back; see
    :meth:`kvtier.storage.instance_ops.InstanceOps.compress` for the result.

    Raises:
        OpError: ``tier``'s format cannot hold ``codec`` (its NotImplementedError's message).
    """
    flush(m)
    present = [k for k, ok in zip(keys, held(m, tier, keys)) if ok]
    orig = [np.empty(m.chunk_bytes, dtype=np.uint8) for _ in present]
    got = read_lower(tier, present, orig)
    rows = [(k, b) for k, b, ok in zip(present, orig, got) if ok]
    parent_of = getattr(tier, "parent_of", None)
    writes = [ChunkWrite(k, parent_of(k) if callable(parent_of) else None, b) for k, b in rows]
    before = stored_sizes(m, tier, [k for k, _ in rows])
    try:
        ok_w = tier.put_many_with_codec(writes, codec) if writes else []
    except NotImplementedError as exc:
        raise OpError(f"codec: {exc}") from None
    done = [(k, b) for (k, b), ok in zip(rows, ok_w) if ok]
    back = [np.empty(m.chunk_bytes, dtype=np.uint8) for _ in done]
    got_back = read_lower(tier, [k for k, _ in done], back)
    dtype = chunk_spec(m.namespace).dtype
    err = 0.0
    exact = True
    n = 0
    for (k, b), nb, ok in zip(done, back, got_back):
        if not ok:
            exact = False
            continue
        n += 1
        if not np.array_equal(b, nb):
            exact = False
            err = max(err, max_abs_error(b, nb, dtype))
    after = stored_sizes(m, tier, [k for k, _ in done])
    rewritten = {k for k, _ in done}
    return {
        "chunks": n,
        "bytes_before": sum(size for (k, _), size in zip(rows, before) if k in rewritten),
        "bytes_after": sum(after),
        "max_abs_error": float(err),
        "lossless": bool(codec.lossless and exact),
    }


def stored_sizes(m: StorageManager, tier: LowerTier, keys: list[bytes]) -> list[int]:
    """Stored bytes of each of ``keys`` in ``tier`` (``chunk_bytes`` each where the tier
    cannot tell; 0 each if it fails)."""
    if not keys:
        return []
    try:
        return [int(x) for x in tier.stored_sizes(keys)]
    except NotImplementedError:
        return [m.chunk_bytes] * len(keys)
    except Exception:
        log.exception("kvtier ops: sizes of %s failed", tier.name)
        return [0] * len(keys)


def verify_keys(m: StorageManager, keys: list[bytes], targets: list[Tier]) -> dict[str, Any]:
    """Load and check every chunk of ``keys`` in each of ``targets``; see
    :meth:`kvtier.storage.instance_ops.InstanceOps.verify` for the result."""
    state = {k: "missing" for k in keys}
    per: dict[str, dict[str, int]] = {}
    for t in targets:
        has = held(m, t, keys)
        ok = [False] * len(keys)
        if t == "cpu":
            for i, k in enumerate(keys):
                if has[i]:
                    buf = m.cpu.acquire(k)
                    if buf is not None:
                        ok[i] = len(buf) == m.chunk_bytes
                        m.cpu.release(k)
        else:
            ask = [i for i, h in enumerate(has) if h]
            bufs = [np.empty(m.chunk_bytes, dtype=np.uint8) for _ in ask]
            for i, good in zip(ask, read_lower(t, [keys[i] for i in ask], bufs)):
                ok[i] = good
        counts = {"verified": 0, "missing": 0, "corrupt": 0}
        for i, k in enumerate(keys):
            v = "verified" if ok[i] else "corrupt" if has[i] else "missing"
            counts[v] += 1
            if v == "verified" or (v == "corrupt" and state[k] == "missing"):
                state[k] = v
        per[label(t)] = counts
    out: dict[str, Any] = {v: sum(1 for s in state.values() if s == v) for v in ("verified", "missing", "corrupt")}
    out["tiers"] = per
    return out


def _as_float(buf: np.ndarray, dtype: str) -> np.ndarray:
    """The elements of a payload as float64 (bfloat16 widened by a shift; byte dtypes as integers)."""
    if dtype == "bfloat16":
        return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "float16":
        return buf.view(np.float16).astype(np.float64)
    if dtype == "float32":
        return buf.view(np.float32).astype(np.float64)
    if dtype == "int8":
        return buf.view(np.int8).astype(np.float64)
    return buf.astype(np.float64)


def max_abs_error(a: np.ndarray, b: np.ndarray, dtype: str) -> float:
    """Largest element-wise ``|a - b|`` of two uint8 payloads read as ``dtype``, over the
    finite elements of ``a`` (0.0 if none; inf if a difference is not finite)."""
    x, y = _as_float(a, dtype), _as_float(b, dtype)
    keep = np.isfinite(x)
    if not keep.any():
        return 0.0
    d = np.abs(x[keep] - y[keep])
    return float(d.max()) if np.isfinite(d).all() else math.inf
