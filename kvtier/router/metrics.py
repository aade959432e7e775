"""The router's Prometheus metrics, in a private registry (one per :class:`~kvtier.router.router.Router`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    """Counters and gauges of one router, registered in :attr:`registry` (not the global one).

    Token counts are tokens; ``load`` is the load term in tokens.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_router_requests", "Requests forwarded per backend",
                                ["backend", "endpoint"], registry=r)
        self.decisions = Counter("kvtier_router_decisions", "Routing decisions by reason",
                                 ["policy", "reason"], registry=r)
        self.hit_tokens = Counter("kvtier_router_predicted_hit_tokens", "Predicted cached prompt tokens of routed requests",
                                  ["backend"], registry=r)
        self.prompt_tokens = Counter("kvtier_router_prompt_tokens", "Prompt tokens of routed requests",
                                     ["backend"], registry=r)
        self.retries = Counter("kvtier_router_retries", "Requests retried on another backend", registry=r)
        self.cut = Counter("kvtier_router_answers_cut", "Answers a backend cut after their first bytes",
                           ["backend"], registry=r)
        self.failures = Counter("kvtier_router_backend_failures", "Requests a backend failed", ["backend"], registry=r)
        self.refused = Counter("kvtier_router_refused", "Requests refused before routing, by status "
                               "(400 bad body or prompt beyond the context, 413 body too large, 429 too much work)",
                               ["status"], registry=r)
        self.untokenized = Counter("kvtier_router_untokenized", "Requests routed without token ids", registry=r)
        self.healthy = Gauge("kvtier_router_backend_healthy", "1 while the backend is in the pool", ["backend"],
                             registry=r)
        self.load = Gauge("kvtier_router_backend_load_tokens", "Load term per backend (tokens)", ["backend"],
                          registry=r)
        self.blocks = Gauge("kvtier_router_index_blocks", "Blocks the prefix index holds per backend", ["backend"],
                            registry=r)
