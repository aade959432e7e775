"""The kvtier dashboard: a web page (and ``kvtier top``) over a server's or controller's metrics.

Served at ``/`` on the cache server's metrics port (:class:`ServerDashboard` +
:class:`DashboardRoutes`, mounted by :mod:`kvtier.service.http`) and on the controller's
HTTP port (:func:`kvtier.dashboard.fastapi_routes.mount_dashboard`, mounted by
:mod:`kvtier.controller.api`). The data is read from the registry ``/metrics`` renders
(:mod:`.samples`); charts use uPlot (MIT, vendored in ``static/vendor`` with its license).

Layering: this package imports only the standard library, ``prometheus_client`` and
(``fastapi_routes``, ``controller_view``) FastAPI, numpy and lower kvtier layers; the
service and the controller import it, never the reverse. Who may read a dashboard (the
service's token as a bearer token or a session cookie, loopback ``Host`` names without one,
bounded event streams) is :mod:`.access`.
"""

from kvtier.dashboard.hot import HotChain, HotPrefixes
from kvtier.dashboard.server_view import ServerDashboard
from kvtier.dashboard.source import DashboardSource
from kvtier.dashboard.stdlib_routes import DashboardRoutes

__all__ = ["DashboardRoutes", "DashboardSource", "HotChain", "HotPrefixes", "ServerDashboard"]
