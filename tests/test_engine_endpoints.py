"""One lookup endpoint per engine instance, and no process removes a socket it did not create (issue 23, item 10).

Failing inputs: engines with ``engine_id`` "e" and "e", "a.b" and "ab", or ids equal in their
first 64 characters shared one socket name (a sanitised, cut id): the second did not start
("another kvtier server is listening"), and one that started while the first was between
``bind()`` and ``listen()`` unlinked the first one's socket, so the first engine's scheduler got
the second's answers. In one process the two also shared one storage manager (the registry was
keyed by engine id).
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from fake_vllm import make_kv_caches, make_vllm_config
from kvtier.integrations.vllm.modes import engine_instance, open_scheduler_index
from kvtier.protocol import unix_socket
from kvtier.service.lookup_endpoint import LookupClient, socket_path
from kvtier.protocol.unix_socket import bind_unix
from test_connector_lifecycle import CHUNK, GEOM, extra_config, tokens_of

ID_PAIRS = [("e", "e"), ("a.b", "ab"), ("x" * 64 + "-one", "x" * 64 + "-two")]


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = Path("/tmp") / f"kvt-ep-{uuid.uuid4().hex[:8]}"  # short: AF_UNIX paths are <= 107 bytes
    d.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def _worker(engine_id: str, instance_id: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = make_vllm_config(GEOM, extra_config(cpu_chunks=8), engine_id)
    cfg.instance_id = instance_id  # vLLM's per-config id (a time_ns reading in vLLM 0.32)
    conn = KVTierConnector(cfg, KVConnectorRole.WORKER, None)
    conn.register_kv_caches(make_kv_caches(GEOM, "stacked"))
    return cfg, conn


@pytest.mark.parametrize(("id_a", "id_b"), ID_PAIRS, ids=["same", "dot", "long"])
def test_engines_whose_ids_collide_each_start_and_answer_for_themselves(runtime_dir: Path, id_a: str,
                                                                         id_b: str) -> None:
    cfg_a, a = _worker(id_a, "1000001")
    cfg_b, b = _worker(id_b, "1000002")  # raised "another kvtier server is listening" before
    try:
        assert a.manager is not b.manager
        prompt_a, prompt_b = tokens_of(1, 3 * CHUNK + 1), tokens_of(2, 3 * CHUNK + 1)
        for conn, prompt in ((a, prompt_a), (b, prompt_b)):
            m = conn.manager
            keys = m.keys(prompt)[:3]
            for i, key in enumerate(keys):
                buf = m.open_write(key, keys[i - 1] if i else None)
                buf[:] = 7
                m.commit(key, keys[i - 1] if i else None)
        keys_a, keys_b = a.manager.keys(prompt_a)[:3], b.manager.keys(prompt_b)[:3]
        inst_a, inst_b = engine_instance(id_a, cfg_a), engine_instance(id_b, cfg_b)
        assert socket_path(inst_a) != socket_path(inst_b)
        # The RPC path (scheduler in another process): each socket answers for its own engine.
        for inst, mine, other in ((inst_a, keys_a, keys_b), (inst_b, keys_b, keys_a)):
            client = LookupClient(socket_path(inst), CHUNK, timeout_s=2.0)
            try:
                assert client.lookup_keys(mine, None).num_tokens == 3 * CHUNK
                assert client.lookup_keys(other, None).num_tokens == 0
            finally:
                client.close()
        # The in-process path (vLLM's in-process engine core): the registry gives each its own.
        cfg = a.config
        assert open_scheduler_index(cfg, a.namespace, id_a, inst_a) is a.manager
        assert open_scheduler_index(cfg, b.namespace, id_b, inst_b) is b.manager
    finally:
        a.shutdown()
        b.shutdown()
    assert not list(runtime_dir.glob("kvtier-lookup-*")), list(runtime_dir.iterdir())


def test_socket_name_is_a_digest_of_the_whole_instance_name(runtime_dir: Path) -> None:
    names = {os.path.basename(socket_path(f"{i}\x00{j}\x00dp0")) for i, j in [("a.b", "1"), ("ab", "1"), ("e", "1"),
                                                                              ("e", "2"), ("x" * 200, "1")]}
    assert len(names) == 5
    assert all(n.startswith("kvtier-lookup-") and len(n) == len("kvtier-lookup-") + 32 + len(".sock") for n in names)
    assert os.path.dirname(socket_path("e")) == str(runtime_dir)


@pytest.mark.parametrize("replace_stale", [True, False], ids=["server-path", "lookup-endpoint"])
def test_a_second_binder_never_unlinks_a_socket_between_bind_and_listen(runtime_dir: Path, monkeypatch,
                                                                       replace_stale: bool) -> None:
    """A is paused between bind() and listen() (connect() is refused there, as from a dead
    server's file); B starts on the same path. B must refuse and leave A's socket, which then
    serves A's clients."""
    path = str(runtime_dir / "race.sock")
    in_window, release = threading.Event(), threading.Event()
    real_listen = unix_socket._listen

    def paused_listen(sock: socket.socket) -> None:
        if threading.current_thread().name == "binder-a":
            in_window.set()
            assert release.wait(30)
        real_listen(sock)

    monkeypatch.setattr(unix_socket, "_listen", paused_listen)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.setdefault("a", bind_unix(path, replace_stale)), name="binder-a")
    t.start()
    try:
        assert in_window.wait(30)
        ino = os.lstat(path).st_ino
        with pytest.raises(RuntimeError):
            bind_unix(path, replace_stale)
        assert os.lstat(path).st_ino == ino, "B replaced A's socket"
    finally:
        release.set()
        t.join(30)
    a = got["a"]
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)  # reaches A
        conn, _ = a.sock.accept()
        conn.close()
        c.close()
    finally:
        a.remove()
        a.sock.close()
    assert not os.path.lexists(path)


def test_close_leaves_a_socket_another_process_put_at_the_path(runtime_dir: Path) -> None:
    path = str(runtime_dir / "mine.sock")
    a = bind_unix(path, replace_stale=False)
    a.sock.close()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path + ".new")
    os.rename(path + ".new", path)  # another process's socket now has the name
    try:
        a.remove()
        assert os.path.lexists(path) and os.lstat(path).st_ino == os.stat(path).st_ino
    finally:
        other.close()
        os.unlink(path)


def test_a_dead_servers_stale_socket_is_still_replaced(runtime_dir: Path) -> None:
    """The server's fixed path: a socket file whose creator is gone (its lock is free, nothing
    answers) is replaced, as before."""
    path = str(runtime_dir / "srv.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nothing listens: a crashed server's
    b = bind_unix(path)
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        c.close()
    finally:
        b.remove()
        b.sock.close()
    with pytest.raises(RuntimeError):  # the lookup endpoint never replaces a file
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)
        stale.close()
        bind_unix(path, replace_stale=False)
    os.unlink(path)


def test_shm_transfer_listener_is_bound_the_same_way(runtime_dir: Path, monkeypatch) -> None:
    """The same defect in the P2P shm:// listener (a peer's transfer address): it probed, unlinked
    on a refused connect (a listener between bind and listen) and unlinked its path at close."""
    import errno

    from kvtier.transfer.shm_listener import ShmListener

    path = str(runtime_dir / "peer.sock")
    in_window, release = threading.Event(), threading.Event()
    real_listen = unix_socket._listen

    def paused_listen(sock: socket.socket) -> None:
        if threading.current_thread().name == "listener-a":
            in_window.set()
            assert release.wait(30)
        real_listen(sock)

    monkeypatch.setattr(unix_socket, "_listen", paused_listen)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.setdefault("a", ShmListener(path, timeout_s=2)), name="listener-a")
    t.start()
    try:
        assert in_window.wait(30)
        ino = os.lstat(path).st_ino
        with pytest.raises(OSError) as exc:
            ShmListener(path, timeout_s=2)
        assert exc.value.errno == errno.EADDRINUSE and os.lstat(path).st_ino == ino
    finally:
        release.set()
        t.join(30)
    a = got["a"]
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path + ".new")
    os.rename(path + ".new", path)  # another process now owns the name
    a.close()
    assert os.path.lexists(path)
    other.close()
    os.unlink(path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a killed peer's socket: replaced, as before
    b = ShmListener(path, timeout_s=2)
    b.close()
    assert not os.path.lexists(path)
