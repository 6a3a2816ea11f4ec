"""The service's ASGI app: the routes of :data:`~fleetroll.service.routes.ROUTES`
over a :class:`~fleetroll.service.app.Service`, MCP tools at ``/mcp`` and the
dashboard, behind the token :class:`~fleetroll._internal.guard.Guard`.

Apart from :mod:`fleetroll.service.app` so that the routes (which call the
service) and the service (which knows nothing of HTTP routes) import no
module that imports them back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from fleetroll._internal.guard import Guard
from fleetroll.service.app import Service
from fleetroll.service.openapi import openapi_document
from fleetroll.service.routes import ROUTES, Api, asgi_routes
from fleetroll.telemetry.dashboard import PAGE_PATHS, dashboard_panels, dashboard_routes
from fleetroll.telemetry.dashboard_auth import cookie_authorizer

__all__ = ["create_app"]


def create_app(service: Service) -> ASGIApp:
    """The service's ASGI app: routes, MCP tools at ``/mcp``, behind the :class:`Guard`."""
    from fleetroll.service.mcp_tools import build_mcp_server, mcp_app

    mcp = build_mcp_server(service)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with service.running(), mcp.session_manager.run():
            yield

    s = service.settings
    dashboard = dashboard_routes(
        s.telemetry.db_path,
        query_timeout_s=s.service.query_timeout_s,
        # Its own threads: an open dashboard never takes a /v1/query slot.
        panels=dashboard_panels(s.telemetry),
        gauges=lambda: asdict(service.pool.admission.state()),
        token=s.service_token,
    )
    try:
        app_version = version("fleetroll")
    except PackageNotFoundError:  # a source tree without installed metadata
        app_version = "0"
    document = openapi_document(version=app_version, token_required=s.service_token is not None)
    api = Api(service, document)
    routes = Starlette(routes=[*asgi_routes(api), *dashboard], lifespan=lifespan)
    return Guard(
        _Root(routes, mcp_app(mcp)),
        token=service.settings.service_token,
        max_body_bytes=service.settings.service.max_body_bytes,
        # The dashboard's page holds no data; it sends the token.
        open_paths={*(e.path for e in ROUTES if not e.auth), *PAGE_PATHS},
        also_authorized=cookie_authorizer(s.service_token),  # the dashboard's login cookie
    )


class _Root:
    """``/mcp`` (and ``/mcp/``) to the MCP app, every other path to ``routes``."""

    def __init__(self, routes: Starlette, mcp: ASGIApp) -> None:
        self.routes = routes
        self.mcp = mcp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in ("/mcp", "/mcp/"):
            scope = dict(scope, path="/mcp", raw_path=b"/mcp")
            await self.mcp(scope, receive, send)
        else:
            await self.routes(scope, receive, send)
