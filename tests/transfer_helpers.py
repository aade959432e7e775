"""Helpers shared by the peer-tier and P2P storage tests."""

from __future__ import annotations

import numpy as np

from conftest import payload_for, small_namespace
from kvtier.storage.manager import StorageManager

#: Bytes of one chunk in :func:`conftest.small_namespace`.
CB = small_namespace().chunk_bytes


def store_chain(mgr: StorageManager, tokens: list[int]) -> list[bytes]:
    """Write and commit every chunk key of ``tokens`` in ``mgr`` (payload: ``payload_for(key, CB)``); the keys."""
    keys = mgr.keys(tokens)
    parent = None
    for k in keys:
        buf = mgr.open_write(k, parent)
        assert buf is not None
        buf[:] = payload_for(k, CB)
        mgr.commit(k, parent)
        parent = k
    return keys


def read_chain(mgr: Any, keys: list[bytes]) -> list[np.ndarray | None]:
    """Open ``keys`` as one chain through ``mgr`` (a storage manager or a ``kvtier server`` client); a copy of each payload (None for a miss), handles closed."""
    handles = mgr.open_read_many([(k, keys[i - 1] if i else None) for i, k in enumerate(keys)])
    try:
        return [None if h is None else np.array(h.buffer) for h in handles]
    finally:
        for h in handles:
            if h is not None:
                h.close()


# -- real peer processes (tests/test_transfer_fault_matrix.py) ---------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

#: The child process of :class:`PeerProcess`. ``serve URL NCHUNKS FAULT``: a StorageManager listening for
#: peers on URL that holds the chain of ``range(NCHUNKS * CHUNK + 1)``; ``pull URL NCHUNKS FAULT TIMEOUT``:
#: a StorageManager whose only lower tier is the peer at URL, pulling that chain once. Faults are injected
#: into the real channel code path: ``kill_send:K`` SIGKILLs the sender at its K-th chunk frame (TCP: after
#: half that payload), ``abort_send:K`` closes the sender's channel there, ``corrupt:K`` sends the K-th frame
#: with a wrong checksum, ``truncate:K`` (TCP) sends half the K-th payload and closes, ``slow_send:S`` waits
#: S seconds before answering a get, ``kill_recv:K`` SIGKILLs the receiver when its K-th chunk arrives.
#: Commands on stdin: ``stats`` (one JSON line of the manager's stats), ``quit``.
PEER_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from conftest import CHUNK, payload_for, small_namespace
    from transfer_helpers import CB, store_chain
    from kvtier.config import KVTierConfig
    from kvtier.transfer.assembly import open_manager
    from kvtier.transfer import channel as channel_mod, frames, stream
    role, url, nchunks, fault = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    kind, _, arg = fault.partition(":")
    seen = [0]
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    if kind in ("kill_send", "abort_send", "corrupt", "truncate"):
        orig = stream.StreamChannel._send_views
        def send_views(self, views, deadline, fds=()):
            head = bytes(views[0][:4096]) if views else b""
            if head[:4] == frames.MAGIC and isinstance(frames.decode_header(head[8:]), frames.Chunk):
                seen[0] += 1
                if seen[0] == int(arg):
                    payload = memoryview(views[1])[: len(views[1]) // 2] if len(views) > 1 else None
                    if kind == "kill_send":
                        if payload is not None:
                            orig(self, [views[0], payload], deadline)
                        die()
                    if kind == "abort_send":
                        self.close()
                        raise channel_mod.TransferError("sender aborted the transfer")
                    if kind == "truncate" and payload is not None:
                        orig(self, [views[0], payload], deadline)
                        self.close()
                        raise channel_mod.TransferError("sender truncated the transfer")
                    if kind == "corrupt":
                        c = frames.decode_header(head[8:])
                        bad = frames.Chunk(index=c.index, key=c.key, nbytes=c.nbytes,
                                           checksum=bytes(b ^ 0xFF for b in c.checksum),
                                           segment_id=c.segment_id, offset=c.offset)
                        views = [frames.encode_frame(bad), *views[1:]]
            return orig(self, views, deadline, fds)
        stream.StreamChannel._send_views = send_views
    if kind == "kill_recv":
        orig_slot = channel_mod.TransferChannel._slot_for
        def slot_for(self, *a):
            seen[0] += 1
            if seen[0] == int(arg):
                die()
            return orig_slot(self, *a)
        channel_mod.TransferChannel._slot_for = slot_for
    tokens = list(range(nchunks * CHUNK + 1))
    cfg = dict(chunk_size=CHUNK, cpu_capacity=64 * CB)
    if not url.startswith("shm://"):  # TCP peers authenticate (issue 24): the test fleet's keys, a serves, b pulls
        cfg.update(json.loads(os.environ["TEST_PEER_KEYS"])["a" if role == "serve" else "b"])
    if role == "serve":
        m = open_manager(KVTierConfig(peer_listen=url, peer_timeout_s=5.0, **cfg), small_namespace())
        store_chain(m, tokens)
        if kind == "slow_send":
            real = m.open_read_many
            m.open_read_many = lambda items: (time.sleep(float(arg)), real(items))[1]
        print(json.dumps({"url": m.peer_server.url}), flush=True)
    else:
        m = open_manager(KVTierConfig(peers=[url], peer_timeout_s=float(sys.argv[6]), peer_retry_s=60.0, **cfg),
                           small_namespace())
        keys = m.keys(tokens)
        t0 = time.monotonic()
        handles = m.open_read_many([(k, None) for k in keys])
        elapsed = time.monotonic() - t0
        equal = [h is not None and bool(np.array_equal(h.buffer, payload_for(k, CB))) for k, h in zip(keys, handles)]
        hits = [h is not None for h in handles]
        for h in handles:
            if h is not None:
                h.close()
        print(json.dumps({"hits": hits, "equal": equal, "elapsed": elapsed}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            s = m.stats()
            m.check_invariants()
            conns = m.peer_server.connections if getattr(m, "peer_server", None) is not None else 0
            print(json.dumps({**{k: s[k] for k in ("referenced_chunks", "leases", "pinned_chunks", "cpu_chunks")},
                              "connections": conns}), flush=True)
        elif line.strip() == "quit":
            break
    m.close()
""")


class PeerProcess:
    """A :data:`PEER_CHILD` process; :meth:`first` is its first JSON line (``serve``: ``{"url"}``;
    ``pull``: ``{"hits", "equal", "elapsed"}``), or None if it died first.

    Args:
        role: ``"serve"`` or ``"pull"``. url: the peer URL to listen on / pull from.
        nchunks: chunks of the chain. fault: see :data:`PEER_CHILD` (``"none"``). timeout_s: (pull) peer timeout.
    """

    def __init__(self, role: str, url: str, nchunks: int, fault: str = "none", timeout_s: float = 2.0):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER_CHILD, str(Path(__file__).parent), role, url, str(nchunks), fault,
             str(timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        self.first: dict[str, Any] | None = json.loads(line) if line.strip() else None

    def stats(self) -> dict[str, Any]:
        """The child's manager stats (``referenced_chunks``, ``leases``, ``pinned_chunks``, ``cpu_chunks``,
        ``connections``) after its invariants were checked.

        Raises:
            AssertionError: the child is gone or its invariants are broken.
        """
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.strip(), "peer child gave no stats (died, or its invariants failed)"
        return json.loads(line)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """Ask the child to close its manager and exit (killed after 20 s)."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


def peer_keys(url: str, who: str) -> dict[str, Any]:
    """Fleet key settings of test member ``who`` (``a`` serves, ``b`` pulls) for a TCP ``url`` (from
    ``TEST_PEER_KEYS``, set by the test module's fixture); none for ``shm://``."""
    if url.startswith("shm://"):
        return {}
    return dict(json.loads(os.environ["TEST_PEER_KEYS"])[who])
