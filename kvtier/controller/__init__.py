"""The fleet controller (``kvtier controller``): one API that sees and steers every instance's cache.

Layers, lowest first: :mod:`.registry` (instances, namespace specs), :mod:`.index` (who holds
which chunk keys), :mod:`.state` (both behind one lock, the agent-message logic),
:mod:`.endpoint` (ZMQ ROUTER thread), :mod:`.errors`, :mod:`.tracker` (async op records),
:mod:`.op_context` (what every op shares), :mod:`.ops_lookup` / :mod:`.ops_cache` /
:mod:`.ops_move` (the fleet ops), :mod:`.operations` (the :class:`FleetOps` facade),
:mod:`.api` (FastAPI app), :mod:`.server` (:class:`Controller`), :mod:`.client` (HTTP client).
Importing this package imports neither FastAPI nor ZMQ.
"""

from __future__ import annotations

__all__ = ["Controller", "ControllerConfigError", "namespace_from_spec"]


def __getattr__(name: str):  # lazy: the optional 'controller' extra is imported only when used
    if name in ("Controller", "ControllerConfigError"):
        from kvtier.controller import server

        return getattr(server, name)
    if name == "namespace_from_spec":
        from kvtier.controller.registry import namespace_from_spec

        return namespace_from_spec
    raise AttributeError(name)
