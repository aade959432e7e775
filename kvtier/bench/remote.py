"""``kvtier bench remote``: the Redis tier against raw redis-py on the same server and bytes.

Measured in one run, repetitions interleaved (ABBA) and summarised by medians:

- **put**: kvtier ``put_many`` of N chunks (one pipelined round trip, raw codec,
  envelope + scatter-gather send) vs redis-py (hiredis parser) pipelined
  ``SET`` of the same N payloads;
- **get**: kvtier ``get_many_into`` into pre-allocated chunk buffers vs redis-py
  pipelined ``GET`` returning ``bytes`` (the baseline does not even copy into a
  destination, so it is the stricter side);
- **existence of 32 chunks**: kvtier ``contains_many`` vs redis-py pipelined
  ``EXISTS`` x32, latency in microseconds.

Round trips of ``contains_many`` are counted two ways: on the client, by
counting the tier's pipeline sends (every batched call sends each node's
commands in one write, then reads all replies: one send = one round trip), and
on the server, by the ``INFO commandstats`` delta (the 32 ``EXISTS`` commands
were all executed). Chunks are 5,898,240 bytes: one 256-token chunk of
SmolLM2-135M's bf16 KV (30 layers x 3 KV heads x head dim 64 x K and V).
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kvtier.bench.common import BenchUsageError, Check, gbps, interleaved, median, print_checks, write_json
from kvtier.bench.remote_payloads import CHUNK_BYTES, EXISTS_KEYS, payloads as _payloads


@contextmanager
def count_round_trips() -> Iterator[list[int]]:
    """Count the Redis tier's pipeline sends (one per node per batched call) while active."""
    from kvtier.tiers import redis_nodes  # where the tier opens its wires
    from kvtier.tiers.resp import Wire as original  # (redis_nodes' Wire)

    counter = [0]

    class CountingWire(original):
        def send(self, parts: Any) -> None:
            counter[0] += 1
            super().send(parts)

    # setattr: the module's class is replaced on purpose (mypy refuses assigning to a class name).
    setattr(redis_nodes, "Wire", CountingWire)
    try:
        yield counter
    finally:
        setattr(redis_nodes, "Wire", original)


#: Bound on reaching the store before measuring (seconds): connect, TLS handshake, PING.
PREFLIGHT_TIMEOUT_S = 5.0


def _raw_client(url: str, timeout_s: float = 60.0) -> Any:
    import redis

    bounds = {"socket_timeout": timeout_s, "socket_connect_timeout": min(timeout_s, PREFLIGHT_TIMEOUT_S)}
    if "+cluster://" in url:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url.replace("+cluster", "", 1), protocol=2, **bounds)
    return redis.Redis.from_url(url, protocol=2, **bounds)


def preflight(url: str) -> None:
    """Check ``--url`` before measuring: a Redis URL kvtier accepts, answering PING within 5 s.

    Raises:
        BenchUsageError: one line naming ``--url`` (password masked) and the reason.
    """
    try:
        import redis
    except ImportError:
        raise BenchUsageError("bench remote needs redis-py: pip install 'kvtier[redis]'") from None
    from kvtier.urls import mask_url
    from kvtier.tiers.redis_tier import RedisTier

    shown = mask_url(url)
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in RedisTier.schemes:
        raise BenchUsageError(
            f"--url {shown!r}: not a Redis URL; use {', '.join(s + '://' for s in RedisTier.schemes)} "
            "(e.g. redis://127.0.0.1:6379/0), or mooncake://HOST:PORT for the Mooncake tier"
        )
    try:
        RedisTier.check_url(url)
    except ValueError as exc:
        raise BenchUsageError(f"--url: {exc}") from None
    try:
        client = _raw_client(url, PREFLIGHT_TIMEOUT_S)
        client.ping()
        client.close()
    except (redis.RedisError, OSError) as exc:
        hint = " (rediss:// needs a Redis that speaks TLS)" if scheme.startswith("rediss") else ""
        raise BenchUsageError(
            f"--url {shown!r}: no Redis answered within {PREFLIGHT_TIMEOUT_S:.0f} s: {exc}{hint}"
        ) from None


def _exists_calls(client: Any) -> int:
    """EXISTS commands the server (every node of a cluster) has executed so far."""
    if hasattr(client, "get_nodes"):  # RedisCluster: ask every primary
        stats = client.info("commandstats", target_nodes=client.PRIMARIES)
        return sum(int(node.get("cmdstat_exists", {}).get("calls", 0)) for node in stats.values())
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_exists", {}).get("calls", 0))


def measure(url: str, num_chunks: int = 16, reps: int = 5) -> dict[str, Any]:
    """Run every measurement against the Redis at ``url``; returns the JSON-ready figures.

    Raises:
        RuntimeError: the server is unreachable or a round trip returned wrong bytes.
    """
    from kvtier.tiers.base import ChunkWrite
    from kvtier.tiers.redis_tier import RedisTier

    run_id = uuid.uuid4().hex[:12]
    prefix = f"kvtier-bench:{run_id}:"
    tier = RedisTier.from_url(url, key_prefix=prefix, timeout_s=60.0, connect_timeout_s=5.0)
    raw = _raw_client(url)
    payloads = _payloads(num_chunks)
    blobs = [p.tobytes() for p in payloads]  # redis-py sends bytes; converting is not timed
    keys = [os.urandom(32) for _ in range(num_chunks)]
    raw_keys = [f"raw-bench:{run_id}:{k.hex()}" for k in keys]
    outs = [np.empty(CHUNK_BYTES, np.uint8) for _ in range(num_chunks)]
    for o in outs:
        o.fill(0)  # pre-touched, like CPU tier slots
    total = num_chunks * CHUNK_BYTES
    writes = [ChunkWrite(k, None, p) for k, p in zip(keys, payloads)]  # built once, not timed
    try:
        raw.ping()
        if not all(tier.put_many(writes)):
            raise RuntimeError(f"kvtier could not write to {tier.url}")
        if not all(tier.get_many_into(list(zip(keys, outs)))) or not all(
            np.array_equal(o, p) for o, p in zip(outs, payloads)
        ):
            raise RuntimeError("kvtier read back wrong bytes")

        def k_put() -> float:
            t0 = time.perf_counter()
            ok = tier.put_many(writes)
            dt = time.perf_counter() - t0
            assert all(ok)
            return dt

        def r_put() -> float:
            pipe = raw.pipeline(transaction=False)
            for k, b in zip(raw_keys, blobs):
                pipe.set(k, b)
            t0 = time.perf_counter()
            pipe.execute()
            return time.perf_counter() - t0

        def k_get() -> float:
            t0 = time.perf_counter()
            ok = tier.get_many_into(list(zip(keys, outs)))
            dt = time.perf_counter() - t0
            assert all(ok)
            return dt

        def r_get() -> float:
            pipe = raw.pipeline(transaction=False)
            for k in raw_keys:
                pipe.get(k)
            t0 = time.perf_counter()
            got = pipe.execute()
            dt = time.perf_counter() - t0
            assert all(g is not None and len(g) == CHUNK_BYTES for g in got)
            return dt

        puts = interleaved({"kvtier": k_put, "redis-py": r_put}, reps)
        gets = interleaved({"kvtier": k_get, "redis-py": r_get}, reps)

        ex_keys = keys[:EXISTS_KEYS] + [os.urandom(32) for _ in range(max(0, EXISTS_KEYS - num_chunks))]
        raw_ex = [f"raw-bench:{run_id}:{k.hex()}" for k in ex_keys]

        def k_exists() -> float:
            t0 = time.perf_counter()
            tier.contains_many(ex_keys)
            return time.perf_counter() - t0

        def r_exists() -> float:
            pipe = raw.pipeline(transaction=False)
            for k in raw_ex:
                pipe.exists(k)
            t0 = time.perf_counter()
            pipe.execute()
            return time.perf_counter() - t0

        exists = interleaved({"kvtier": k_exists, "redis-py": r_exists}, max(reps * 10, 20))
        # Round trips of one contains_many of 32 keys: client-side sends, server-side EXISTS count.
        before = _exists_calls(raw)
        with count_round_trips() as sends:
            found = tier.contains_many(ex_keys)
        server_exists = _exists_calls(raw) - before
        # One round trip per node: 1 on a standalone server, at most the node count on a cluster.
        nodes = len(set(tier.nodes.slots or ())) if tier.cluster else 1
        if found[: min(num_chunks, EXISTS_KEYS)] != [True] * min(num_chunks, EXISTS_KEYS):
            raise RuntimeError("contains_many missed chunks that were stored")
    finally:
        tier.clear()
        tier.close()
        try:
            raw.delete(*raw_keys)
        except Exception:
            pass
        raw.close()

    kp, rp = median(puts["kvtier"]), median(puts["redis-py"])
    kg, rg = median(gets["kvtier"]), median(gets["redis-py"])
    return {
        "url": tier.url,
        "chunk_bytes": CHUNK_BYTES,
        "chunks": num_chunks,
        "reps": reps,
        "put_gbps": gbps(total, kp),
        "raw_put_gbps": gbps(total, rp),
        "get_gbps": gbps(total, kg),
        "raw_get_gbps": gbps(total, rg),
        "redis_put_ratio": rp / kp,
        "redis_get_ratio": rg / kg,
        "exists_32_us": median(exists["kvtier"]) * 1e6,
        "exists_32_us_redis_py": median(exists["redis-py"]) * 1e6,
        "exists_32_ratio": median(exists["redis-py"]) / median(exists["kvtier"]),
        "exists_32_round_trips": sends[0],
        "exists_32_server_exists_commands": server_exists,
        "nodes": nodes,
    }


def run_remote(url: str, json_path: Path | None = None, num_chunks: int = 16, reps: int = 5) -> int:
    """CLI entry: measure, print the judged figures, write JSON; exit code 1 if a target is missed.

    A ``mooncake://`` URL measures the Mooncake tier instead (:mod:`kvtier.bench.remote_mooncake`).

    Raises:
        BenchUsageError: ``url`` is not a Redis URL or no Redis answers there (see :func:`preflight`).
    """
    if url.partition("://")[0].lower() == "mooncake":
        from kvtier.bench.remote_mooncake import run_remote_mooncake

        return run_remote_mooncake(url, json_path, num_chunks, reps)
    preflight(url)
    r = measure(url, num_chunks=num_chunks, reps=reps)
    checks = [
        Check(
            "put: kvtier / redis-py SET", r["redis_put_ratio"], 1.0, True, "x",
            f"{r['put_gbps']:.2f} vs {r['raw_put_gbps']:.2f} GB/s, {num_chunks} x 5.9 MB",
        ),
        Check(
            "get: kvtier / redis-py GET", r["redis_get_ratio"], 1.0, True, "x",
            f"{r['get_gbps']:.2f} vs {r['raw_get_gbps']:.2f} GB/s (kvtier into slots, redis-py to bytes)",
        ),
        Check(
            "exists of 32 chunks: round trips", r["exists_32_round_trips"], r["nodes"], False, "",
            f"server ran {r['exists_32_server_exists_commands']} EXISTS; "
            f"{r['exists_32_us']:.0f} us vs redis-py pipeline {r['exists_32_us_redis_py']:.0f} us",
        ),
    ]
    print_checks(f"Remote tier vs raw redis-py ({r['url']})", checks)
    write_json(json_path, r)
    return 0 if all(c.passed for c in checks) else 1
