"""Running an ASGI app (the router's, the PD proxy's) on uvicorn: in a background thread
(tests, benchmarks) or the calling one (the CLI)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Self


class AppServer:
    """An ASGI app on uvicorn, bound at construction (port 0: any free port, see :attr:`url`).

    Args:
        app: the ASGI application.
        host, port: where to listen.
        name: thread name and the subject of start errors (``kvtier router``).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, app: Any, host: str, port: int, name: str) -> None:
        import uvicorn

        self.app = app
        self.name = name
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                     timeout_graceful_shutdown=2))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` where the app listens."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Self:
        """Serve in a background thread; returns once the app is up.

        Raises:
            RuntimeError: it did not start within ``timeout_s``.
        """
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=self.name.replace(" ", "-"), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start")
            time.sleep(0.02)
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until interrupted."""
        self._server.run(sockets=[self._sock])

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (idempotent)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        """Same as :meth:`stop`."""
        self.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
