"""ZeroMQ CURVE for the fleet (:mod:`kvtier.protocol.trust`): server and client options, the ZAP gate
that admits current members with a role, the authenticated key of each message, and message bounds.

CURVE (RFC 26, CurveZMQ) is libzmq's own, on libsodium; the ZAP handler is pyzmq's
:class:`zmq.auth.thread.ThreadAuthenticator` with a callback that consults the members table at every
handshake. Keys are checked at connect only: a node that must cut a revoked member off an open
session does so itself (the controller per message; the event publisher by rebinding).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # trust.py re-exports this module: no import cycle at run time
    from kvtier.protocol.trust import FleetKey, Members

#: Largest message any socket kvtier binds accepts from a peer (libzmq drops the connection beyond it).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


def bound_messages(sock: Any, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
    """Set ``ZMQ_MAXMSGSIZE`` on ``sock``: a peer announcing a larger message is disconnected before
    libzmq allocates it."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes))


def curve_server(sock: Any, key: FleetKey, domain: str) -> None:
    """Make ``sock`` a CURVE server with ``key``; clients are admitted by the ZAP handler of ``domain``
    (a :class:`CurveGate` started on the socket's context before ``bind``)."""
    import zmq

    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, key.secret.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, key.public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def curve_client(sock: Any, key: FleetKey, server_public: str) -> None:
    """Make ``sock`` a CURVE client with ``key`` that only talks to a server holding ``server_public``.

    Raises:
        TrustError: ``server_public`` is not a Z85 public key.
    """
    import zmq

    from kvtier.protocol.trust import check_public_key

    check_public_key(server_public, "server public key")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, key.public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SECRETKEY, key.secret.encode("ascii"))


def sender_key(frame: Any) -> str:
    """The Z85 public key a message came from on a CURVE socket (its ``User-Id`` property, set by
    :class:`CurveGate`), or "" (no CURVE: the frame has none). ``frame`` is a ``zmq.Frame``
    (receive with ``copy=False``)."""
    try:
        uid = frame.get("User-Id")
    except Exception:  # noqa: BLE001 - no metadata on a plain socket
        return ""
    return uid if isinstance(uid, str) else ""


class CurveGate:
    """The ZAP handler of one ZeroMQ context: admits CURVE clients that are current members with a role.

    One per context (libzmq has one ZAP endpoint per context); each socket names its ``domain``
    (:func:`curve_server`), and each domain has its role: ``gate.allow(domain, role)``.
    Built on pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator` (its own thread); the User-Id of
    an admitted connection is its Z85 public key.

    Args:
        ctx: the ``zmq.Context`` whose sockets it guards.
        members: who may connect.
    """

    def __init__(self, ctx: Any, members: Members):
        from zmq.auth.thread import ThreadAuthenticator

        self.members = members
        self.denied = 0
        self.admitted = 0
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvtier.zap"))
        self._started = False

    def allow(self, domain: str, role: str) -> "CurveGate":
        """Admit members holding ``role`` on sockets of ``domain``."""
        gate = self

        class _Provider:
            def callback(self, _domain: str, key: bytes) -> bool:
                public = key.decode("ascii") if isinstance(key, bytes) else str(key)
                ok = gate.members.admits(public, role)
                if ok:
                    gate.admitted += 1
                else:
                    gate.denied += 1
                return ok

        self._auth.configure_curve_callback(domain, _Provider())
        return self

    def start(self) -> "CurveGate":
        if not self._started:
            self._auth.start()
            self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            self._auth.stop()
            self._started = False
