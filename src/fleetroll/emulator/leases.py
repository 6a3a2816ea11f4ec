"""Browser leases: a browser apart from the instance, for browser_use's lease flow.

The reference runs browser_use two ways: a sidecar on the instance (the
aggregator's ``computer`` tool), or a browser leased separately and pointed at
the environment's UI. This is the second, on the control plane's key:

* ``POST /v1/browser/leases`` ``{"instance_id", "ttl_seconds"}``: a lease,
  ``status: "starting"``, with its ``mcp_url``;
* ``POST /v1/browser/leases/{id}/navigate`` ``{"url"}``: open a URL (it must
  be one of the instance's ``urls.app``);
* ``GET /v1/browser/leases/{id}/health``: 200 ``healthy`` once it shows the
  environment's UI and the instance runs, else 503;
* ``DELETE /v1/browser/leases/{id}``: the lease is gone (404 after);
* ``/browser-leases/{id}/mcp``: the browser's MCP server (the ``computer``
  tool over the instance's screen).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetroll.emulator.faults import FaultInjector
from fleetroll.emulator.instances import InstanceStore

__all__ = ["BrowserLease", "BrowserLeases"]

_MCP_PREFIX = "/browser-leases/"


@dataclass(slots=True)
class BrowserLease:
    lease_id: str
    instance_id: str
    ttl_s: float | None
    url: str | None = None
    #: Never turns healthy (``p_browser_lease_unhealthy``).
    broken: bool = False

    def to_response(self, base_url: str, status: str) -> dict[str, object]:
        return {
            "lease_id": self.lease_id,
            "instance_id": self.instance_id,
            "status": status,
            "url": self.url,
            "ttl_seconds": self.ttl_s,
            "mcp_url": f"{base_url}{_MCP_PREFIX}{self.lease_id}/mcp",
        }


class BrowserLeases:
    """The lease routes; :attr:`open` holds the leases not yet deleted."""

    def __init__(
        self,
        store: InstanceStore,
        *,
        authorized: Callable[[Request], bool],
        unauthorized: Callable[[], Response],
        base_url: Callable[[], str],
        faults: FaultInjector,
    ) -> None:
        self._store = store
        self._faults = faults
        self._authorized = authorized
        self._unauthorized = unauthorized
        self._base_url = base_url
        self.open: dict[str, BrowserLease] = {}
        self.created = 0
        #: MCP requests served through a lease's URL.
        self.served = 0
        self._ids = itertools.count(1)

    def routes(self) -> list[Route]:
        base = "/v1/browser/leases"
        return [
            Route(base, self.create, methods=["POST"]),
            Route(base + "/{lease_id}/navigate", self.navigate, methods=["POST"]),
            Route(base + "/{lease_id}/health", self.health, methods=["GET"]),
            Route(base + "/{lease_id}", self.delete, methods=["DELETE"]),
        ]

    @staticmethod
    def match(path: str) -> str | None:
        """The lease id when ``path`` is a lease's MCP path."""
        if not path.startswith(_MCP_PREFIX):
            return None
        lease_id, _, rest = path[len(_MCP_PREFIX) :].partition("/")
        return lease_id if rest.rstrip("/") == "mcp" else None

    def instance_of(self, lease_id: str) -> str | None:
        """The leased instance, for an MCP request through the lease (counted)."""
        lease = self.open.get(lease_id)
        if lease is None:
            return None
        self.served += 1
        return lease.instance_id

    async def create(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        body = await request.json()
        instance_id = body.get("instance_id") if isinstance(body, dict) else None
        inst = self._store.get(instance_id) if isinstance(instance_id, str) else None
        if inst is None or not inst.alive:
            return _error(404, f"Instance '{instance_id}' not found")
        ttl = body.get("ttl_seconds")
        lease = BrowserLease(
            f"lease-{next(self._ids):06d}",
            inst.instance_id,
            float(ttl) if isinstance(ttl, int | float) else None,
            broken=self._faults.chance(self._faults.profile.p_browser_lease_unhealthy),
        )
        self.open[lease.lease_id] = lease
        self.created += 1
        return JSONResponse(lease.to_response(self._base_url(), "starting"), 201)

    async def navigate(self, request: Request) -> Response:
        lease = self._lease(request)
        if isinstance(lease, Response):
            return lease
        body = await request.json()
        url = body.get("url") if isinstance(body, dict) else None
        inst = self._store.get(lease.instance_id)
        apps = inst.to_response(self._base_url())["urls"]["app"] if inst else []
        if url not in apps:
            return _error(400, f"cannot navigate to {url!r}: not the environment's UI")
        lease.url = url
        return JSONResponse(lease.to_response(self._base_url(), "ready"))

    async def health(self, request: Request) -> Response:
        lease = self._lease(request)
        if isinstance(lease, Response):
            return lease
        inst = self._store.get(lease.instance_id)
        healthy = lease.url is not None and inst is not None and inst.alive and not lease.broken
        status = "healthy" if healthy else "unhealthy"
        return JSONResponse(lease.to_response(self._base_url(), status), 200 if healthy else 503)

    async def delete(self, request: Request) -> Response:
        lease = self._lease(request)
        if isinstance(lease, Response):
            return lease
        del self.open[lease.lease_id]
        return JSONResponse(lease.to_response(self._base_url(), "deleted"))

    def _lease(self, request: Request) -> BrowserLease | Response:
        if not self._authorized(request):
            return self._unauthorized()
        lease_id = request.path_params["lease_id"]
        lease = self.open.get(lease_id)
        if lease is None:
            return _error(404, f"Browser lease '{lease_id}' not found")
        return lease


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status)
