"""The controller process: ZMQ endpoint thread + HTTP API (uvicorn) thread around one fleet state."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlparse

from kvtier.controller.endpoint import Endpoint
from kvtier.controller.operations import DEFAULT_OP_DEADLINE_S, FleetOps
from kvtier.controller.state import FleetState
from kvtier.hosts import is_loopback
from kvtier.protocol.fleet import DEFAULT_EXPIRY_S, DEFAULT_HEARTBEAT_S
from kvtier.protocol.trust import Credentials

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

#: Environment variable holding the bearer token (HTTP) and agent token (ZMQ ``Register.token``).
TOKEN_ENV = "KVTIER_CONTROLLER_TOKEN"
DEFAULT_HTTP_PORT = 7601
DEFAULT_ZMQ = "tcp://127.0.0.1:7600"


class ControllerConfigError(ValueError):
    """The controller cannot start as configured (e.g. non-loopback address without a token)."""


def _zmq_host(endpoint: str) -> str:
    if endpoint.startswith(("ipc://", "inproc://")):
        return "127.0.0.1"
    parsed = urlparse(endpoint)
    if parsed.scheme != "tcp" or not parsed.hostname:
        raise ControllerConfigError(f"zmq endpoint {endpoint!r} must look like tcp://HOST:PORT")
    return parsed.hostname


class Controller:
    """The fleet controller.

    Args:
        http_host / http_port: HTTP API address (port 0: any free port; see :attr:`http_url`).
        zmq_endpoint: where agents connect, e.g. ``tcp://0.0.0.0:7600`` (port 0: any free port).
        token: bearer token for HTTP and the token agents present (None: ``$KVTIER_CONTROLLER_TOKEN``;
            "" or unset: no auth, allowed only on loopback addresses).
        op_deadline_s: default deadline of one operation (seconds).
        expiry_s: silence (seconds) after which an instance is forgotten.
        credentials: the controller's key pair and the members it admits: the agent endpoint is
            CURVE and only members with the ``register`` role may connect (README, the trust model);
            None: an open agent endpoint, loopback only.
        max_keys_per_instance: most chunk keys one instance may have indexed (None: the default).

    Raises:
        ControllerConfigError: an address beyond loopback without a token (HTTP) or without
            credentials (the agent endpoint), or a bad endpoint.
    """

    def __init__(self, http_host: str = "127.0.0.1", http_port: int = DEFAULT_HTTP_PORT,
                 zmq_endpoint: str = DEFAULT_ZMQ, token: Optional[str] = None,
                 op_deadline_s: float = DEFAULT_OP_DEADLINE_S, expiry_s: float = DEFAULT_EXPIRY_S,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, credentials: Optional[Credentials] = None,
                 max_keys_per_instance: Optional[int] = None):
        self.token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        exposed = [h for h in (http_host, _zmq_host(zmq_endpoint)) if not is_loopback(h)]
        if exposed and not self.token:
            raise ControllerConfigError(
                f"refusing to listen on {', '.join(exposed)} (beyond loopback) without a token: "
                f"pass --token or set {TOKEN_ENV}")
        if not is_loopback(_zmq_host(zmq_endpoint)) and credentials is None:
            raise ControllerConfigError(
                f"refusing agents on {zmq_endpoint} (beyond loopback) without member keys: pass --key and --members "
                "(only instances whose public keys the members file lists may register; README, the trust model)")
        self.http_host = http_host
        self.http_port = http_port
        self.credentials = credentials
        self.state = FleetState(token=self.token, expiry_s=expiry_s, heartbeat_s=heartbeat_s,
                                members=credentials.members if credentials is not None else None,
                                max_keys_per_instance=max_keys_per_instance)
        self.endpoint = Endpoint(self.state, zmq_endpoint, key=credentials.key if credentials is not None else None)
        self.ops = FleetOps(self.state, self.endpoint, deadline_s=op_deadline_s)
        self._server: uvicorn.Server | None = None
        self._http_thread: Optional[threading.Thread] = None
        self._sock: Optional[socket.socket] = None

    @property
    def zmq_url(self) -> str:
        """The bound ZMQ endpoint (actual port), once started."""
        return self.endpoint.url

    @property
    def http_url(self) -> str:
        host = self.http_host if ":" not in self.http_host else f"[{self.http_host}]"
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.http_port}"

    def start(self, timeout_s: float = 10.0) -> "Controller":
        """Bind both sockets and serve; returns when the HTTP server accepts requests.

        Raises:
            OSError / zmq.ZMQError: an address cannot be bound.
            RuntimeError: uvicorn did not start within ``timeout_s``.
        """
        import uvicorn

        from kvtier.controller.api import create_app

        family = socket.AF_INET6 if ":" in self.http_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.http_host, self.http_port))
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.http_port = sock.getsockname()[1]
        try:
            self.endpoint.start()
        except Exception:
            sock.close()
            raise
        config = uvicorn.Config(create_app(self), log_level="warning", lifespan="off", access_log=False)
        server = self._server = uvicorn.Server(config)
        self._http_thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                             name="kvtier-controller-http", daemon=True)
        self._http_thread.start()
        end = time.monotonic() + timeout_s
        while not server.started:
            if not self._http_thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise RuntimeError("controller HTTP server did not start")
            time.sleep(0.01)
        log.info("kvtier controller: HTTP %s, agents %s", self.http_url, self.zmq_url)
        return self

    def stop(self) -> None:
        """Stop serving (HTTP first, then the endpoint); idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._http_thread is not None:
            self._http_thread.join(10.0)
            self._http_thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.endpoint.stop()
        self.ops.close()

    def __enter__(self) -> "Controller":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Start and block until interrupted (Ctrl-C / SIGTERM)."""
        import signal

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        try:
            while not stop.wait(0.5):
                pass
        finally:
            self.stop()
