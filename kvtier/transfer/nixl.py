"""The optional NIXL transfer channel (NVIDIA NIXL, UCX backend; CPU to CPU here).

Control frames (hello, agent metadata, batch/chunk frames, acks) go over TCP as in
:mod:`kvtier.transfer.tcp`; payloads do not. The sender registers its payload memory with
its NIXL agent (once per region) and sends each chunk's address, size and xxh3-64, frame
by frame; the receiver posts a NIXL READ straight into the destination as each frame
arrives (reads overlap the sender's hashing and the checks of earlier chunks), checks
each checksum, then acks the batch. Registrations last until :meth:`NixlChannel.close`:
reuse destination buffers (engine slots, a pool).

Install: ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`` (extra ``nixl``; the CPU
path needs neither CUDA nor torch); without it constructors raise ``ChannelUnavailable``.
A READ still running at the timeout is released (NIXL aborts it) and the call raises
:class:`TransferTimeout`; treat those destinations as unspecified (as after any False).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections import deque
from typing import Any, Sequence

import xxhash

from kvtier.transfer.channel import (
    DEFAULT_TIMEOUT_S,
    Deadline,
    InSlot,
    OutChunk,
    buffer_address,
    check_in_slots,
    check_out_chunks,
    payload_digest,
)
from kvtier.transfer.errors import (
    ChannelUnavailable,
    PeerGone,
    ProtocolError,
    TransferError,
)
from kvtier.transfer.frames import (
    Batch,
    BatchAck,
    Chunk,
    Message,
    Metadata,
    encode_frame,
)
from kvtier.transfer.stream import StreamChannel
from kvtier.transfer.tcp import dial_tcp, tune_tcp


def nixl_agent_class() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` classes.

    Raises:
        ChannelUnavailable: NIXL is not installed or does not load here.
    """
    # NIXL logs every agent and backend creation at INFO on stdout (its Python logger and its
    # C++ one both read NIXL_LOG_LEVEL when first loaded); a user's own setting is kept.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, or a native library that fails to load
        raise ChannelUnavailable(f"NIXL is not installed or does not load ({exc}): "
                                 "pip install 'kvtier[nixl]'") from None
    return nixl_agent, nixl_agent_config


class NixlChannel(StreamChannel):
    """One end of a NIXL transfer link: control over TCP, payloads by NIXL READ (see module docstring).

    Args:
        sock: connected TCP socket for the control frames (owned from now on).
        timeout_s: default bound of each call, seconds.

    Raises:
        ChannelUnavailable: NIXL is missing or its UCX backend cannot start.
    """

    kind = "nixl"

    def __init__(self, sock: socket.socket, timeout_s: float = DEFAULT_TIMEOUT_S):
        agent_cls, config_cls = nixl_agent_class()
        tune_tcp(sock)
        super().__init__(sock, timeout_s)
        try:
            self._agent = agent_cls(f"kvtier-{os.getpid()}-{uuid.uuid4().hex[:12]}", config_cls(backends=["UCX"]))
        except Exception as exc:
            sock.close()
            raise ChannelUnavailable(f"NIXL's UCX backend cannot start here: {exc}") from None
        self._peer = ""
        #: ``(destination, peer address)`` of the last batch read (benches replay it with :meth:`read_raw`).
        self.last_sources: list[tuple[memoryview, int]] = []
        self._regions: list[tuple[int, int, Any]] = []  # (address, size, registration), kept until close

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S, auth: Any = None) -> "NixlChannel":
        """Dial a :class:`NixlListener`, exchange hellos and NIXL agent metadata.

        Raises:
            ChannelUnavailable: NIXL missing. TransferError: cannot connect, or the handshake failed.
        """
        nixl_agent_class()
        chan = cls(dial_tcp(host, port, timeout_s, "nixl"), timeout_s)
        chan.handshake(auth=auth)
        return chan

    def handshake(self, timeout_s: float | None = None, auth: Any = None) -> None:
        """Hellos (authenticated with ``auth``, see :meth:`StreamChannel.handshake`), then each end's
        NIXL agent metadata (a control frame each way)."""
        super().handshake(timeout_s, auth)
        self.exchange_metadata(timeout_s)

    def exchange_metadata(self, timeout_s: float | None = None) -> None:
        """Send this end's NIXL agent metadata and add the peer's (a control frame each way).

        Raises:
            TransferError: timeout, the peer gone, or metadata NIXL refuses.
        """
        self.send_control(self._agent.get_agent_metadata(), timeout_s)
        meta = self.recv_control(timeout_s)
        try:
            self._peer = self._agent.add_remote_agent(meta)
        except Exception as exc:
            raise self._fail(ProtocolError(f"bad NIXL agent metadata from the peer: {exc}")) from None

    def _register(self, mv: memoryview) -> Any:
        """Register ``mv``'s memory with the NIXL agent unless a registered region holds it;
        returns the new registration (None if none was needed)."""
        a, n = buffer_address(mv), len(mv)
        if n == 0 or any(base <= a and a + n <= base + size for base, size, _ in self._regions):
            return None
        reg = self._agent.register_memory([(a, n, 0, "")], "DRAM")
        self._regions.append((a, n, reg))
        return reg

    def register_region(self, buf: Any, timeout_s: float | None = None) -> None:
        """Register a whole buffer (e.g. a pool) once and tell the peer, so chunks inside it
        need no registration when sent.

        Raises:
            TransferError: timeout or the peer gone.
        """
        reg = self._register(memoryview(buf).cast("B"))
        if reg is not None:
            self._announce([reg], self._deadline(timeout_s))

    def _announce(self, regs: list[Any], deadline: Deadline) -> None:
        """Send the peer the NIXL metadata of new registrations (it can read them afterwards)."""
        for reg in regs:
            meta = self._agent.get_partial_agent_metadata(reg, False)
            self._send_views([encode_frame(Metadata(body=meta))], deadline)

    def _recv_msg(self, deadline: Deadline) -> Message:
        while True:
            msg = super()._recv_msg(deadline)
            if not isinstance(msg, Metadata):
                return msg
            try:
                self._agent.add_remote_agent(msg.body)
            except Exception as exc:
                raise ProtocolError(f"bad NIXL metadata from the peer: {exc}") from None

    def send(self, chunks: Sequence[OutChunk], timeout_s: float | None = None) -> list[bool]:
        """See :meth:`TransferChannel.send`; the peer reads the payloads from this process's memory."""
        items = check_out_chunks(chunks)
        deadline = self._deadline(timeout_s)
        batch_id = self._begin_batch()
        try:
            self._announce([r for r in (self._register(mv) for _, mv, _ in items) if r is not None], deadline)
            self._send_views([encode_frame(Batch(batch_id=batch_id, count=len(items)))], deadline)
            for i, (key, mv, given) in enumerate(items):  # frame by frame: the peer reads chunk i while we hash i+1
                self._send_views([encode_frame(Chunk(index=i, key=key, nbytes=len(mv), checksum=payload_digest(mv, given),
                                                     segment_id=0, offset=buffer_address(mv)))], deadline)
            ack = self._recv_batch_ack(batch_id, len(items), deadline)
        except (OSError, TransferError) as exc:
            raise self._fail(exc) from None
        except Exception as exc:  # a NIXL registration failure
            raise self._fail(TransferError(f"nixl send failed: {exc}")) from None
        self._count_sent(items, ack.received)
        return list(ack.received)

    def recv_into(self, dests: Sequence[InSlot], timeout_s: float | None = None) -> list[bool]:
        """See :meth:`TransferChannel.recv_into`: one NIXL READ per chunk, posted as its frame
        arrives, so reads overlap the sender's hashing and this side's checks of earlier chunks."""
        views, index = check_in_slots(dests)
        deadline = self._deadline(timeout_s)
        result = [False] * len(views)
        pending: deque[tuple[Any, int, Chunk]] = deque()
        try:
            batch = self._recv_batch(deadline)
            verdict = [False] * batch.count
            self.last_sources = []
            for expect in range(batch.count):
                chunk = self._recv_chunk(batch, expect, deadline)
                i = self._slot_for(chunk.key, chunk.nbytes, views, index)
                if i is not None and chunk.nbytes:
                    self.last_sources.append((views[i], chunk.offset))
                    pending.append((self._post([(views[i], chunk.offset)]), i, chunk))
                while pending and self._state(pending[0][0]) == "DONE":
                    self._check(pending.popleft(), views, result, verdict)
            while pending:
                self._wait(pending[0][0], deadline)
                self._check(pending.popleft(), views, result, verdict)
            self._send_views([encode_frame(BatchAck(batch_id=batch.batch_id, received=verdict))], deadline)
        except (OSError, TransferError) as exc:
            raise self._fail(exc, received=result) from None
        finally:
            for handle, _, _ in pending:  # aborted: release (NIXL cancels what is still running)
                self._release(handle)
        return result

    def _check(self, done: tuple[Any, int, Chunk], views: list[memoryview], result: list[bool],
               verdict: list[bool]) -> None:
        handle, i, chunk = done
        self._release(handle)
        ok = xxhash.xxh3_64_digest(views[i]) == chunk.checksum
        result[i] = verdict[chunk.index] = ok
        self._count_received(ok, chunk.nbytes)

    def _post(self, pairs: Sequence[tuple[memoryview, int]]) -> Any:
        """Start one NIXL READ of each ``(destination view, peer address)``; returns its handle.

        Raises:
            PeerGone: NIXL refuses (the peer is gone, or its memory is not registered).
        """
        for mv, _ in pairs:
            self._register(mv)
        local = self._agent.get_xfer_descs([(buffer_address(mv), len(mv), 0) for mv, _ in pairs], "DRAM")
        remote = self._agent.get_xfer_descs([(addr, len(mv), 0) for mv, addr in pairs], "DRAM")
        try:
            handle = self._agent.initialize_xfer("READ", local, remote, self._peer)
        except Exception as exc:
            raise PeerGone(f"nixl cannot read from the peer: {exc}") from None
        try:
            if self._agent.transfer(handle) == "ERR":
                raise PeerGone("nixl transfer failed (the peer died or its memory is not registered)")
        except TransferError:
            self._release(handle)
            raise
        except Exception as exc:  # NIXL's own errors, e.g. NIXL_ERR_REMOTE_DISCONNECT
            self._release(handle)
            raise PeerGone(f"nixl transfer failed: {exc}") from None
        return handle

    def _state(self, handle: Any) -> str:
        try:
            state: str = self._agent.check_xfer_state(handle)
        except Exception as exc:
            raise PeerGone(f"nixl transfer failed: {exc}") from None
        if state == "ERR":
            raise PeerGone("nixl transfer failed (the peer died or its memory is not registered)")
        return state

    def _wait(self, handle: Any, deadline: Deadline) -> None:
        """Poll until ``handle`` is done, sleeping a little longer each time (20 us up to 1 ms):
        NIXL's UCX progress thread moves the data, and a busy poll here would take the core it
        and the peer's progress thread need (2-core machines).

        Raises:
            TransferTimeout: ``deadline`` passed. PeerGone: NIXL reports an error.
        """
        delay = 20e-6
        while self._state(handle) != "DONE":
            time.sleep(min(delay, deadline.remaining()))
            delay = min(delay * 2, 1e-3)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass

    def read_raw(self, pairs: Sequence[tuple[memoryview, int]], deadline: Deadline) -> None:
        """One NIXL READ of all ``(destination view, peer address)`` pairs, no frames, no checksums
        (what the bench measures as NIXL's own transfer).

        Raises:
            TransferTimeout: not done before ``deadline``. PeerGone: NIXL reports an error.
        """
        if not pairs:
            return
        handle = self._post(pairs)
        try:
            self._wait(handle, deadline)
        finally:
            self._release(handle)

    def close(self) -> None:
        super().close()
        regions, self._regions = self._regions, []
        for _, _, reg in regions:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
