"""The route table, the app's ASGI routes and ``/openapi.json`` agree.

The app is built (never started: no lifespan, no pool entered) and asked
through httpx's ASGI transport, so these are fast unit tests; the requests
here stop at the token guard, or reach a handler that needs nothing running.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.service import Service, create_app
from fleetroll.service.routes import ROUTES
from fleetroll.settings import load_settings
from fleetroll.telemetry.dashboard import dashboard_routes

TOKEN = "t" * 32
MAX_BODY_BYTES = 4096
DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Served by the dashboard's own routes (telemetry/dashboard.py), described in
#: docs/http-api.md, not in the API's document.
DASHBOARD_PATHS = {route.path for route in dashboard_routes(os.devnull) if isinstance(route, Route)}


@asynccontextmanager
async def built(*, token: str | None) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    """The service's app (not started) and the ``/openapi.json`` it answers."""
    settings = load_settings(service_token=token, service={"max_body_bytes": MAX_BODY_BYTES})
    app = create_app(
        Service(RolloutPool(settings, api_key="k", base_url="http://127.0.0.1:9"), settings)
    )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://127.0.0.1", headers=headers
    ) as http:
        answer = await http.get("/openapi.json")
        assert answer.status_code == 200
        yield app, answer.json()


def operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): operation
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if method != "parameters"
    }


def concrete(path: str) -> str:
    return re.sub(r"{\w+}", "x", path)


def documented_error_statuses() -> set[int]:
    text = (DOCS / "http-api.md").read_text(encoding="utf-8")
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    return {int(status) for status in re.findall(r"^\| `(\d{3})` \|", section, re.M)}


@pytest.mark.parametrize("token", [None, TOKEN], ids=["without a token", "with a token"])
async def test_every_route_of_the_app_is_in_openapi_json_with_its_methods_and_back(
    token: str | None,
) -> None:
    async with built(token=token) as (app, document):
        starlette = app.app.routes  # the Guard, then /mcp or the Starlette app
        assert isinstance(starlette, Starlette)
        served = {
            (method, route.path)
            for route in starlette.routes
            if isinstance(route, Route) and route.path not in DASHBOARD_PATHS
            for method in route.methods or ()
            if method != "HEAD"  # Starlette adds it to every GET
        }
    assert served == set(operations(document))
    assert served == {(e.method, e.path) for e in ROUTES}


@pytest.mark.parametrize("token", [None, TOKEN], ids=["without a token", "with a token"])
async def test_each_route_s_statuses_are_in_openapi_json_and_its_errors_in_the_docs(
    token: str | None,
) -> None:
    async with built(token=token) as (_, document):
        answered = operations(document)
    in_docs = documented_error_statuses()
    for e in ROUTES:
        errors = e.error_statuses(token_required=token is not None)
        assert set(e.errors) <= set(errors)
        documented = {int(s) for s in answered[e.method, e.path]["responses"]}
        assert documented == set(e.answers) | set(errors), f"{e.method} {e.path}"
        assert set(errors) <= in_docs, f"{e.method} {e.path}: add to http-api.md's Errors"


async def test_every_answer_of_the_token_guard_is_documented_on_the_routes_it_reaches() -> None:
    async with built(token=None) as (app, document):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://evil.example") as http:
            for (method, path), operation in operations(document).items():
                answer = await http.request(method, concrete(path))
                assert answer.status_code == 421, f"{method} {path}"
                assert "421" in operation["responses"], f"{method} {path}"
    async with built(token=TOKEN) as (app, document):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            for (method, path), operation in operations(document).items():
                if operation.get("security") == []:
                    continue  # open: it reaches the handler
                answer = await http.request(method, concrete(path))
                assert answer.status_code == 401, f"{method} {path}"
                assert "401" in operation["responses"], f"{method} {path}"
            http.headers["Authorization"] = f"Bearer {TOKEN}"
            for (method, path), operation in operations(document).items():
                if "requestBody" not in operation:
                    continue
                answer = await http.request(
                    method, concrete(path), content=b" " * (MAX_BODY_BYTES + 1)
                )
                assert answer.status_code == 413, f"{method} {path}"
                assert "413" in operation["responses"], f"{method} {path}"
