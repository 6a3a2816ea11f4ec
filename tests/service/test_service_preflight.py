"""The service checks a batch before accepting it: a typo is one 422, not a batch of failures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client
from service_helpers import FAST, LEDGER, running_service, task_record
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetroll._internal.preflight_cache import PreflightCache
from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.errors import PreflightError, ServiceError
from fleetroll.pool.preflight import check_endpoint
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.service import Service, create_app, serve_app
from fleetroll.settings import load_settings


def creates(emu: Emulator) -> int:
    ledger = emu.ledger.snapshot()
    return int(ledger["created"]) + sum(ledger["creates_by_outcome"].values())


def listings(emu: Emulator) -> int:
    return int(emu.ledger.snapshot()["env_listings"])


def typo(version: str = "v9") -> dict[str, Any]:
    """The first shipped ledger task, naming a version the emulator does not have."""
    record = task_record(LEDGER[0])
    record["env_key"] = f"{LEDGER[0].env_key}:{version}"
    return record


@dataclass
class ModelsEndpoint:
    base_url: str
    hits: list[str] = field(default_factory=list)


@asynccontextmanager
async def models_endpoint() -> AsyncIterator[ModelsEndpoint]:
    """An OpenAI-compatible ``/v1/models`` on loopback, counting what it is asked."""
    endpoint = ModelsEndpoint("")

    async def models(request: Request) -> Response:
        endpoint.hits.append(request.url.path)
        return JSONResponse({"object": "list", "data": []})

    app = Starlette(routes=[Route("/v1/models", models)])
    async with serve_app(app, "127.0.0.1", 0) as url:
        endpoint.base_url = f"{url}/v1"
        yield endpoint


# -- unit: the cache ------------------------------------------------------------------


def test_a_kept_value_is_fresh_until_its_ttl_and_a_ttl_of_0_keeps_nothing() -> None:
    now = [100.0]
    cache = PreflightCache[bool](30.0, clock=lambda: now[0])
    off = PreflightCache[bool](0.0, clock=lambda: now[0])

    cache.put("k", True)
    off.put("k", True)
    fresh = cache.get("k")
    now[0] += 30.0

    assert fresh is True and cache.get("k") is None and off.get("k") is None


async def test_a_policy_endpoint_that_answered_is_not_asked_again_within_the_ttl() -> None:
    cache = PreflightCache[bool](60.0)
    async with models_endpoint() as endpoint:
        first = await check_endpoint(endpoint.base_url, None, 10.0, cache=cache)
        second = await check_endpoint(endpoint.base_url, None, 10.0, cache=cache)
        uncached = await check_endpoint(endpoint.base_url, None, 10.0)

    assert first == second == uncached == []
    assert endpoint.hits == ["/v1/models", "/v1/models"]  # the first and the uncached one


# -- the HTTP service on the emulator -------------------------------------------------


@pytest.mark.slow
async def test_an_unknown_env_version_is_a_422_naming_it_and_nothing_is_created(
    emulator: Emulator,
) -> None:
    async with running_service(emulator) as served, served.http() as http:
        before = creates(emulator)
        with anyio.fail_after(30):
            answer = await http.post(
                "/v1/batches", json={"tasks": [typo(), task_record(LEDGER[1])]}
            )
            batches = [r.batch_id for r in served.service.batches]

    assert answer.status_code == 422, answer.text
    [problem] = answer.json()["detail"]
    assert problem["type"] == "preflight_error" and problem["loc"] == ["body", "tasks"]
    assert problem["msg"].startswith("pre-flight failed, nothing was provisioned")
    assert "environment 'ledger' has no version 'v9' (1 task)" in problem["msg"]
    assert "service.preflight = false" in problem["msg"]
    assert emulator.api_key not in answer.text
    assert creates(emulator) == before and batches == []


@pytest.mark.slow
async def test_a_good_batch_still_runs_and_a_second_one_asks_fleet_for_no_listing(
    emulator: Emulator,
) -> None:
    async with running_service(emulator) as served, FleetrollClient(served.url) as client:
        before = listings(emulator)
        with anyio.fail_after(60):
            results = await client.run_batch(LEDGER[:2]).results()
            after_first = listings(emulator)
            again = await client.run_batch(LEDGER[:2]).results()

    assert [r.status for r in results + again] == ["completed"] * 4
    assert after_first - before == 1  # the cache was cold: one listing
    assert listings(emulator) == after_first  # the second batch: none


@pytest.mark.slow
async def test_a_version_missing_from_the_kept_listing_is_asked_again_before_refusing(
    emulator: Emulator,
) -> None:
    async with running_service(emulator) as served, FleetrollClient(served.url) as client:
        with anyio.fail_after(60):
            await client.run_batch(LEDGER[:1]).submit()  # the listing is kept now
            before = listings(emulator)
            with pytest.raises(PreflightError):
                await client.run_batch([typo()]).submit()

    assert listings(emulator) == before + 1  # a version published since would be seen


@pytest.mark.slow
async def test_without_a_ttl_every_batch_asks_for_the_listing(emulator: Emulator) -> None:
    uncached = running_service(emulator, service={"preflight_cache_s": 0})
    async with uncached as served, FleetrollClient(served.url) as client:
        before = listings(emulator)
        with anyio.fail_after(60):
            await client.run_batch(LEDGER[:1]).submit()
            await client.run_batch(LEDGER[:1]).submit()

    assert listings(emulator) == before + 2


@pytest.mark.slow
async def test_the_client_raises_the_refusal_as_a_preflight_error_with_the_message(
    emulator: Emulator,
) -> None:
    async with running_service(emulator) as served, FleetrollClient(served.url) as client:
        before = creates(emulator)
        with anyio.fail_after(30), pytest.raises(PreflightError) as refused:
            await client.run_batch([typo("v7")]).submit()

    error = refused.value
    assert isinstance(error, ServiceError) and error.status_code == 422
    assert str(error).startswith("pre-flight failed, nothing was provisioned")
    assert error.problems == ["environment 'ledger' has no version 'v7' (1 task); versions: v1"], (
        error.problems
    )
    assert creates(emulator) == before


@pytest.mark.slow
async def test_a_dead_policy_endpoint_named_by_the_request_is_a_422(emulator: Emulator) -> None:
    with anyio.fail_after(10):
        async with models_endpoint() as endpoint:
            dead = endpoint.base_url  # gone once the block ends
    policy = {"kind": "openai", "base_url": dead, "model": "m"}
    async with running_service(emulator) as served, served.http() as http:
        with anyio.fail_after(60):
            answer = await http.post(
                "/v1/batches", json={"tasks": [task_record(LEDGER[0])], "policy": policy}
            )

    assert answer.status_code == 422, answer.text
    assert f"GET {dead}/models failed with ConnectError" in answer.json()["detail"][0]["msg"]


@pytest.mark.slow
async def test_a_policy_endpoint_is_asked_once_for_batches_within_the_ttl(
    emulator: Emulator,
) -> None:
    async with models_endpoint() as endpoint, running_service(emulator) as served:
        policy = {"kind": "openai", "base_url": endpoint.base_url, "model": "m"}
        async with served.http() as http:
            with anyio.fail_after(60):
                for batch_id in ("p1", "p2", "p3"):
                    body = {"tasks": [task_record(LEDGER[0])], "policy": policy}
                    answer = await http.post("/v1/batches", json={**body, "batch_id": batch_id})
                    assert answer.status_code == 201, answer.text
                    await http.delete(f"/v1/batches/{batch_id}")
        asked = list(endpoint.hits)

    assert asked == ["/v1/models"]


@pytest.mark.slow
async def test_preflight_off_accepts_the_batch_and_its_rollouts_fail_as_before(
    emulator: Emulator,
) -> None:
    unchecked = running_service(emulator, service={"preflight": False})
    async with unchecked as served, FleetrollClient(served.url) as client:
        with anyio.fail_after(60):
            results = await client.run_batch([typo()]).results()

    assert [r.failure_reason for r in results] == ["init_error"]


@pytest.mark.slow
async def test_an_mcp_rollout_of_an_unknown_version_is_refused_before_any_create(
    emulator: Emulator,
) -> None:
    async with running_service(emulator) as served:
        before = creates(emulator)
        with anyio.fail_after(30):
            async with Client(f"{served.url}/mcp") as mcp:
                refused = await mcp.call_tool("start_rollout", {"task": typo()})

    assert refused.is_error
    text = str(refused.content)
    assert "task: pre-flight failed" in text and "no version 'v9'" in text
    assert creates(emulator) == before


@pytest.mark.slow
async def test_a_refused_batch_never_reaches_the_pool_that_runs_batches(
    emulator: Emulator,
) -> None:
    # The pool may run its rollouts on Ray actors (serve --ray): the check runs
    # in the service, before the pool shards anything over them.
    settings = load_settings(provisioning=FAST)
    async with RolloutPool(settings, api_key=emulator.api_key, base_url=emulator.base_url) as pool:
        service = Service(pool, settings)
        app = create_app(service)
        async with (
            serve_app(app, "127.0.0.1", 0, before_stop=service.stop) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            before = creates(emulator)
            with anyio.fail_after(30):
                answer = await http.post("/v1/batches", json={"tasks": [typo()]})
            batches = list(pool.batches)

    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["type"] == "preflight_error"
    assert batches == [] and creates(emulator) == before


@pytest.mark.slow
async def test_a_task_with_a_judge_and_no_judge_configured_is_a_422_before_anything_runs(
    emulator: Emulator,
) -> None:
    judged = {**task_record(LEDGER[0]), "rewards": [{"name": "q", "kind": "judge", "rubric": "?"}]}
    async with running_service(emulator) as served, served.http() as http:
        before = creates(emulator)
        with anyio.fail_after(30):
            answer = await http.post("/v1/batches", json={"tasks": [judged]})

    assert answer.status_code == 422, answer.text
    [problem] = answer.json()["detail"]
    assert problem["type"] == "preflight_error" and problem["loc"] == ["body", "tasks"]
    assert "has a judge reward component but judge.base_url is not set" in problem["msg"]
    assert creates(emulator) == before
