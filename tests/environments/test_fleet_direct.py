"""The direct control-plane path (``provisioning.control_client = "direct"``) against the SDK's.

Each hot-path call is made once through the Fleet SDK and once directly, on
emulators that record every request they receive; the requests must be the
same (method, path, query, JSON body, the headers that matter), the errors
the same classes with the same classification, a duplicate create recovered
the same way, and a whole batch scored the same.
"""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
import re
import zipfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from fleet._async import exceptions as fleet_errors
from fleet._async.client import AsyncFleet
from fleet.runner_auth import RunnerTokenProvider

from fleetroll._internal.wire import Wire
from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.emulator.app import RecordedRequest
from fleetroll.emulator.faults import FaultInjector
from fleetroll.environments.fleet.control import (
    classify,
    forget_retry_after,
    remember_retry_after,
)
from fleetroll.environments.fleet.direct import DirectControl, DirectEnv, new_request_id
from fleetroll.environments.fleet.provider import FleetProvider
from fleetroll.environments.provider import Instance
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import fleet_provider
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import Settings, config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink

pytestmark = pytest.mark.slow

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
TASK = LEDGER[0]
FAST = {"creates_per_second": 1000, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
MODES = ("sdk", "direct")
KEY = "fleetroll-contract-key"
#: Headers whose values must be equal on both paths (the rest vary by transport).
SAME_VALUE = ("authorization", "x-fleet-sdk-language", "x-fleet-sdk-version", "x-runner-token")
BUNDLE_SHA = "<bundle sha>"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def settings_for(mode: str, **provisioning: Any) -> Settings:
    return load_settings(
        provisioning={**FAST, "control_client": mode, **provisioning}, pool={"concurrency": 4}
    )


@asynccontextmanager
async def provider_for(
    emu: Emulator, mode: str, **provisioning: Any
) -> AsyncIterator[FleetProvider]:
    provider = fleet_provider(
        settings_for(mode, **provisioning), Events(), api_key=emu.api_key, base_url=emu.base_url
    )
    try:
        async with anyio.create_task_group() as tg:
            provider.heartbeats.start(tg)  # creates ask for heartbeats, as in a pool
            yield provider
            tg.cancel_scope.cancel()
    finally:
        await provider.aclose()


def normalized(request: RecordedRequest, ids: dict[str, str]) -> tuple[Any, ...]:
    """A request with what is random by design replaced: instance ids (by their
    order of appearance), the pickled verifier arguments (unpickled), and the
    verifier bundle by its files (the SDK zips them stamped with the clock's
    time, so its bytes and hash change with the second it was built in)."""

    def name(instance_id: str) -> str:
        return ids.setdefault(instance_id, f"<instance {len(ids)}>")

    path = request.path
    for instance_id in list(ids):
        path = path.replace(instance_id, ids[instance_id])
    body = request.json()
    if isinstance(body, dict) and "args" in body and "sha256" in body:  # a verifier execution
        body = dict(body)
        args = pickle.loads(base64.b64decode(body["args"]))  # our own bytes, from this test
        body["args"] = {
            "args": [None, *({"env": name(a["env"])} for a in args["args"][1:])],
            "kwargs": args["kwargs"],
        }
        body["args_array"] = [{"env": name(a["env"])} for a in body["args_array"]]
        body["sha256"] = BUNDLE_SHA
        if "bundle" in body:
            bundle = base64.b64decode(body["bundle"])
            assert hashlib.sha256(bundle).hexdigest() == request.json()["sha256"]
            with zipfile.ZipFile(io.BytesIO(bundle)) as files:
                body["bundle"] = {info.filename: files.read(info) for info in files.infolist()}
    query = re.sub(r"sha256=[0-9a-f]{64}", f"sha256={BUNDLE_SHA}", request.query or "")
    headers = request.headers
    return (
        request.method,
        path,
        query,
        body,
        request.status,
        tuple((h, headers.get(h)) for h in SAME_VALUE),
        headers.get("content-type", "").split(";")[0] or None,
        "x-request-id" in headers,
    )


def learn_ids(requests: Sequence[RecordedRequest], ids: dict[str, str]) -> None:
    """Name the instances in the order their ids first appear in a path."""
    for request in requests:
        match = re.search(r"/(?:instances|env/instances)/([0-9a-f]{16})", request.path)
        if match and match.group(1) not in ids:
            ids[match.group(1)] = f"<instance {len(ids)}>"


async def one_rollout_s_calls(emu: Emulator, mode: str) -> list[RecordedRequest]:
    """Create, reset, verify (twice: the bundle known the second time), status,
    release, and the status of the released instance; heartbeats apart."""
    emu.forget_requests()
    async with provider_for(emu, mode, heartbeat_s=60) as provider:
        with anyio.fail_after(60):
            instance = await provider.provision(TASK, run_id="contract")
            await provider.reset(instance, TASK)
            first = await provider.verify(instance, TASK, None)
            second = await provider.verify(instance, TASK, None)
            assert first.reward is not None and first.reward == second.reward
            assert await provider.is_alive(instance)
            assert await provider.release(instance)
            assert not await provider.is_alive(instance)
    return emu.requests


async def test_each_hot_path_call_sends_the_sdk_s_request() -> None:
    seen: dict[str, list[tuple[Any, ...]]] = {}
    beats: dict[str, set[tuple[Any, ...]]] = {}
    request_ids: dict[str, list[str]] = {}
    for mode in MODES:
        # One key for both: the Authorization header is compared whole.
        async with Emulator(record_requests=1000, api_key=KEY) as emu:
            requests = await one_rollout_s_calls(emu, mode)
            ids: dict[str, str] = {}
            learn_ids(requests, ids)
            heartbeat = [r for r in requests if r.path.endswith("/heartbeat")]
            rest = [r for r in requests if not r.path.endswith("/heartbeat")]
            seen[mode] = [normalized(r, ids) for r in rest]
            beats[mode] = {normalized(r, ids) for r in heartbeat}
            request_ids[mode] = [
                r.headers["x-request-id"] for r in rest if "x-request-id" in r.headers
            ]
            # One bundle per verifier: every check and execution names the same.
            shas = {m.group(1) for r in rest if (m := re.search(r"sha256=(\w+)", r.query))}
            shas |= {r.json()["sha256"] for r in rest if r.path == "/v1/verifiers/execute"}
            assert len(shas) == 1
            assert emu.ledger.running == 0
    assert seen["direct"] == seen["sdk"]
    assert beats["direct"] == beats["sdk"] and beats["sdk"]  # at least the first beat
    calls = [(method, path) for method, path, *_ in seen["sdk"]]
    assert calls[:1] == [("POST", "/v1/env/instances")]
    assert ("POST", "/instances/<instance 0>/api/v1/env/reset") in calls
    assert ("GET", "/v1/verifiers/check") in calls and ("POST", "/v1/verifiers/execute") in calls
    assert ("DELETE", "/v1/env/instances/<instance 0>") in calls
    assert seen["sdk"][0][5][0] == ("authorization", f"Bearer {KEY}")
    create = seen["sdk"][0][3]
    assert create["heartbeat_interval"] == 60 and create["run_id"] == "contract"
    # Every control-plane request carries an id of its own, as the SDK's do.
    for mode in MODES:
        assert all(UUID.match(rid) for rid in request_ids[mode])
        assert len(set(request_ids[mode])) == len(request_ids[mode])


async def test_a_create_keeps_its_request_id_across_its_attempts_and_each_create_has_its_own() -> (
    None
):
    # Every other create answers 5xx (seeded): attempts that follow a failure.
    profile = FaultProfile(p_create_5xx=0.5, seed=3)
    async with (
        Emulator(profile, record_requests=1000) as emu,
        provider_for(emu, "direct") as provider,
    ):
        made: list[Instance] = []
        for _ in range(4):  # one after another: the creates of each apart
            with anyio.fail_after(60):
                made.append(await provider.provision(TASK))
        creates = [r for r in emu.requests if r.path == "/v1/env/instances"]
        for instance in made:
            assert await provider.release(instance)
    chains: list[list[RecordedRequest]] = [[]]
    for create in creates:
        chains[-1].append(create)
        if create.status == 200:
            chains.append([])
    chains.pop()  # the empty one after the last success
    assert len(chains) == 4
    assert any(len(chain) > 1 for chain in chains)  # some attempts were sent again
    ids = [{r.headers["x-request-id"] for r in chain} for chain in chains]
    assert all(len(one) == 1 for one in ids)  # stable across a create's attempts
    assert len(set.union(*ids)) == 4  # and unique per create
    assert all(UUID.match(next(iter(one))) for one in ids)


class SendsCreatesTwice(httpx.AsyncBaseTransport):
    """A transport whose create's first answer is lost: it sends the same request
    (the same ``X-Request-ID``) again, as a transport retry does."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/env/instances":
            lost = await self._inner.handle_async_request(request)
            await lost.aread()
            await lost.aclose()
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


@asynccontextmanager
async def both_paths(emu: Emulator) -> AsyncIterator[tuple[AsyncFleet, DirectControl]]:
    """The SDK (a create's first answer lost) and the direct client, on one emulator."""
    async with (
        httpx.AsyncClient(transport=SendsCreatesTwice(), timeout=30) as client,
        Wire(connect_timeout_s=10) as wire,
    ):
        fleet = AsyncFleet(
            api_key=emu.api_key, base_url=emu.base_url, max_retries=0, httpx_client=client
        )
        yield fleet, DirectControl(wire, fleet.client, RunnerTokenProvider(fleet.client))


async def make_directly(direct: DirectControl, request_id: str) -> DirectEnv:
    """The create the SDK's ``fleet.make("ledger", ttl_seconds=300)`` sends, directly."""
    return await direct.make(
        "ledger",
        data_key=None,
        region=None,
        env_variables=None,
        image_type=None,
        ttl_seconds=300,
        run_id=None,
        heartbeat_interval=None,
        create_timeout_s=30,
        request_id=request_id,
    )


def shapes(requests: Sequence[RecordedRequest]) -> list[tuple[str, str, int]]:
    return [(r.method, re.sub(r"[0-9a-f]{16}", "<id>", r.path), r.status) for r in requests]


async def test_a_create_sent_again_is_answered_409_and_both_paths_recover_its_instance() -> None:
    async with Emulator(record_requests=1000) as emu, both_paths(emu) as (fleet, direct):
        with anyio.fail_after(60):
            emu.forget_requests()
            by_sdk = await fleet.make("ledger", ttl_seconds=300)
            sdk_requests = emu.requests
            emu.forget_requests()
            request_id = new_request_id()
            first = await make_directly(direct, request_id)
            again = await make_directly(direct, request_id)
            direct_requests = emu.requests
            assert emu.ledger.created == 2  # one per path: the second sends made none
            assert isinstance(again, DirectEnv) and again.instance_id == first.instance_id
            assert again.status == "running" and again.urls == first.urls
            expected = [
                ("POST", "/v1/env/instances", 200),
                ("POST", "/v1/env/instances", 409),
                ("GET", "/v1/env/instances/<id>", 200),
            ]
            assert shapes(sdk_requests) == expected
            assert shapes(direct_requests) == expected
            assert (
                sdk_requests[0].headers["x-request-id"] == sdk_requests[1].headers["x-request-id"]
            )
            assert [r.headers["x-request-id"] for r in direct_requests[:2]] == [request_id] * 2
            assert sdk_requests[2].path.endswith(by_sdk.instance_id)

            # The instance a duplicate points at is gone: a conflict, classified alike.
            await by_sdk.close()
            await first.close()
            errors: list[BaseException] = []
            with pytest.raises(fleet_errors.FleetConflictError) as by_sdk_error:
                await fleet._recover_duplicate_create(by_sdk.instance_id, 1.0)
            errors.append(by_sdk_error.value)
            with pytest.raises(fleet_errors.FleetConflictError) as direct_error:
                await make_directly(direct, request_id)
            errors.append(direct_error.value)
    sdk_exc, direct_exc = errors
    assert direct_exc.instance_id == first.instance_id
    assert str(direct_exc) == str(sdk_exc).replace(by_sdk.instance_id, first.instance_id)
    assert classify(direct_exc) == classify(sdk_exc)
    assert classify(direct_exc).transient  # a new request may work


async def test_a_409_for_an_instance_that_did_not_come_up_makes_the_next_attempt_a_new_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A create's id was used before by a create whose instance stopped: its 409
    # recovers nothing, and sending that id again would be answered 409 forever.
    used = "11111111-1111-4111-8111-111111111111"
    fresh = "22222222-2222-4222-8222-222222222222"
    ids = iter([new_request_id(), used, fresh])  # the first, for the instance that stops
    monkeypatch.setattr("fleetroll.environments.fleet.provider.new_request_id", lambda: next(ids))
    async with (
        Emulator(record_requests=1000) as emu,
        provider_for(emu, "direct") as provider,
    ):
        assert emu.app is not None
        with anyio.fail_after(60):
            stopped = await provider.provision(TASK)
            assert await provider.release(stopped)
            emu.app._made_by_request[used] = stopped.instance_id
            emu.forget_requests()
            made = await provider.provision(TASK)
            creates = [r for r in emu.requests if r.path == "/v1/env/instances"]
            assert [(r.headers["x-request-id"], r.status) for r in creates] == [
                (used, 409),
                (fresh, 200),
            ]
            assert made.instance_id != stopped.instance_id
            assert await provider.release(made)


async def make_both_ways(
    emu: Emulator, profile: Callable[[], FaultProfile]
) -> list[tuple[type[BaseException], str, Any, int | None]]:
    """One create through the SDK and one direct, each under a fresh injector of
    the same profile (the same draws); what each raised, and how it is classified."""
    out = []
    async with (
        httpx.AsyncClient(timeout=30) as client,
        Wire(connect_timeout_s=10) as wire,
    ):
        fleet = AsyncFleet(
            api_key=emu.api_key, base_url=emu.base_url, max_retries=0, httpx_client=client
        )
        # The provider's hook that remembers Retry-After, on the SDK's client.
        client.event_hooks["response"] = [remember_retry_after]
        direct = DirectControl(wire, fleet.client, RunnerTokenProvider(fleet.client))
        calls: list[Callable[[], Any]] = [
            lambda: fleet.make("ledger", ttl_seconds=300, timeout=30),
            lambda: make_directly(direct, new_request_id()),
        ]
        assert emu.app is not None
        kept = emu.app.faults
        for call in calls:
            emu.app.faults = FaultInjector(profile())
            forget_retry_after()
            try:
                with anyio.fail_after(30), pytest.raises(fleet_errors.FleetAPIError) as caught:
                    await call()
            finally:
                emu.app.faults = kept
            exc = caught.value
            assert emu.api_key not in str(exc) and emu.api_key not in repr(exc.__dict__)
            verdict = classify(exc, retry_instance_limit=False)
            out.append((type(exc), str(exc), verdict, exc.status_code))
    return out


def seed_answering(status: int) -> int:
    """A seed whose first create answers ``status`` (the emulator's draws, in its order)."""
    for seed in range(100):
        faults = FaultInjector(FaultProfile(p_create_5xx=1.0, seed=seed))
        if faults.create_outcome(0) == "5xx" and faults.server_error_status() == status:
            return seed
    raise AssertionError(f"no seed below 100 answers {status}")


@pytest.mark.parametrize(
    ("profile", "status"),
    [
        pytest.param(lambda: FaultProfile(p_create_429=1.0, retry_after_s=7.5), 429, id="429"),
        pytest.param(lambda: FaultProfile(instance_limit=0), 403, id="403-instance-limit"),
        *(
            pytest.param(
                lambda status=status: FaultProfile(p_create_5xx=1.0, seed=seed_answering(status)),
                status,
                id=str(status),
            )
            for status in (500, 502, 503)
        ),
        pytest.param(
            lambda: FaultProfile(p_create_5xx=1.0, p_retryable_body=1.0, seed=seed_answering(503)),
            503,
            id="503-retryable-body",
        ),
    ],
)
async def test_an_error_answer_raises_the_sdk_s_exception_classified_alike(
    emulator: Emulator, profile: Callable[[], FaultProfile], status: int
) -> None:
    (sdk_type, sdk_text, sdk_verdict, sdk_status), direct = await make_both_ways(emulator, profile)
    assert direct == (sdk_type, sdk_text, sdk_verdict, sdk_status)
    assert sdk_status == status
    if status == 429:
        assert sdk_type is fleet_errors.FleetRateLimitError and sdk_verdict.retry_after_s == 7.5
    if status == 403:
        assert sdk_type is fleet_errors.FleetInstanceLimitError
        assert sdk_verdict.transient is False  # admission waits for a release instead
    if status == 503:
        assert sdk_verdict.transient


async def test_a_dead_instance_s_reset_heartbeat_and_status_fail_alike_on_both_paths(
    emulator: Emulator,
) -> None:
    failures: dict[str, list[tuple[str, Any]]] = {}
    for mode in MODES:
        async with provider_for(emulator, mode) as provider:
            with anyio.fail_after(60):
                instance = await provider.provision(TASK)
                await provider.release(instance)
                env = instance.handle
                failures[mode] = []
                for call in (provider.reset(instance, TASK), env.heartbeat()):  # type: ignore[attr-defined]
                    try:
                        await call
                    except Exception as exc:
                        verdict = classify(exc)
                        # The id, whole or as pydantic shortens it in its message.
                        text = re.sub(r"'[0-9a-f.]{8,}'", "'<id>'", str(exc))
                        failures[mode].append(
                            (f"{type(exc).__module__}.{type(exc).__name__}", (text, verdict))
                        )
                assert not await provider.is_alive(instance)
    assert failures["direct"] == failures["sdk"]
    assert len(failures["sdk"]) == 2  # both failed


def by_id(results: list[RolloutResult]) -> dict[str, RolloutResult]:
    return {r.rollout_id: r for r in results}


async def test_a_batch_scores_alike_with_direct_calls_and_through_the_sdk_leaving_nothing() -> None:
    tasks = LEDGER[:6]
    rewards: dict[str, dict[str, float | None]] = {}
    for mode in MODES:
        sink = MemorySink()
        async with Emulator() as emu:
            async with RolloutPool(
                settings_for(mode),
                api_key=emu.api_key,
                base_url=emu.base_url,
                events=Events([sink]),
            ) as pool:
                with anyio.fail_after(120):
                    results = await pool.run_batch(
                        tasks, ScriptedPolicy(), samples_per_task=2, batch_id="same"
                    ).results()
            assert emu.ledger.running == 0
        assert all(r.reward is not None for r in results)
        rewards[mode] = {rid: r.reward for rid, r in by_id(results).items()}
    assert rewards["direct"] == rewards["sdk"]
    assert len(rewards["sdk"]) == 12 and set(rewards["sdk"].values()) == {1.0}


async def test_a_proxy_refusing_the_tunnel_fails_a_direct_create_for_good() -> None:
    # A proxy that wants credentials (407) or forbids the host (403) is a setting
    # to fix: retried as a network blip, a create waited out its whole budget.
    async def refuse(client: anyio.abc.SocketStream) -> None:
        async with client:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await client.receive()
            seen.append(head.split(b" ", 1)[0])
            await client.send(
                b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n"
            )

    seen: list[bytes] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, refuse)
        async with Wire(proxy=f"http://127.0.0.1:{port}", connect_timeout_s=10) as wire:
            fleet = AsyncFleet(api_key="k", base_url="https://127.0.0.1:9", max_retries=0)
            direct = DirectControl(wire, fleet.client, RunnerTokenProvider(fleet.client))
            with anyio.fail_after(10), pytest.raises(fleet_errors.FleetAPIError) as caught:
                await make_directly(direct, new_request_id())
        tg.cancel_scope.cancel()
    assert seen == [b"CONNECT"]
    assert "407" in str(caught.value)
    assert not classify(caught.value).transient
