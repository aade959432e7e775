"""The lower-tier contract (kvtier.testing) run against the Mooncake Store tier, plus its URL handling.

``TestMooncakeContract`` uses the master ``.ci/mooncake.sh start`` runs (127.0.0.1:50151)
and skips when none answers there; ``TestMooncakeThrowawayContract`` starts its own
master on free loopback ports so the failure tests may kill and restart it. The tiers
under test mount no memory (``segment_bytes=0``): a holder client in this process
mounts the pool's segment, so a chunk outlives the tier that wrote it (as with a
dedicated ``mooncake_client``), and reads and writes raw values for the corruption tests.
"""

from __future__ import annotations

import socket
import uuid

import pytest

from kvtier.testing import NS_A, TierContract, TierHarness
from kvtier.testing.mooncake_master import MooncakeMasterProcess, mooncake_missing

pytestmark = pytest.mark.mooncake

CI_MASTER = ("127.0.0.1", 50151)
_SKIP_HINT = "start the CI master with `bash .ci/mooncake.sh start`"


def _skip_without_mooncake() -> None:
    why = mooncake_missing()
    if why:
        pytest.skip(why)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class Holder:
    """A raw Mooncake client that mounts the pool's segment and reads/writes values directly."""

    def __init__(self, master: str, segment_bytes: int = 256 << 20):
        from kvtier.tiers.mooncake_calls import set_client_environment

        set_client_environment("127.0.0.1")
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master)
        assert rc == 0, f"holder setup failed: {rc}"

    def read(self, tier, key: bytes) -> bytes | None:
        mk = tier.mooncake_key(key)
        if self.store.is_exist(mk) != 1:
            return None
        return bytes(self.store.get(mk))

    def write(self, tier, key: bytes, data: bytes) -> None:
        mk = tier.mooncake_key(key)
        self.store.remove(mk, True)
        assert self.store.put(mk, data) == 0

    def close(self) -> None:
        """Leave the client open until the process exits: closing a client whose segment
        another client (a tier whose call outlived a master outage) still transfers into
        crashes the process in Mooncake 0.3.13.post1 (seen in these tests)."""
        from kvtier.tiers.mooncake_calls import _park

        _park(self.store)


def _harness(url: str, holder: Holder, **extra) -> TierHarness:
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}:"

    def make(namespace: bytes = NS_A, **kw):
        from kvtier.tiers.mooncake_tier import MooncakeTier

        return MooncakeTier(
            url, key_prefix=prefix, namespace=namespace, timeout_s=2.0, breaker_backoff_s=0.1,
            breaker_max_backoff_s=0.5, segment_bytes=0, **kw,
        )

    return TierHarness(make=make, read_raw=holder.read, write_raw=holder.write, recovery_s=20.0, **extra)


@pytest.mark.slow  # each test opens a Mooncake client; its close unmounts a segment at the master (~1 s)
class TestMooncakeContract(TierContract):
    @pytest.fixture(scope="class")
    @classmethod
    def holder(cls):
        _skip_without_mooncake()
        if not _answers(*CI_MASTER):
            pytest.skip(f"no Mooncake master on {CI_MASTER[0]}:{CI_MASTER[1]}; {_SKIP_HINT}")
        h = Holder(f"{CI_MASTER[0]}:{CI_MASTER[1]}")
        yield h
        h.close()

    @pytest.fixture
    def harness(self, holder: Holder) -> TierHarness:
        return _harness(f"mooncake://{CI_MASTER[0]}:{CI_MASTER[1]}", holder)


@pytest.mark.slow  # starts a master of its own per test (~1.7 s each)
class TestMooncakeThrowawayContract(TierContract):
    """A master this class owns, so the failure tests may kill and restart it."""

    @pytest.fixture(scope="class")
    @classmethod
    def master(cls):
        _skip_without_mooncake()
        m = MooncakeMasterProcess()
        yield m
        m.stop()

    @pytest.fixture(scope="class")
    @classmethod
    def holder(cls, master: MooncakeMasterProcess):
        h = Holder(master.address)
        yield h
        h.close()

    @pytest.fixture
    def harness(self, master: MooncakeMasterProcess, holder: Holder) -> TierHarness:
        def restore() -> None:
            master.start()

        return _harness(master.url, holder, break_store=master.kill, restore_store=restore)


# -- URL and options (no master needed) ---------------------------------------------------------
def test_url_options_are_parsed_and_checked():
    from kvtier.tiers.mooncake_url import parse_url

    opts: dict = {}
    target = parse_url("mooncake://127.0.0.1:50051?segment_bytes=1GiB&timeout_s=0.25&workers=2", opts)
    assert target.master == "127.0.0.1:50051"
    assert opts == {"segment_bytes": 1 << 30, "timeout_s": 0.25, "workers": 2}
    for bad, match in [
        ("redis://127.0.0.1:1", "scheme"),
        ("mooncake://127.0.0.1", "HOST:PORT"),
        ("mooncake://127.0.0.1:1?segmnt_bytes=1", "segmnt_bytes"),
        ("mooncake://127.0.0.1:1?timeout_s=soon", "timeout_s"),
        ("mooncake://127.0.0.1:1?segment_bytes=lots", "segment_bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_url(bad, {})


def test_url_errors_and_the_shown_url_mask_secrets():
    from kvtier.tiers.mooncake_url import parse_url

    for bad in ["mooncake://127.0.0.1:1?timeout_s=soon&metadata=http://u:s3cret@meta:8080",
                "mooncake://u:s3cret@127.0.0.1:1?bogus=1", "mooncake://u:s3cret@[::1:1"]:
        with pytest.raises(ValueError) as exc:
            parse_url(bad, {})
        assert "s3cret" not in str(exc.value) and "***" in str(exc.value), exc.value
    assert "s3cret" not in parse_url("mooncake://u:s3cret@127.0.0.1:1", {}).url


def test_bad_options_are_refused_before_anything_is_contacted():
    from kvtier.tiers.mooncake_tier import MooncakeTier

    for url in ["mooncake://127.0.0.1:1?protocol=rdma", "mooncake://127.0.0.1:1?workers=0",
                "mooncake://127.0.0.1:1?timeout_s=0", "mooncake://127.0.0.1:1?key_prefix=a/b",
                "mooncake://127.0.0.1:1?segment_bytes=8MiB",
                # nan passes every "<= 0" check and inf bounds nothing: a call that never times out
                "mooncake://127.0.0.1:1?timeout_s=nan", "mooncake://127.0.0.1:1?timeout_s=inf",
                "mooncake://127.0.0.1:1?setup_timeout_s=1e308", "mooncake://127.0.0.1:1?breaker_backoff_s=-5",
                "mooncake://127.0.0.1:1?transfer_grace_s=nan",
                "mooncake://127.0.0.1:1?breaker_backoff_s=60&breaker_max_backoff_s=1"]:
        with pytest.raises(ValueError):
            MooncakeTier.check_url(url)
    MooncakeTier.check_url("mooncake://127.0.0.1:1?segment_bytes=0&codec=shuffle-zstd")


def test_config_accepts_mooncake_urls_and_names_bad_options():
    from kvtier.config import KVTierConfig

    assert KVTierConfig(remote_url="mooncake://127.0.0.1:50051").remote_url  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="segmnt"):
        KVTierConfig(remote_url="mooncake://127.0.0.1:50051?segmnt=1")  # type: ignore[call-arg]


def test_the_registry_opens_mooncake_urls():
    from kvtier.tiers.registry import available_tiers, load_tier_class

    assert "mooncake" in available_tiers()
    _skip_without_mooncake()
    from kvtier.tiers.mooncake_tier import MooncakeTier

    assert load_tier_class("mooncake") is MooncakeTier


# -- parts of one batch: transfers one at a time, in order (TransferRelay) -----------------------
def test_transfer_relay_orders_parts_and_starts_none_after_the_deadline():
    import threading
    import time

    from kvtier.tiers.mooncake_tier import TransferRelay

    relay = TransferRelay(3, time.monotonic() + 10.0)
    order: list[int] = []

    def part(j: int) -> None:
        try:
            if relay.wait_turn(j):
                order.append(j)
                time.sleep(0.01)
        finally:
            relay.pass_turn(j)

    threads = [threading.Thread(target=part, args=(j,)) for j in (2, 1, 0)]  # the last part starts first
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    assert order == [0, 1, 2]

    relay = TransferRelay(2, time.monotonic() + 0.2)
    t0 = time.monotonic()
    assert relay.wait_turn(1) is False  # part 0 never ended: part 1 gives up at the deadline
    assert time.monotonic() - t0 < 2.0
    relay.pass_turn(0)
    assert relay.wait_turn(1) is False  # its turn came, but after the deadline: it moves nothing
    assert relay.wait_turn(0) is False


@pytest.mark.slow  # opens a Mooncake client (its close: ~1 s)
def test_a_batch_in_parts_moves_one_part_at_a_time_and_every_byte_right(ci_tier):
    """parallel=4: the four parts' transfers never overlap (the checksums run beside them);
    every chunk comes back byte-exact."""
    import os
    import threading
    import time

    import numpy as np

    from kvtier.tiers.base import ChunkWrite

    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def timed(name):
        def call(fn, *a):
            t0 = time.monotonic()
            try:
                return fn(*a)
            finally:
                with lock:
                    spans.append((name, t0, time.monotonic()))
        return call

    names = ("batch_put_from_multi_buffers", "batch_get_into_multi_buffers")
    tier = ci_tier(hooks={name: timed(name) for name in names}, timeout_s=10.0, parallel=4)
    n, size = 8, 1 << 20
    keys = [os.urandom(32) for _ in range(n)]
    src = np.random.default_rng(7).integers(0, 256, n * size, dtype=np.uint8)
    assert tier.put_many([ChunkWrite(k, None, src[i * size:(i + 1) * size]) for i, k in enumerate(keys)]) == [True] * n
    dst = np.zeros(n * size, np.uint8)
    assert tier.get_many_into([(k, dst[i * size:(i + 1) * size]) for i, k in enumerate(keys)]) == [True] * n
    assert np.array_equal(src, dst)
    for name in names:
        mine = sorted((a, b) for nm, a, b in spans if nm == name)
        assert len(mine) == 4, (name, mine)
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(mine, mine[1:])), f"{name}: transfers overlapped: {mine}"


@pytest.mark.slow  # waits out a 1 s deadline
def test_a_part_whose_turn_comes_after_the_deadline_removes_and_moves_nothing(ci_tier):
    """parallel=2, the first part's transfer outlives the deadline: the second part never runs its
    remove or its put (a remove without the put would drop a chunk another writer stored)."""
    import threading
    import time

    removed: list[list[str]] = []
    lock = threading.Lock()

    def remove(fn, keys, force):
        with lock:
            removed.append(list(keys))
        return fn(keys, force)

    def slow_put(fn, *a):
        time.sleep(1.5)  # the transfer outlives the 1 s deadline (within the grace)
        return fn(*a)

    tier = ci_tier(hooks={"batch_remove": remove, "batch_put_from_multi_buffers": slow_put})
    keys, _, writes = _chunks(4)
    ok = tier.put_many(writes)
    assert ok == [True, True, False, False]  # part 0 finished within the grace; part 1 never started
    assert removed == [[tier.mooncake_key(k) for k in keys[:2]]]
    tier.hooks.clear()
    assert tier.contains_many(keys) == [True, True, False, False]


# -- the hostile trial of the relay (each failed before its fix) --------------------------------
class _Proxy:
    """Wraps the tier's Mooncake client: ``hooks[name](fn, *args)`` replaces a method."""

    def __init__(self, store, hooks):
        self._store, self._hooks = store, hooks

    def __getattr__(self, name):
        fn = getattr(self._store, name)
        hook = self._hooks.get(name)
        return fn if hook is None else (lambda *a: hook(fn, *a))


@pytest.fixture
def ci_tier():
    """``make(**options)`` -> an open tier on the CI master; ``hooks`` patch its client's calls."""
    import time

    from kvtier.tiers.mooncake_tier import MooncakeTier

    _skip_without_mooncake()
    if not _answers(*CI_MASTER):
        pytest.skip(f"no Mooncake master on {CI_MASTER[0]}:{CI_MASTER[1]}; {_SKIP_HINT}")
    holder = Holder(f"{CI_MASTER[0]}:{CI_MASTER[1]}")
    made = []

    def make(hooks=None, **kw):
        opts = dict(timeout_s=1.0, transfer_grace_s=3.0, segment_bytes=0, parallel=2)
        opts.update(kw)
        t = MooncakeTier(f"mooncake://{CI_MASTER[0]}:{CI_MASTER[1]}",
                         key_prefix=f"kvtier-test-{uuid.uuid4().hex[:12]}:", **opts)
        made.append(t)
        deadline = time.monotonic() + 30
        while not t.stats()["client_open"] and time.monotonic() < deadline:
            time.sleep(0.05)
        plain = t._store_with_regions
        t.hooks = hooks if hooks is not None else {}
        t._store_with_regions = lambda s: _Proxy(plain(s), t.hooks)  # type: ignore[method-assign]
        return t

    yield make
    for t in made:
        t.hooks.clear()
        t.clear()
        t.close()
    holder.close()


def _chunks(n, size=64 << 10):
    import os

    import numpy as np

    from kvtier.tiers.base import ChunkWrite

    keys = [os.urandom(32) for _ in range(n)]
    vals = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(n)]
    return keys, vals, [ChunkWrite(k, None, v) for k, v in zip(keys, vals)]


@pytest.mark.slow  # opens a Mooncake client (its close: ~1 s)
def test_a_part_that_fails_before_its_body_holds_up_no_other_part(ci_tier):
    import itertools
    import time

    import numpy as np

    tier = ci_tier(parallel=4)
    keys, vals, writes = _chunks(8)
    plain = tier._store_with_regions
    calls = itertools.count()

    def first_fails(s):
        if next(calls) == 0:
            raise RuntimeError("register_buffer failed")
        return plain(s)

    tier._store_with_regions = first_fails
    t0 = time.monotonic()
    ok = tier.put_many(writes)
    assert time.monotonic() - t0 < 0.5  # not the 1 s deadline: the next parts did not wait for it
    assert ok[2:] == [True] * 6
    tier._store_with_regions = plain
    assert tier.put_many(writes) == [True] * 8
    dst = [np.zeros_like(v) for v in vals]
    calls = itertools.count(-1)  # call 0 is the sizes query, call 1 part 0's read
    tier._store_with_regions = first_fails
    t0 = time.monotonic()
    got = tier.get_many_into(list(zip(keys, dst)))
    assert time.monotonic() - t0 < 0.5
    assert got[2:] == [True] * 6 and all(np.array_equal(a, b) for a, b in zip(dst[2:], vals[2:]))


@pytest.mark.slow  # opens a Mooncake client (its close: ~1 s)
def test_a_chunk_the_codec_refuses_keeps_its_stored_record(ci_tier):
    from kvtier.serde.registry import make_codec

    tier = ci_tier()
    keys, _, writes = _chunks(4)
    assert tier.put_many(writes) == [True] * 4
    assert tier.put_many_with_codec(writes, make_codec("cachegen")) == [False] * 4  # the default spec: refused
    assert tier.contains_many(keys) == [True] * 4


@pytest.mark.slow  # opens a Mooncake client (its close: ~1 s)
def test_a_key_asked_twice_in_one_get_is_read_once_and_kept(ci_tier):
    import numpy as np

    tier = ci_tier(parallel=3)
    keys, vals, writes = _chunks(2)
    assert tier.put_many(writes) == [True, True]
    dst = [np.zeros_like(vals[0]) for _ in range(2)] + [np.zeros_like(vals[1]) for _ in range(2)]
    got = tier.get_many_into([(keys[0], dst[0]), (keys[0], dst[1]), (keys[1], dst[2]), (keys[1], dst[3])])
    assert got == [True] * 4 and tier.stats()["get_corrupt"] == 0
    assert all(np.array_equal(d, vals[i // 2]) for i, d in enumerate(dst))
    assert tier.contains_many(keys) == [True, True]


@pytest.mark.slow  # waits out a 1 s deadline
def test_a_put_whose_remove_outlives_the_deadline_never_starts(ci_tier):
    """A stalled master answers part 1's remove after the call's deadline: its put must not start then
    (the caller may have returned and refilled the payload buffers)."""
    import time

    puts: list[float] = []
    t0 = time.monotonic()

    def slow_second_remove(fn, keys, force):
        if removes:
            time.sleep(1.5)
        removes.append(1)
        return fn(keys, force)

    def put(fn, *a):
        puts.append(time.monotonic() - t0)
        return fn(*a)

    removes: list[int] = []
    tier = ci_tier(hooks={"batch_remove": slow_second_remove, "batch_put_from_multi_buffers": put})
    keys, _, writes = _chunks(4)
    t0 = time.monotonic()
    assert tier.put_many(writes) == [True, True, False, False]
    time.sleep(0.3)
    assert len(puts) == 1, puts
    tier.hooks.clear()
    assert tier.contains_many(keys) == [True, True, False, False]
