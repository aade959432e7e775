"""Redis tier: fault behaviour on throwaway servers, breaker, TTL, OOM, cluster routing.

Destructive tests start their own redis-server on free loopback ports (never
the shared CI ports) and kill it in teardown. Bounded-wait checks compare each
call's duration with the configured timeout plus a generous slack: they check
that no call hangs, not how fast calls are.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from conftest import CI_REDIS_CLUSTER, REDIS_HINT, wait_until
from kvtier.testing import bf16_payload
from kvtier.testing.redis_server import RedisServerProcess, ping, redis_server_binary
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvtier.tiers.redis_tier import RedisTier

redis = pytest.importorskip("redis")

TIMEOUT_S = 0.3
SLACK_S = 1.0  # scheduling noise on a shared 2-core machine; a hang would be unbounded
VALUE = 1 << 20

needs_server = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")


@pytest.fixture
def server():
    srv = RedisServerProcess(extra_args=("--enable-debug-command", "yes"))
    try:
        yield srv
    finally:
        srv.stop()


def _tier(url: str, **kw) -> RedisTier:
    """A tier with tight bounds, for the tests about timeouts, breakers and dead servers."""
    opts = dict(timeout_s=TIMEOUT_S, connect_timeout_s=0.2, breaker_failures=2, breaker_backoff_s=0.2)
    opts.update(kw)
    return RedisTier.from_url(url, **opts)


def _roomy_tier(url: str, **kw) -> RedisTier:
    """A tier with the default-sized bounds, for tests of what is stored (TTLs, prefixes, namespaces):
    on a loaded machine a 1 MiB write can take longer than the fault tests' 0.3 s, and a timed-out
    write there says nothing about the feature under test (test_ttl_is_set_on_remote_keys failed so)."""
    return RedisTier.from_url(url, **{"timeout_s": 5.0, "connect_timeout_s": 2.0, **kw})


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def _items(n: int, seed: int = 0):
    keys = [os.urandom(32) for _ in range(n)]
    return keys, [bf16_payload(VALUE, seed + i) for i in range(n)]


def _writes(keys, values, parents=None):
    parents = parents or [None] * len(keys)
    return [ChunkWrite(k, p, v) for k, p, v in zip(keys, parents, values)]


# -- circuit breaker (fake clock) ------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_consecutive_failures_and_probes_after_backoff():
    clock = FakeClock()
    b = CircuitBreaker(failures=3, backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == CLOSED
    b.success()  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.failure()
    assert b.state == OPEN and b.trips == 1
    assert not b.allow()
    clock.t = 1.01
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.failure()  # probe failed: back-off doubles
    assert b.state == OPEN
    clock.t = 2.5
    assert not b.allow()
    clock.t = 3.02
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()


def test_breaker_backoff_is_capped():
    clock = FakeClock()
    b = CircuitBreaker(failures=1, backoff_s=1.0, max_backoff_s=2.0, clock=clock)
    b.allow()
    b.failure()
    for _ in range(5):
        clock.t += 100
        assert b.allow()
        b.failure()
    clock.t += 2.01
    assert b.allow()


# -- URL handling ---------------------------------------------------------------------------
def test_url_options_are_parsed_and_password_masked():
    t = RedisTier.from_url("redis://:s3cret@127.0.0.1:1/2?ttl_s=5&codec=shuffle-zstd&timeout_s=0.25")
    assert t.options.ttl_s == 5.0 and t.options.timeout_s == 0.25 and t.codec.name == "shuffle-zstd"
    assert "s3cret" not in t.url
    t.close()
    with pytest.raises(ValueError):
        RedisTier("http://127.0.0.1:1")
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:1", codec="nope")
    with pytest.raises(ValueError):
        RedisTier("redis+cluster://127.0.0.1:1/3")  # clusters have only db 0
    with pytest.raises(ValueError, match="tll_s"):
        RedisTier("redis://127.0.0.1:1", tll_s=5)  # misspelt option


def test_unreachable_redis_is_a_bounded_miss():
    port = 1  # nothing listens there
    t = _tier(f"redis://127.0.0.1:{port}/0")
    keys, values = _items(2)
    for _ in range(4):
        out, dt = _timed(t.put_many, _writes(keys, values))
        assert out == [False, False] and dt < TIMEOUT_S + SLACK_S
        assert t.contains_many(keys) == [False, False]
    s = t.stats()
    assert s["breaker_trips"] >= 1 and s["skipped_calls"] >= 1 and s["put_failed"] == 8


# -- faults on a throwaway server -----------------------------------------------------------
@needs_server
def test_killed_mid_workload_then_restarted(server):
    tier = _tier(server.url)
    keys, values = _items(4)
    assert all(tier.put_many(_writes(keys, values)))
    outs = [np.zeros_like(v) for v in values]
    durations: list[float] = []
    results: list[list[bool]] = []
    stop = threading.Event()

    def workload():
        while not stop.is_set():
            r, dt = _timed(tier.get_many_into, list(zip(keys, outs)))
            results.append(r)
            durations.append(dt)

    t = threading.Thread(target=workload)
    t.start()
    wait_until(lambda: len(results) >= 3)
    server.kill()
    n_at_kill = len(results)
    wait_until(lambda: tier.stats()["breakers"]["standalone"] == OPEN)
    wait_until(lambda: len(results) >= n_at_kill + 20)
    stop.set()
    t.join()
    assert max(durations) < TIMEOUT_S + SLACK_S
    assert all(r == [True] * 4 for r in results[:3])
    assert all(r == [False] * 4 for r in results[n_at_kill + 1 :])
    s = tier.stats()
    assert s["breaker_trips"] >= 1 and s["skipped_calls"] > 0 and s["errors"] >= 2

    server.start()  # restarted, empty
    wait_until(lambda: tier.put_many(_writes(keys, values)) == [True] * 4)
    assert tier.get_many_into(list(zip(keys, outs))) == [True] * 4
    assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    assert tier.stats()["breakers"]["standalone"] == CLOSED
    tier.close()


@needs_server
def test_restarted_empty_gets_are_counted_misses(server):
    tier = _tier(server.url, breaker_failures=5)
    keys, values = _items(3)
    assert all(tier.put_many(_writes(keys, values)))
    assert tier.contains_many(keys) == [True] * 3
    server.kill()
    server.start()
    outs = [np.zeros_like(v) for v in values]
    # The first call may meet the dead pooled connection (an error); the tier reconnects by itself.
    wait_until(lambda: tier.contains_many(keys) == [False] * 3 and tier.stats()["breakers"]["standalone"] == CLOSED)
    before = tier.stats()
    assert tier.get_many_into(list(zip(keys, outs))) == [False] * 3
    after = tier.stats()
    assert after["get_misses"] - before["get_misses"] == 3
    assert after["get_corrupt"] == before["get_corrupt"] == 0
    tier.close()


@needs_server
def test_paused_server_calls_return_within_timeout(server):
    tier = _tier(server.url)
    keys, values = _items(2)
    assert all(tier.put_many(_writes(keys, values)))
    outs = [np.zeros_like(v) for v in values]
    server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        for op, args, miss in [
            (tier.get_many_into, (list(zip(keys, outs)),), [False, False]),
            (tier.contains_many, (keys,), [False, False]),
            (tier.put_many, (_writes(keys, values),), [False, False]),
            (tier.get_many_into, (list(zip(keys, outs)),), [False, False]),
        ]:
            out, dt = _timed(op, *args)
            assert out == miss
            assert dt < TIMEOUT_S + SLACK_S, f"{op.__name__} waited {dt:.2f} s"
        assert tier.stats()["breakers"]["standalone"] == OPEN
    finally:
        server.resume()
    wait_until(lambda: tier.get_many_into(list(zip(keys, outs))) == [True, True])
    assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    tier.close()


@pytest.mark.slow
@needs_server
def test_debug_sleep_server_calls_return_within_timeout(server):
    tier = _tier(server.url, breaker_failures=10)
    keys, values = _items(1)
    assert tier.put(keys[0], values[0])
    admin = redis.Redis("127.0.0.1", server.port, protocol=2)
    sleeper = threading.Thread(target=lambda: admin.execute_command("DEBUG", "SLEEP", "1.5"))
    sleeper.start()
    time.sleep(0.1)  # let DEBUG SLEEP reach the server first
    out = np.zeros_like(values[0])
    ok, dt = _timed(tier.get_into, keys[0], out)
    assert ok is False and dt < TIMEOUT_S + SLACK_S
    sleeper.join()
    admin.close()
    wait_until(lambda: tier.get_into(keys[0], out))
    assert np.array_equal(out, values[0])
    tier.close()


@needs_server
def test_full_redis_drops_writes_without_opening_breaker():
    with RedisServerProcess(maxmemory="4mb", policy="noeviction") as srv:
        tier = _tier(srv.url, breaker_failures=1)
        keys, values = _items(8)
        out = tier.put_many(_writes(keys, values))
        assert not all(out)  # 8 MiB never fit in 4 MiB
        s = tier.stats()
        assert s["put_failed"] == out.count(False) and s["errors"] == 0
        assert s["breakers"]["standalone"] == CLOSED  # an OOM reply is not a dead node
        assert tier.contains_many(keys) == out
        tier.close()


@needs_server
def test_ttl_is_set_on_remote_keys(server):
    tier = _roomy_tier(server.url, ttl_s=30, key_prefix="ttl:")
    (key,), (value,) = _items(1)
    assert tier.put(key, value)
    client = redis.Redis("127.0.0.1", server.port, protocol=2)
    assert 0 < client.pttl(tier.redis_key(key)) <= 30_000
    client.close()
    tier.close()


@needs_server
def test_clear_leaves_other_prefixes_alone(server):
    a = _roomy_tier(server.url, key_prefix="a:")
    b = _roomy_tier(server.url, key_prefix="b:")
    keys, values = _items(3)
    assert all(a.put_many(_writes(keys, values))) and all(b.put_many(_writes(keys, values)))
    assert a.clear() == 3
    assert a.contains_many(keys) == [False] * 3 and b.contains_many(keys) == [True] * 3
    a.close()
    b.close()


# -- cluster (shared CI cluster) --------------------------------------------------------------
CLUSTER = CI_REDIS_CLUSTER
needs_cluster = pytest.mark.skipif(
    not ping(*CLUSTER), reason=f"no Redis Cluster on {CLUSTER[0]}:{CLUSTER[1]}; {REDIS_HINT}"
)


@needs_cluster
def test_cluster_spreads_keys_and_recovers_from_stale_slot_map():
    tier = _tier("redis+cluster://127.0.0.1:7100", key_prefix="kvtier-test-moved:", timeout_s=2.0)
    keys, values = _items(12)
    assert all(tier.put_many(_writes(keys, values)))
    from redis.cluster import RedisCluster

    rc = RedisCluster(*CLUSTER, protocol=2)
    owners = {rc.get_node_from_key(tier.redis_key(k)).port for k in keys}
    assert len(owners) >= 2  # one batch really went to several nodes
    rc.close()
    # Pretend the cluster resharded: every slot now "belongs" to one node.
    node = tier.nodes.slots[0]
    tier.nodes.slots = [node] * len(tier.nodes.slots)
    got = tier.contains_many(keys)
    assert not all(got)  # keys on other nodes answered MOVED: misses, not errors
    assert tier.stats()["redirects"] > 0 and tier.stats()["errors"] == 0
    assert tier.contains_many(keys) == [True] * 12  # the slot map was refreshed
    outs = [np.zeros_like(v) for v in values]
    assert tier.get_many_into(list(zip(keys, outs))) == [True] * 12
    assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    tier.clear()
    tier.close()


@needs_server
def test_clear_removes_only_this_namespace(server):
    """Issue 8, failing input 6: two models share the key prefix; clear removes only the caller's."""
    a = _roomy_tier(server.url, namespace=b"a" * 32)
    b = _roomy_tier(server.url, namespace=b"b" * 32)
    keys, values = _items(4)
    assert all(a.put_many(_writes(keys, values))) and all(b.put_many(_writes(keys, values)))
    client = redis.Redis("127.0.0.1", server.port, protocol=2)
    assert len(list(client.scan_iter(match="kvtier:*"))) == 8  # one shared prefix
    assert a.clear() == 4
    assert a.contains_many(keys) == [False] * 4 and b.contains_many(keys) == [True] * 4
    assert a.redis_key(keys[0]).startswith(b"kvtier:" + (b"a" * 32).hex()[:16].encode() + b":")
    client.close()
    a.close()
    b.close()


@pytest.mark.slow
@needs_server
def test_ttl_heads_outlive_tails(server):
    """Issue 8, failing input 4 (remote part): a batch is written tail first, each write refreshes
    its parent's TTL, and touch_many refreshes a whole chain, so a head never expires first."""
    tier = _roomy_tier(server.url, ttl_s=0.8)
    keys, values = _items(3)
    client = redis.Redis("127.0.0.1", server.port, protocol=2)
    assert all(tier.put_many(_writes(keys, values, [None, keys[0], keys[1]])))
    ttls = [client.pttl(tier.redis_key(k)) for k in keys]
    assert ttls[0] >= ttls[1] >= ttls[2] > 0, ttls
    time.sleep(0.5)
    (tail,), (tail_value,) = _items(1, seed=9)
    assert tier.put_many(_writes([tail], [tail_value], [keys[0]]))  # a new tail under the old head
    assert client.pttl(tier.redis_key(keys[0])) >= client.pttl(tier.redis_key(tail)) > 0
    time.sleep(0.5)  # the head's first expiry has passed
    assert tier.contains_many([keys[0], tail]) == [True, True]
    tier.touch_many([keys[0], keys[1], keys[2]])  # chain refresh (keys 1, 2 expired already: harmless)
    assert client.pttl(tier.redis_key(keys[0])) > 600
    client.close()
    tier.close()
