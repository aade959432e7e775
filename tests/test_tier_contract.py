"""The lower-tier contract (kvtier.testing) run against the remote tiers: fs, Redis, Redis Cluster.

Redis classes use the CI servers started by ``.ci/redis.sh start`` (standalone on
127.0.0.1:6399, cluster on 127.0.0.1:7100-7102) and skip when they are not
reachable. The throwaway class starts its own redis-server on a free port so it
can kill it (the destructive failure tests).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from kvtier.testing import NS_A, TierContract, TierHarness
from conftest import CI_REDIS, CI_REDIS_CLUSTER, require_redis
from kvtier.testing.redis_server import RedisServerProcess, redis_server_binary
from kvtier.tiers.fs_tier import FsTier
from kvtier.tiers.redis_tier import RedisTier

redis = pytest.importorskip("redis")

STANDALONE = CI_REDIS
CLUSTER = CI_REDIS_CLUSTER


class TestFsContract(TierContract):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> TierHarness:
        root = tmp_path / "share"
        away = tmp_path / "share.unmounted"
        root.mkdir()

        def read_raw(tier, key: bytes) -> bytes | None:
            p = tier.path_of(key)
            return p.read_bytes() if p.exists() else None

        def write_raw(tier, key: bytes, data: bytes) -> None:
            tier.path_of(key).parent.mkdir(parents=True, exist_ok=True)
            tier.path_of(key).write_bytes(data)

        def make(namespace: bytes = NS_A, **kw) -> FsTier:
            # create=False: a missing root is an unmounted share, not something to recreate.
            return FsTier(root, namespace=namespace, create=False, **kw)

        return TierHarness(
            make=make,
            read_raw=read_raw,
            write_raw=write_raw,
            break_store=lambda: os.rename(root, away),
            restore_store=lambda: os.rename(away, root),
            recovery_s=2.0,
        )


def _redis_harness(url: str, raw_client, **extra) -> TierHarness:
    prefix = f"kvtier-test:{uuid.uuid4().hex[:12]}:"

    def make(namespace: bytes = NS_A, **kw) -> RedisTier:
        return RedisTier.from_url(
            url, key_prefix=prefix, namespace=namespace, timeout_s=2.0, breaker_backoff_s=0.1, **kw
        )

    return TierHarness(
        make=make,
        read_raw=lambda tier, key: raw_client.get(tier.redis_key(key)),
        write_raw=lambda tier, key, data: raw_client.set(tier.redis_key(key), data),
        **extra,
    )


class TestRedisStandaloneContract(TierContract):
    @pytest.fixture
    def harness(self) -> TierHarness:
        require_redis()
        client = redis.Redis(*STANDALONE, protocol=2)
        yield _redis_harness(f"redis://{STANDALONE[0]}:{STANDALONE[1]}/0", client)
        client.close()


class TestRedisClusterContract(TierContract):
    @pytest.fixture
    def harness(self) -> TierHarness:
        require_redis(cluster=True)
        from redis.cluster import RedisCluster

        client = RedisCluster(*CLUSTER, protocol=2)
        yield _redis_harness(f"redis+cluster://{CLUSTER[0]}:{CLUSTER[1]}", client)
        client.close()


class TestRedisThrowawayContract(TierContract):
    """Standalone Redis this test owns, so the failure tests may kill and restart it."""

    @pytest.fixture
    def harness(self) -> TierHarness:
        if redis_server_binary() is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        server = RedisServerProcess()
        client = redis.Redis("127.0.0.1", server.port, protocol=2)
        try:
            yield _redis_harness(server.url, client, break_store=server.kill, restore_store=server.start)
        finally:
            client.close()
            server.stop()
