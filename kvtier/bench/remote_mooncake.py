"""``kvtier bench remote --url mooncake://...``: the Mooncake tier against raw zero-copy client calls.

Measured in one run on the master at ``--url``, repetitions interleaved (ABBA),
summarised by medians (the JSON carries every sample and the spread):

- **put**: kvtier ``put_many`` of N chunks (record header + checksum, remove-then-put
  so the newest bytes win, ``batch_put_from_multi_buffers`` from the slots) vs
  ``MooncakeDistributedStore.batch_put_from`` of the same N payloads from the same kind
  of registered buffer (its keys are removed before each round, untimed: a put on an
  existing key returns at once without moving a byte);
- **get**: kvtier ``get_many_into`` into registered chunk buffers (replica query,
  ``batch_get_into_multi_buffers``, record and body checksum verified) vs
  ``batch_get_into`` of the same N values into registered buffers (nothing verified);
- **existence of 32 chunks**: kvtier ``contains_many`` vs ``batch_is_exist``.

Where the bytes live: both clients mount no memory; the run starts a
``mooncake_client`` (:class:`kvtier.testing.mooncake_master.SegmentOwnerProcess`) that
holds the pool segment, so every transfer of both sides crosses loopback TCP to
another process, as in a pool of several machines. Chunks are 5,898,240 bytes (one
256-token SmolLM2-135M chunk).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import BenchUsageError, Check, gbps, interleaved, median, print_checks, write_json
from kvtier.bench.remote_payloads import CHUNK_BYTES, EXISTS_KEYS, payloads as _payloads

#: Pool memory the bench's segment owner mounts (both sides' chunks fit with room to spare).
OWNER_SEGMENT_BYTES = 1 << 30
PREFLIGHT_TIMEOUT_S = 5.0
SETTLE_TIMEOUT_S = 60.0


def preflight(url: str) -> None:
    """Check ``--url``: a ``mooncake://HOST:PORT`` kvtier accepts, Mooncake installed, a master there.

    Raises:
        BenchUsageError: one line naming ``--url`` and the reason.
    """
    from kvtier.testing.mooncake_master import mooncake_missing
    from kvtier.tiers.mooncake_calls import probe_master
    from kvtier.tiers.mooncake_tier import MooncakeTier
    from kvtier.tiers.mooncake_url import parse_url

    try:
        MooncakeTier.check_url(url)
    except ValueError as exc:
        raise BenchUsageError(f"--url: {exc}") from None
    why = mooncake_missing()
    if why:
        raise BenchUsageError(f"bench remote --url mooncake://: {why}")
    master = parse_url(url, {}).master
    if probe_master(master, PREFLIGHT_TIMEOUT_S) != 0:
        raise BenchUsageError(f"--url {url!r}: no Mooncake master answered at {master} within {PREFLIGHT_TIMEOUT_S:.0f} s")


def _spread(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": median(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def measure(url: str, num_chunks: int = 16, reps: int = 5) -> dict[str, Any]:
    """Every measurement against the master at ``url``; returns the JSON-ready figures.

    Raises:
        RuntimeError: the tier or the raw client could not write/read, or read wrong bytes.
    """
    from kvtier.testing.mooncake_master import SegmentOwnerProcess
    from kvtier.tiers.base import ChunkWrite
    from kvtier.tiers.mooncake_calls import set_client_environment
    from kvtier.tiers.mooncake_tier import MooncakeTier
    from kvtier.tiers.mooncake_url import parse_url

    target = parse_url(url, {})
    run_id = uuid.uuid4().hex[:12]
    owner = SegmentOwnerProcess(target.master, OWNER_SEGMENT_BYTES)
    tier = MooncakeTier(url, key_prefix=f"kvtier-bench-{run_id}:", segment_bytes=0, timeout_s=60.0,
                        transfer_grace_s=0.0)
    set_client_environment("127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    total = num_chunks * CHUNK_BYTES
    try:
        if raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", target.master) != 0:
            raise RuntimeError(f"the raw Mooncake client could not be set up on {target.master}")
        payloads = _payloads(num_chunks)
        # One contiguous, pre-touched, registered region per side, like the CPU tier's pool.
        k_src, r_src = np.concatenate(payloads), np.concatenate(payloads)
        k_dst, r_dst = np.ones(total, np.uint8), np.ones(total, np.uint8)
        tier.register_host_memory(int(k_src.ctypes.data), total)
        tier.register_host_memory(int(k_dst.ctypes.data), total)
        for buf in (r_src, r_dst):
            if raw.register_buffer(int(buf.ctypes.data), total) != 0:
                raise RuntimeError("register_buffer failed for the raw client")
        keys = [os.urandom(32) for _ in range(num_chunks)]
        raw_keys = [f"raw-bench-{run_id}:{k.hex()}" for k in keys]
        k_writes = [ChunkWrite(k, None, k_src[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]) for i, k in enumerate(keys)]
        k_gets = [(k, k_dst[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]) for i, k in enumerate(keys)]
        r_src_ptrs = [int(r_src.ctypes.data) + i * CHUNK_BYTES for i in range(num_chunks)]
        r_dst_ptrs = [int(r_dst.ctypes.data) + i * CHUNK_BYTES for i in range(num_chunks)]
        sizes = [CHUNK_BYTES] * num_chunks
        deadline = time.monotonic() + 60
        while not tier.stats()["client_open"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the kvtier tier did not open on {target.master}")
            time.sleep(0.05)
        # A master still lists the segment of an owner that exited (a previous run's) until its
        # client TTL ends, and places some puts there, which then fail: wait until a whole batch
        # lands (untimed), so the measured rounds see only the live owner.
        settle_by = time.monotonic() + SETTLE_TIMEOUT_S
        while not all(tier.put_many(k_writes)):
            if time.monotonic() > settle_by:
                raise RuntimeError(f"the pool on {target.master} did not take {num_chunks} chunks within "
                                   f"{SETTLE_TIMEOUT_S:.0f} s (a stale segment, or too little pool memory)")
            time.sleep(0.5)

        def k_put() -> float:
            t0 = time.perf_counter()
            ok = tier.put_many(k_writes)
            dt = time.perf_counter() - t0
            if not all(ok):
                raise RuntimeError(f"kvtier put_many stored {sum(ok)} of {num_chunks} chunks")
            return dt

        def r_put() -> float:
            raw.batch_remove(raw_keys, True)  # untimed: a put on an existing key moves nothing
            t0 = time.perf_counter()
            rc = raw.batch_put_from(raw_keys, r_src_ptrs, sizes)
            dt = time.perf_counter() - t0
            if any(c != 0 for c in rc):
                raise RuntimeError(f"raw batch_put_from returned {sorted(set(rc))}")
            return dt

        def k_get() -> float:
            t0 = time.perf_counter()
            ok = tier.get_many_into(k_gets)
            dt = time.perf_counter() - t0
            if not all(ok):
                raise RuntimeError(f"kvtier get_many_into read {sum(ok)} of {num_chunks} chunks")
            return dt

        def r_get() -> float:
            t0 = time.perf_counter()
            rc = raw.batch_get_into(raw_keys, r_dst_ptrs, sizes)
            dt = time.perf_counter() - t0
            if any(c != CHUNK_BYTES for c in rc):
                raise RuntimeError(f"raw batch_get_into returned {sorted(set(rc))}")
            return dt

        puts = interleaved({"kvtier": k_put, "raw": r_put}, reps)
        gets = interleaved({"kvtier": k_get, "raw": r_get}, reps)
        if not (np.array_equal(k_dst, k_src) and np.array_equal(r_dst, r_src)):
            raise RuntimeError("a get read back wrong bytes")
        ex_keys = keys[:EXISTS_KEYS] + [os.urandom(32) for _ in range(max(0, EXISTS_KEYS - num_chunks))]
        raw_ex = [f"raw-bench-{run_id}:{k.hex()}" for k in ex_keys]

        def k_exists() -> float:
            t0 = time.perf_counter()
            tier.contains_many(ex_keys)
            return time.perf_counter() - t0

        def r_exists() -> float:
            t0 = time.perf_counter()
            raw.batch_is_exist(raw_ex)
            return time.perf_counter() - t0

        exists = interleaved({"kvtier": k_exists, "raw": r_exists}, max(reps * 10, 20))
        if tier.contains_many(keys[:EXISTS_KEYS]) != [True] * min(num_chunks, EXISTS_KEYS):
            raise RuntimeError("contains_many missed chunks that were stored")
    finally:
        tier.clear()
        tier.close()
        try:
            raw.batch_remove(raw_keys, True)
            raw.close()
        except Exception:
            pass
        owner.stop()

    kp, rp = median(puts["kvtier"]), median(puts["raw"])
    kg, rg = median(gets["kvtier"]), median(gets["raw"])
    return {
        "url": url,
        "chunk_bytes": CHUNK_BYTES,
        "chunks": num_chunks,
        "reps": reps,
        "put_gbps": gbps(total, kp),
        "raw_put_gbps": gbps(total, rp),
        "get_gbps": gbps(total, kg),
        "raw_get_gbps": gbps(total, rg),
        "mooncake_put_ratio": rp / kp,
        "mooncake_get_ratio": rg / kg,
        "put_seconds": {"kvtier": _spread(puts["kvtier"]), "raw": _spread(puts["raw"])},
        "get_seconds": {"kvtier": _spread(gets["kvtier"]), "raw": _spread(gets["raw"])},
        "put_samples_s": puts,
        "get_samples_s": gets,
        "exists_32_us": median(exists["kvtier"]) * 1e6,
        "exists_32_us_raw": median(exists["raw"]) * 1e6,
        "exists_32_ratio": median(exists["raw"]) / median(exists["kvtier"]),
    }


def run_remote_mooncake(url: str, json_path: Path | None = None, num_chunks: int = 16, reps: int = 5) -> int:
    """CLI entry: measure, print the judged figures, write JSON; exit code 1 if a target is missed.

    Raises:
        BenchUsageError: see :func:`preflight`.
    """
    preflight(url)
    r = measure(url, num_chunks=num_chunks, reps=reps)
    checks = [
        Check("put: kvtier / raw batch_put_from", r["mooncake_put_ratio"], 1.0, True, "x",
              f"{r['put_gbps']:.2f} vs {r['raw_put_gbps']:.2f} GB/s, {num_chunks} x 5.9 MB"),
        Check("get: kvtier / raw batch_get_into", r["mooncake_get_ratio"], 1.0, True, "x",
              f"{r['get_gbps']:.2f} vs {r['raw_get_gbps']:.2f} GB/s (kvtier verifies every record)"),
    ]
    print_checks(f"Mooncake tier vs raw zero-copy client calls ({url})", checks)
    print(f"exists of 32 chunks: {r['exists_32_us']:.0f} us vs batch_is_exist {r['exists_32_us_raw']:.0f} us")
    write_json(json_path, r)
    return 0 if all(c.passed for c in checks) else 1
