"""``kvtier router``: an OpenAI-compatible, KV-aware HTTP proxy in front of N vLLM instances.

It tokenizes each prompt with the model's tokenizer (:mod:`.tokenize`), asks where its prefix
is cached (the backends' KV events, :mod:`.prefix_index`, and optionally the fleet
controller's ``/lookup``), and picks the backend with the best cached-prefix score net of a
load term (:mod:`.load`, :mod:`.scoring`). Unhealthy backends leave the pool within seconds
(:mod:`.pool`). :mod:`.router` decides and records, :mod:`.forward` forwards (streaming,
one retry), :mod:`.app` is the HTTP app, :mod:`.server` runs it; configuration is :mod:`.config`.

Modules import FastAPI/httpx lazily where they can, so ``import kvtier.router`` is cheap.
"""

from __future__ import annotations

from kvtier.router.config import (
    POLICIES,
    BackendSpec,
    RouterConfig,
    RouterConfigError,
    Weights,
    parse_backend,
)

__all__ = ["POLICIES", "BackendSpec", "RouterConfig", "RouterConfigError", "Weights", "parse_backend"]
