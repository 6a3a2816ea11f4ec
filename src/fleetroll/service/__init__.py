"""``fleetroll serve``: the HTTP service (and MCP tools) for remote training controllers.

See :mod:`fleetroll.service.app` for the routes and :mod:`fleetroll.client`
for the Python client.
"""

from fleetroll.service.app import Service, create_app
from fleetroll.service.server import serve_app

__all__ = ["Service", "create_app", "serve_app"]
