"""Running the router's HTTP app on uvicorn: in a background thread or the calling one."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from kvtier.router.config import RouterConfig
from kvtier.router.router import Router
from kvtier.router.tokenize import Tokenizer


class RouterServer:
    """Run the router on uvicorn in a background thread (tests, benchmarks, the CLI).

    Args:
        config: the router configuration.
        tokenizer: the model's tokenizer (``None`` with ``config.model`` set: loaded from it).
        host, port: where to listen (port 0: any free port; see :attr:`url`).
    """

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None,
                 host: str = "127.0.0.1", port: int = 8100) -> None:
        import uvicorn

        if tokenizer is None and config.model:
            from kvtier.router.tokenize import load_tokenizer

            tokenizer = load_tokenizer(config.model)
        from kvtier.router.app import create_app

        self.router = Router(config, tokenizer)
        self.app = create_app(self.router)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                     timeout_graceful_shutdown=2))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` where the router listens."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterServer:
        """Start serving; returns once the app is up.

        Raises:
            RuntimeError: it did not start within ``timeout_s``.
        """
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="kvtier-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("kvtier router did not start")
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

    def __enter__(self) -> RouterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
