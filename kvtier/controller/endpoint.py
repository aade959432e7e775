"""The controller's ZMQ endpoint: one ``ROUTER`` socket served by one thread.

Every frame from an agent is decoded with :func:`kvtier.protocol.fleet.decode_agent_message`;
a malformed frame (or one that does not fit: unknown tier, bad key lists) is dropped and
counted (``malformed_frames``), never fatal. ``Register``/``Heartbeat`` get an ``Ack``.

Identity (issue 24, kind 1): the ROUTER assigns each connection its routing id (agents set
none; ``ROUTER_HANDOVER`` is off, so no connection can take over another's pipe), and with
credentials the socket is a CURVE server whose ZAP handler admits only current members with the
``register`` role; each message's authenticated key comes with it (``User-Id``). Which record a
connection may speak for is :meth:`kvtier.controller.registry.InstanceRegistry.owner`. Every
message is at most :data:`~kvtier.protocol.fleet.MAX_MESSAGE_BYTES` (``ZMQ_MAXMSGSIZE``: a larger
one disconnects its sender before libzmq allocates it).
:meth:`Endpoint.request` sends an ``OpRequest`` from any thread and returns a future the
matching ``OpResult`` resolves; it fails with :class:`InstanceOpError` when the instance is
unknown, unreachable, drops out, or does not answer before the deadline.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from kvtier.controller.registry import Sender
from kvtier.controller.state import FleetState
from kvtier.protocol.fleet import (
    MAX_MESSAGE_BYTES,
    FleetProtocolError,
    OpRequest,
    OpResult,
    decode_agent_message,
    encode,
)
from kvtier.protocol.trust import CurveGate, FleetKey, bound_messages, curve_server, sender_key

#: ZAP domain of the agent endpoint.
ZAP_DOMAIN = "kvtier-agents"

log = logging.getLogger(__name__)

#: Seconds between expiry/deadline sweeps.
SWEEP_S = 0.05


class InstanceOpError(RuntimeError):
    """An instance operation did not complete; ``str()`` is the reason."""


@dataclass
class _Waiting:
    instance: str
    future: Future
    deadline: float  # time.monotonic()
    timeout_s: float


class Endpoint:
    """ROUTER socket thread.

    Args:
        state: the fleet state messages are applied to.
        bind: ZMQ endpoint to bind, e.g. ``tcp://127.0.0.1:7600`` (port 0 or ``*``: any free port).
        poll_s: longest wait for a frame before outgoing requests and sweeps run (seconds).
        key: the controller's key pair: the socket is a CURVE server admitting the members of
            ``state.registry.members`` with the ``register`` role; None: plain (loopback only).
    """

    def __init__(self, state: FleetState, bind: str, poll_s: float = 0.005, key: FleetKey | None = None):
        self.state = state
        self.key = key
        self.gate: CurveGate | None = None
        self._bind = bind[:-2] + ":*" if bind.endswith(":0") else bind
        self._poll_ms = max(1, int(poll_s * 1000))
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes, str]] = queue.SimpleQueue()
        self._waiting: dict[str, _Waiting] = {}
        self._wlock = threading.Lock()
        self.url = ""
        state.on_drop.append(self._instance_dropped)

    def start(self) -> None:
        """Bind and start the thread.

        Raises:
            zmq.ZMQError: the address cannot be bound (in use, bad address).
        """
        self._ctx = zmq.Context()
        members = self.state.registry.members
        if self.key is not None and members is not None:
            self.gate = CurveGate(self._ctx, members).allow(ZAP_DOMAIN, "register").start()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a connection claiming a live routing id never takes its pipe over.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to an unconnected id raises
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 100000)
        bound_messages(sock, MAX_MESSAGE_BYTES)
        if self.gate is not None and self.key is not None:
            curve_server(sock, self.key, ZAP_DOMAIN)
        try:
            sock.bind(self._bind)
        except zmq.ZMQError:
            sock.close(0)
            if self.gate is not None:
                self.gate.stop()
            self._ctx.term()
            raise
        self.url = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="kvtier-controller-zmq", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, fail every waiting request, close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._wlock:
            waiting, self._waiting = self._waiting, {}
        for w in waiting.values():
            _fail(w.future, "controller stopped")
        if self._sock is not None:
            self._sock.close(0)
        if self.gate is not None:
            self.gate.stop()
            self.gate = None
        if self._ctx is not None:
            self._ctx.term()
        self._sock = None
        self._ctx = None

    # -- requests -----------------------------------------------------------------

    def request(self, instance: str, op: str, namespace: bytes, args: dict[str, Any], timeout_s: float) -> Future:
        """Send ``op`` to ``instance``; a future of its :class:`OpResult`.

        The future fails with :class:`InstanceOpError` (the reason names the instance) if the
        instance is not registered, is not connected, expires, or does not answer within
        ``timeout_s`` seconds.
        """
        fut: Future = Future()
        with self.state.lock:
            rec = self.state.registry.get(instance)
            routing_id = rec.routing_id if rec is not None else b""
        if rec is None:
            _fail(fut, f"unknown instance {instance!r} (not registered or expired)")
            return fut
        op_id = os.urandom(8).hex()
        # A duration, never an absolute time: the instance's clock may differ from this one.
        msg = OpRequest(op_id=op_id, op=op, namespace=namespace, args=args, timeout_s=timeout_s)
        with self._wlock:
            self._waiting[op_id] = _Waiting(instance, fut, time.monotonic() + timeout_s, timeout_s)
        self._outbox.put((routing_id, encode(msg), op_id))
        return fut

    def _instance_dropped(self, instance: str) -> None:
        with self._wlock:
            gone = [k for k, w in self._waiting.items() if w.instance == instance]
            waits = [self._waiting.pop(k) for k in gone]
        for w in waits:
            _fail(w.future, f"instance {instance!r} went away (expired or restarted) before answering")

    # -- thread -------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        next_sweep = 0.0
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(self._poll_ms))
                if sock in events:
                    for _ in range(1000):  # bounded burst, then serve the outbox
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(sock, frames)
                self._send_outbox(sock)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    self.state.sweep(now)
                    self._expire_waiting(now)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.warning("controller endpoint: %s", exc)
            except Exception:  # noqa: BLE001 - keep serving the fleet
                log.exception("controller endpoint: unexpected error")

    def _on_frames(self, sock: zmq.Socket, frames: list[Any]) -> None:
        if len(frames) == 2:
            ident_frame, payload_frame = frames
        elif len(frames) == 3 and len(frames[1].bytes) == 0:
            ident_frame, _, payload_frame = frames
        else:
            self.state.count("malformed_frames")
            return
        identity = ident_frame.bytes
        payload = payload_frame.bytes
        sender = Sender(identity, sender_key(payload_frame) if self.gate is not None else "")
        try:
            msg = decode_agent_message(payload)
            if isinstance(msg, OpResult):
                self._route_result(sender, msg)
            reply = self.state.handle(sender, msg, size=len(payload))
        except FleetProtocolError as exc:
            self.state.count("malformed_frames")
            log.debug("controller endpoint: dropped frame from %r: %s", identity[:64], exc)
            return
        if reply is not None:
            try:
                sock.send_multipart([identity, encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("controller endpoint: ack to %r not sent: %s", identity[:64], exc)

    def _route_result(self, sender: Sender, msg: OpResult) -> None:
        """Resolve the waiting request ``msg`` answers, if ``sender`` speaks for its instance."""
        with self._wlock:
            w = self._waiting.get(msg.op_id)
        if w is None:
            return
        with self.state.lock:
            rec = self.state.registry.get(w.instance)
            if rec is None or rec.routing_id != sender.routing_id or (rec.member_key and rec.member_key != sender.key):
                return  # an answer from a connection that does not speak for the instance
            rec.last_seen = time.monotonic()
        with self._wlock:
            if self._waiting.pop(msg.op_id, None) is None:
                return
        if not w.future.done():
            w.future.set_result(msg)

    def _send_outbox(self, sock: zmq.Socket) -> None:
        while True:
            try:
                identity, payload, op_id = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                sock.send_multipart([identity, payload], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                with self._wlock:
                    w = self._waiting.pop(op_id, None)
                if w is not None:
                    reason = ("is not connected" if exc.errno == zmq.EHOSTUNREACH else f"could not be sent to: {exc}")
                    _fail(w.future, f"instance {w.instance!r} {reason}")

    def _expire_waiting(self, now: float) -> None:
        with self._wlock:
            late = [k for k, w in self._waiting.items() if now >= w.deadline]
            waits = [self._waiting.pop(k) for k in late]
        for w in waits:
            _fail(w.future, f"timeout: instance {w.instance!r} did not answer within {w.timeout_s:g} s")


def _fail(fut: Future, reason: str) -> None:
    if not fut.done():
        fut.set_exception(InstanceOpError(reason))
