"""``fleetroll serve``: the HTTP service (and MCP tools) for remote training controllers.

See :mod:`fleetroll.service.app` for the routes and :mod:`fleetroll.client`
for the Python client.

Names are imported on first use: code that only needs a submodule (the
service's command uses :mod:`fleetroll.service.security`) does not
load the service, its MCP tools and the pool behind them.
"""

import typing as _typing

from fleetroll._lazy import lazy_attributes as _lazy_attributes

if _typing.TYPE_CHECKING:
    from fleetroll.service.app import Service
    from fleetroll.service.asgi import create_app
    from fleetroll.service.server import serve_app

__all__ = ["Service", "create_app", "serve_app"]

_WHERE: dict[str, str] = {
    "Service": "fleetroll.service.app",
    "create_app": "fleetroll.service.asgi",
    "serve_app": "fleetroll.service.server",
}


__getattr__ = _lazy_attributes(__name__, globals(), _WHERE)
