"""Running the router's HTTP app on uvicorn: in a background thread or the calling one."""

from __future__ import annotations

from kvtier.router.app_server import AppServer
from kvtier.router.config import RouterConfig
from kvtier.router.router import Router
from kvtier.router.tokenize import Tokenizer


class RouterServer(AppServer):
    """Run the router on uvicorn in a background thread (tests, benchmarks, the CLI).

    Args:
        config: the router configuration.
        tokenizer: the model's tokenizer (``None`` with ``config.model`` set: loaded from it).
        host, port: where to listen (port 0: any free port; see :attr:`url`).
    """

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None,
                 host: str = "127.0.0.1", port: int = 8100) -> None:
        if tokenizer is None and config.model:
            from kvtier.router.tokenize import load_tokenizer

            tokenizer = load_tokenizer(config.model)
        from kvtier.router.app import create_app

        self.router = Router(config, tokenizer)
        super().__init__(create_app(self.router), host, port, "kvtier router")
