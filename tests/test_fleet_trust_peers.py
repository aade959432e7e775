"""Issue 24, kind 3 ("peers serve anyone"): a peer server serves authenticated fleet members only.

Each test is one hostile input from the issue (or another input of the same kind): a stranger pulling
chunks, a fake peer server, silent and idle connections, a member outside its models or salts, a
revoked member. Loopback sockets, ports 0, bounded polls.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from transfer_helpers import CB, store_chain
from kvtier.config import KVTierConfig
from kvtier.protocol.trust import Credentials, FleetKey, Member, Members
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager
from conftest import wait_until
from kvtier.transfer.errors import PeerRefused, TransferError
from kvtier.transfer.peer_auth import ClientAuth
from kvtier.transfer.peer_open import UrlPeerTier
from kvtier.transfer.peer_tier import PeerTier
from kvtier.transfer.tcp import TcpChannel


def _manager(**kw: object) -> StorageManager:
    return open_manager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB, peer_timeout_s=2.0, **kw),
                          small_namespace())


@pytest.fixture
def serving(fleet):
    """A (member ``a``) serving a 4-chunk chain over TCP; its keys."""
    a = _manager(peer_listen="tcp://127.0.0.1:0", **fleet.config("a"))
    keys = store_chain(a, list(range(4 * CHUNK)))
    yield a, keys
    a.close()


def _address(a: StorageManager) -> tuple[str, int]:
    host, port = a.peer_server.url.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _pull(tier: PeerTier, keys: list[bytes]) -> list[bool]:
    outs = [np.zeros(CB, np.uint8) for _ in keys]
    got = tier.get_many_into(list(zip(keys, outs)))
    for k, o, ok in zip(keys, outs, got):
        if ok:
            assert np.array_equal(o, payload_for(k, CB))
    return got


def test_a_member_pulls_byte_exact(serving, fleet) -> None:
    a, keys = serving
    tier = UrlPeerTier(a.peer_server.url, timeout_s=2.0, credentials=fleet.credentials("b"))
    try:
        assert _pull(tier, keys) == [True] * 4
    finally:
        tier.close()


def test_a_stranger_without_a_key_gets_nothing(serving) -> None:
    """The issue's input: a stranger dials peer_listen and asks for tenant A's keys."""
    a, keys = serving
    with pytest.raises(PeerRefused, match="fleet members only"):
        TcpChannel.connect(*_address(a), timeout_s=2.0)  # the plain hello of an unauthenticated client
    with pytest.raises(ValueError, match="fleet credentials"):
        UrlPeerTier(a.peer_server.url)  # kvtier itself never dials TCP peers without keys
    wait_until(lambda: a.peer_server.counters["refused"] >= 1, 5.0)
    assert a.peer_server.connections == 0


@pytest.mark.slow
def test_a_key_not_in_the_members_file_is_refused(serving, fleet) -> None:
    a, keys = serving
    stranger = FleetKey.generate("stranger")
    creds = Credentials(stranger, Members.of(Member("a", fleet.public("a"))))  # it trusts A; A does not list it
    with pytest.raises(PeerRefused, match="not a fleet member with the peer role here"):
        TcpChannel.connect(*_address(a), timeout_s=2.0, auth=ClientAuth(creds))
    fleet.set_options("c", "roles=register,events")  # a member without the peer role
    wait_until(lambda: _refused(a, fleet.credentials("c")), 5.0)


def _refused(a: StorageManager, creds: Credentials) -> bool:
    try:
        TcpChannel.connect(*_address(a), timeout_s=2.0, auth=ClientAuth(creds)).close()
    except PeerRefused:
        return True
    return False


def test_claiming_a_members_key_without_its_secret_is_refused(serving, fleet) -> None:
    """The public keys are public (members files, /instances): presenting one proves nothing. A hand-made
    client names member b's key and sends a made-up proof, then a request: nothing is answered."""
    import os

    from kvtier.transfer.frames import PREFIX, Control, Hello, Proof, decode_header, encode_frame
    from kvtier.transfer.peer_auth import _ephemeral

    a, keys = serving
    s = socket.create_connection(_address(a), timeout=2.0)
    try:
        _, eph = _ephemeral()
        s.sendall(encode_frame(Hello(kind="tcp", key=FleetKey(fleet.public("b"), "").public_raw, eph=eph)))
        head = s.recv(PREFIX.size, socket.MSG_WAITALL)
        body = s.recv(PREFIX.unpack(head)[1], socket.MSG_WAITALL)
        assert isinstance(decode_header(body), Hello)  # b is a member: the server answers, proving its own key
        s.sendall(encode_frame(Proof(mac=os.urandom(32))))
        s.sendall(encode_frame(Control(body=b"\x82\xa2op\xa8contains\xa4keys\x91\xc4\x20" + keys[0])))
        rest = b""
        try:
            while chunk := s.recv(65536):
                rest += chunk
        except ConnectionResetError:  # closed with our request unread
            pass
        assert b"found" not in rest  # no answer (a Refused frame, then the close)
    finally:
        s.close()
    assert a.peer_server.counters["requests"] == 0 and a.peer_server.connections == 0


def test_a_fake_peer_server_is_not_believed(fleet, tmp_path) -> None:
    """Poisoning from the other side: a stranger's server at a peer URL serves chosen bytes with a right
    checksum; the member's peer tier refuses it before asking for anything."""
    from kvtier.testing.fleet_keys import make_fleet

    other = make_fleet(tmp_path / "strangers", ["evil"])
    other.keys["b"] = FleetKey(fleet.public("b"), "", "b")  # public keys are public: it admits b gladly
    other.write()
    evil = _manager(peer_listen="tcp://127.0.0.1:0", **other.config("evil"))
    keys = store_chain(evil, list(range(2 * CHUNK)))
    tier = UrlPeerTier(evil.peer_server.url, timeout_s=2.0, credentials=fleet.credentials("b"))
    try:
        assert _pull(tier, keys) == [False, False]
        assert tier.stats()["errors"] >= 1
        assert evil.peer_server.counters["requests"] == 0
    finally:
        tier.close()
        evil.close()


def test_an_expected_key_pins_the_server(serving, fleet) -> None:
    a, keys = serving
    wrong = UrlPeerTier(a.peer_server.url, timeout_s=2.0, credentials=fleet.credentials("b"), expect=fleet.public("c"))
    right = UrlPeerTier(a.peer_server.url, timeout_s=2.0, credentials=fleet.credentials("b"), expect=fleet.public("a"))
    try:
        assert _pull(wrong, keys[:1]) == [False]
        assert _pull(right, keys[:1]) == [True]
    finally:
        wrong.close()
        right.close()


def _silent(address: tuple[str, int], n: int) -> list[socket.socket]:
    return [socket.create_connection(address, timeout=2.0) for _ in range(n)]


def test_silent_connections_do_not_lock_real_peers_out(serving, fleet) -> None:
    """The issue's input: 20 connections that never say hello; then 100 (beyond the pending bound)."""
    a, keys = serving
    for n in (20, 100):
        held = _silent(_address(a), n)
        try:
            tier = UrlPeerTier(a.peer_server.url, timeout_s=1.0, credentials=fleet.credentials("b"))
            t0 = time.monotonic()
            assert _pull(tier, keys) == [True] * 4
            assert time.monotonic() - t0 < 1.0  # a hang guard: served while the silent ones wait
            tier.close()
            assert a.peer_server.pending <= a.peer_server.max_pending
        finally:
            for s in held:
                s.close()
    assert a.peer_server.counters["pending_evicted"] >= 100 - a.peer_server.max_pending


def test_a_silent_connection_is_closed_after_the_handshake_deadline(serving) -> None:
    a, _ = serving
    a.peer_server.handshake_s = 0.2
    (s,) = _silent(_address(a), 1)
    try:
        wait_until(lambda: a.peer_server.counters["handshake_timeouts"] >= 1, 5.0)
        s.settimeout(2.0)
        assert s.recv(1) == b""  # closed by the server
    finally:
        s.close()


@pytest.mark.slow
def test_idle_connections_hold_no_threads(serving, fleet) -> None:
    """The issue's input: 200 idle connections held 200 threads in the engine process. Now: 150 silent
    ones and 50 authenticated idle links cost no thread each, and a real pull still works."""
    a, keys = serving
    before = threading.active_count()
    held = _silent(_address(a), 150)
    links = [TcpChannel.connect(*_address(a), timeout_s=2.0, auth=ClientAuth(fleet.credentials("c")))
             for _ in range(12)]
    links += [TcpChannel.connect(*_address(a), timeout_s=2.0, auth=ClientAuth(fleet.credentials("b")))
              for _ in range(12)]
    try:
        wait_until(lambda: a.peer_server.connections == 24, 5.0)
        assert threading.active_count() - before <= 4  # the worker pool, started on demand
        tier = UrlPeerTier(a.peer_server.url, timeout_s=1.0, credentials=fleet.credentials("a"))
        assert _pull(tier, keys) == [True] * 4
        tier.close()
        assert threading.active_count() - before <= a.peer_server._pool._max_workers
    finally:
        for s in held:
            s.close()
        for c in links:
            c.close()


def test_links_per_member_are_bounded(serving, fleet) -> None:
    a, keys = serving
    cap = a.peer_server.max_per_member
    links = [TcpChannel.connect(*_address(a), timeout_s=2.0, auth=ClientAuth(fleet.credentials("c")))
             for _ in range(cap)]
    try:
        wait_until(lambda: a.peer_server.connections == cap, 5.0)
        with pytest.raises(TransferError):
            extra = TcpChannel.connect(*_address(a), timeout_s=2.0, auth=ClientAuth(fleet.credentials("c")))
            extra.recv_control(2.0)  # the server's Refused frame, then its close
        tier = UrlPeerTier(a.peer_server.url, timeout_s=1.0, credentials=fleet.credentials("b"))  # another member
        assert _pull(tier, keys) == [True] * 4
        tier.close()
    finally:
        for c in links:
            c.close()


@pytest.mark.parametrize("stall", ["half_a_request", "no_ack"])
def test_a_stalling_member_cannot_take_every_worker(serving, fleet, stall: str) -> None:
    """A member (here one restricted to another model, so it may read nothing) opens 8 links and on
    each sends half a request frame, or a whole ``get`` whose batch it never acknowledges: each
    holds a worker for the server's ``timeout_s``. With every worker held, another member's pull
    missed (all 4 chunks, after its 1 s timeout); now one member's requests hold at most half the
    pool, and the other member's pull is served."""
    import msgspec

    from kvtier.transfer.frames import MAGIC, PREFIX
    from kvtier.transfer.peer_wire import PeerRequest

    a, keys = serving
    fleet.set_options("c", "models=test/other-*")  # the stall needs no read access
    links = [TcpChannel.connect(*_address(a), timeout_s=2.0, auth=ClientAuth(fleet.credentials("c")))
             for _ in range(8)]
    try:
        for c in links:
            if stall == "half_a_request":
                c._sock.sendall(PREFIX.pack(MAGIC, 100))  # a request frame's prefix, then nothing
            else:
                c.send_control(msgspec.msgpack.encode(PeerRequest(op="get", keys=keys[:1])))
        wait_until(lambda: a.peer_server.counters["deferred"] >= 1, 5.0)
        tier = UrlPeerTier(a.peer_server.url, timeout_s=1.0, credentials=fleet.credentials("b"))
        assert _pull(tier, keys) == [True] * 4
        tier.close()
    finally:
        for c in links:
            c.close()


@pytest.mark.slow
def test_a_member_gets_only_its_models(fleet) -> None:
    fleet.set_options("b", "models=test/other-*")
    a = _manager(peer_listen="tcp://127.0.0.1:0", **fleet.config("a"))
    keys = store_chain(a, list(range(3 * CHUNK)))
    tier = UrlPeerTier(a.peer_server.url, timeout_s=2.0, credentials=fleet.credentials("b"))
    try:
        assert tier.contains_many(keys) == [False] * 3
        assert _pull(tier, keys) == [False] * 3
        assert a.peer_server.counters["keys_refused"] >= 6
        fleet.set_options("b", "models=test/tiny-*")  # the operator widens it: no restart (re-read within 1 s)
        wait_until(lambda: _pull(tier, keys) == [True] * 3, 5.0)
    finally:
        tier.close()
        a.close()


@pytest.mark.slow
def test_a_member_gets_only_its_salts(fleet) -> None:
    """Salted chains (tenant isolation): a member allowed tenant t1 pulls t1's chains, not t2's nor unsalted."""
    fleet.set_options("b", "salts=t1")
    a = _manager(peer_listen="tcp://127.0.0.1:0", **fleet.config("a"))
    tokens = list(range(3 * CHUNK))
    chains = {}
    for salt in ("t1", "t2", None):
        ks = a.keys(tokens, cache_salt=salt)
        parent = a.hasher.lineage(salt)
        for k in ks:
            buf = a.open_write(k, parent)
            buf[:] = payload_for(k, CB)
            a.commit(k, parent)
            parent = k
        chains[salt] = ks
    tier = UrlPeerTier(a.peer_server.url, timeout_s=2.0, credentials=fleet.credentials("b"))
    try:
        assert _pull(tier, chains["t1"]) == [True] * 3
        assert _pull(tier, chains["t2"]) == [False] * 3
        assert _pull(tier, chains[None]) == [False] * 3
        fleet.set_options("b", "salts=t1,-")
        wait_until(lambda: _pull(tier, chains[None]) == [True] * 3, 5.0)
    finally:
        tier.close()
        a.close()


@pytest.mark.slow
def test_a_revoked_member_is_cut_off(serving, fleet) -> None:
    a, keys = serving
    tier = UrlPeerTier(a.peer_server.url, timeout_s=1.0, retry_s=0.05, credentials=fleet.credentials("b"))
    try:
        assert _pull(tier, keys[:1]) == [True]
        fleet.revoke("b")  # removing its line: no restart; re-read within 1 s
        wait_until(lambda: _pull(tier, keys[1:2]) == [False], 5.0)  # its open link is closed at a request
        wait_until(lambda: a.peer_server.connections == 0, 5.0)
        time.sleep(0.1)  # past the tier's retry_s
        assert _pull(tier, keys[1:2]) == [False]  # and a new link is refused
        assert a.peer_server.connections == 0
    finally:
        tier.close()


def test_shared_memory_peers_need_no_keys_but_the_same_user(tmp_path) -> None:
    """Tokenless P2P stays possible over shm:// only: the socket is 0600 and both ends check the uid."""
    import os
    import stat

    url = f"shm://{tmp_path}/a.sock"
    a = _manager(peer_listen=url)
    keys = store_chain(a, list(range(2 * CHUNK)))
    tier = UrlPeerTier(url, timeout_s=2.0)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "a.sock").st_mode) == 0o600
        assert _pull(tier, keys) == [True, True]
    finally:
        tier.close()
        a.close()


# -- the KV event stream (kind 3: a stranger subscribed and collected tenant A's chunk keys) ---------------

def _events(pub, sub, n: int = 40, timeout_s: float = 3.0) -> int:
    """Publish ``n`` one-event batches while polling ``sub``; batches it received."""
    from kvtier.events.schema import BlockStored

    got = 0
    end = time.monotonic() + timeout_s
    i = 0
    while time.monotonic() < end and got < n:
        if i < n:
            pub.publish([BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[1], block_size=1,
                                     lora_id=None, medium="CPU", lora_name=None)])
            i += 1
        if sub.poll(0.05) is not None:
            got += 1
    return got


@pytest.mark.slow
def test_a_keyed_event_stream_is_read_by_members_with_the_events_role_only(fleet) -> None:
    from kvtier.events.publisher import EventPublisher
    from kvtier.events.subscriber import EventSubscriber

    fleet.set_options("c", "roles=peer")  # a member, but not an event reader
    pub = EventPublisher("tcp://127.0.0.1:0", credentials=fleet.credentials("a"), topic="kv")
    member = EventSubscriber(pub.endpoint, topic="kv", credentials=fleet.credentials("b"), server_key=pub.public_key)
    plain = EventSubscriber(pub.endpoint, topic="kv")  # the stranger: a plain SUB
    stranger = EventSubscriber(pub.endpoint, topic="kv", credentials=Credentials(FleetKey.generate(), Members.of()),
                               server_key=pub.public_key)
    no_role = EventSubscriber(pub.endpoint, topic="kv", credentials=fleet.credentials("c"), server_key=pub.public_key)
    try:
        wait_until(lambda: _events(pub, member, n=1, timeout_s=0.2) > 0, 10, "the member's join")
        assert [_events(pub, s, n=10, timeout_s=0.5) for s in (plain, stranger, no_role)] == [0, 0, 0]
        fleet.revoke("b")  # a revoked reader is cut off: the publisher rebinds, its reconnect is refused
        wait_until(lambda: pub.rebinds >= 1, 5.0)
        time.sleep(0.3)
        while member.poll(0.05) is not None:  # what it had queued before it was revoked
            pass
        assert _events(pub, member, n=10, timeout_s=1.0) == 0
    finally:
        for s in (member, plain, stranger, no_role):
            s.close()
        pub.close()


def test_event_streams_are_owner_only_or_refused(tmp_path) -> None:
    import os
    import stat

    from kvtier.events.publisher import EventPublisher

    with pytest.raises(ValueError, match="kv_events_plain"):
        EventPublisher("tcp://127.0.0.1:0")
    pub = EventPublisher(f"ipc://{tmp_path}/ev.sock", replay_endpoint=f"ipc://{tmp_path}/rp.sock")
    try:
        for name in ("ev.sock", "rp.sock"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    finally:
        pub.close()
    EventPublisher("tcp://127.0.0.1:0", plain=True).close()  # vLLM-compatible, when asked for
