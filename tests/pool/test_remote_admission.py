"""The Ray cluster's admission, in-process: RemoteAdmission proxies over one
AdmissionHost, with calls carried as Ray carries an actor's (no Ray, no sleeps)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from fleet._async.exceptions import FleetRateLimitError

from fleetroll.environments.admission import CreateLimits, Ticket
from fleetroll.environments.fleet.admission import read_create_error
from fleetroll.errors import EnvUnavailableError, ProvisionError
from fleetroll.pool.ray.admission import AdmissionHost, RemoteAdmission
from fleetroll.results import FailureReason
from fleetroll.settings import load_settings
from fleetroll.telemetry import Events, MemorySink

pytestmark = pytest.mark.anyio


class _Call:
    """One call's answer, awaited as a Ray ObjectRef is."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: Any = None
        self._error: Exception | None = None

    async def run(self, method: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            self._value = await method(*args)
        except Exception as exc:
            self._error = exc
        finally:
            self._done.set()

    async def _answer(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def __await__(self) -> Generator[Any, None, Any]:
        return self._answer().__await__()


class _Method:
    def __init__(self, method: Callable[..., Awaitable[Any]], tg: TaskGroup) -> None:
        self._method = method
        self._tg = tg

    def remote(self, *args: Any) -> _Call:
        call = _Call()
        self._tg.start_soon(call.run, self._method, args)
        return call


class InProcess:
    """An actor handle over an object of this process: each ``.remote()`` call runs
    as a task of its own, started in the order sent, whether or not anyone awaits
    its answer (as Ray runs an actor's calls)."""

    def __init__(self, target: object, tg: TaskGroup) -> None:
        self._target = target
        self._tg = tg

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name), self._tg)


@asynccontextmanager
async def cluster(**admission: Any) -> AsyncIterator[tuple[AdmissionHost, Any]]:
    settings = load_settings(admission=admission)
    host = AdmissionHost(settings)
    async with anyio.create_task_group() as tg:
        yield host, InProcess(host, tg)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()


def proxy(handle: Any, holder: str) -> RemoteAdmission:
    return RemoteAdmission(handle, holder, call_s=30)


async def admitted_later(admission: RemoteAdmission, env: str, into: list[Ticket]) -> None:
    into.append(await admission.acquire(env))


async def test_two_actors_share_one_instance_cap_and_a_release_admits_the_other() -> None:
    async with cluster(max_instances=2) as (_host, handle):
        one, two, driver = proxy(handle, "worker-0"), proxy(handle, "worker-1"), proxy(handle, "d")
        with anyio.fail_after(10):
            held = [await one.acquire("ledger:v1"), await one.acquire("ledger:v1")]
            one.started(held[0])
            later: list[Ticket] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(admitted_later, two, "ledger:v1", later)
                await anyio.wait_all_tasks_blocked()
                await driver.refresh(Events())
                waiting = driver.state()
                one.release(held[1])
            await anyio.wait_all_tasks_blocked()
            await driver.refresh(Events())
    assert (waiting.limit, waiting.in_use, waiting.starting, waiting.queued) == (2, 2, 1, 1)
    assert len(later) == 1 and not later[0].released
    after = driver.state()
    assert (after.in_use, after.starting, after.queued) == (2, 1, 0)


async def test_a_dead_actors_places_slots_and_waits_are_given_back_and_it_gets_no_more() -> None:
    async with cluster(max_instances=1) as (host, handle):
        dying, living = proxy(handle, "worker-0"), proxy(handle, "worker-1")
        with anyio.fail_after(10):
            await dying.acquire("ledger:v1")
            assert await host.acquire_slot("worker-0", "s1")  # a create in flight as it died
            later: list[Ticket] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(admitted_later, living, "ledger:v1", later)
                await anyio.wait_all_tasks_blocked()
                freed = await host.release_all("worker-0")
            stats = await host.stats()
            with pytest.raises(ProvisionError, match="worker-0"):
                await dying.acquire("ledger:v1")
    assert freed == 2 and len(later) == 1
    assert stats["in_use"] == 0


async def test_a_wait_its_caller_gives_up_takes_no_place() -> None:
    async with cluster(max_instances=1) as (_host, handle):
        first, second, driver = (proxy(handle, f"worker-{n}") for n in range(3))
        with anyio.fail_after(10):
            ticket = await first.acquire("ledger:v1")
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(admitted_later, second, "ledger:v1", [])
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()  # its provisioning budget ran out
            first.release(ticket)
            await anyio.wait_all_tasks_blocked()
            await driver.refresh(Events())
    state = driver.state()
    assert (state.in_use, state.queued) == (0, 0)


async def test_a_403_gives_the_place_back_learns_the_limit_and_queues_the_same_ticket() -> None:
    async with cluster() as (_host, handle):
        one, two, driver = proxy(handle, "worker-0"), proxy(handle, "worker-1"), proxy(handle, "d")
        with anyio.fail_after(10):
            theirs = await two.acquire("ledger:v1")
            mine = await one.acquire("ledger:v1")
            async with anyio.create_task_group() as tg:
                # Fleet: 2 at most, 2 running (one of them another client's).
                tg.start_soon(one.limit_reached, mine, 2, 2)
                await anyio.wait_all_tasks_blocked()
                await driver.refresh(Events())
                queued = driver.state()
                two.release(theirs)
            await anyio.wait_all_tasks_blocked()
            await driver.refresh(Events())
    assert (queued.limit, queued.in_use, queued.queued) == (1, 1, 1)
    assert not mine.released
    assert (driver.state().limit, driver.state().in_use) == (1, 1)


async def test_the_breaker_opens_once_for_the_cluster_and_its_event_is_emitted_once() -> None:
    breaker = {"window": 2, "min_rollouts": 2, "failure_share": 1.0, "on_open": "fail"}
    async with cluster(breaker=breaker) as (_host, handle):
        one, two, driver = proxy(handle, "worker-0"), proxy(handle, "worker-1"), proxy(handle, "d")
        sink = MemorySink()
        with anyio.fail_after(10):
            one.record("desktop:v1", FailureReason.INIT_ERROR)
            two.record("desktop:v1", FailureReason.INIT_ERROR)
            await driver.refresh(Events([sink]))
            await driver.refresh(Events([sink]))  # taken once: nothing new
            with pytest.raises(EnvUnavailableError, match="desktop:v1"):
                await one.acquire("desktop:v1")
            healthy = await two.acquire("ledger:v1")
    [event] = sink.named("fleet_env_quarantined")
    assert (event.attributes["env_key"], event.attributes["env_version"]) == ("desktop", "v1")
    assert driver.state().open_breakers == 1
    assert not healthy.released


class _Unreadable:
    """An AdmissionHost whose ``follow`` times out ``failures`` times, then answers."""

    def __init__(self, host: AdmissionHost, failures: int) -> None:
        self._host = host
        self.failures = failures
        self.answered = anyio.Event()

    async def follow(self, wait_s: float) -> Any:
        if self.failures:
            self.failures -= 1
            raise TimeoutError
        answer = await self._host.follow(0)
        self.answered.set()
        return answer


async def test_a_limiter_that_cannot_be_read_is_logged_once_per_streak(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with cluster(max_instances=3) as (host, handle):
        await proxy(handle, "worker-0").acquire("ledger:v1")  # one place taken
        flaky = _Unreadable(host, failures=20)
        async with anyio.create_task_group() as tg:
            driver = proxy(InProcess(flaky, tg), "d")
            with anyio.fail_after(10), caplog.at_level("WARNING", "fleetroll.pool.ray.admission"):
                async with driver.followed(Events()):
                    await flaky.answered.wait()
            tg.cancel_scope.cancel()
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "could not read the cluster's admission state" in logged[0]
    assert logged[1] == "the cluster's admission state can be read again"
    assert flaky.failures == 0 and driver.state().in_use == 1


async def test_each_actors_create_answers_teach_the_clusters_one_create_rate() -> None:
    settings = load_settings()
    limits = CreateLimits.from_settings(settings.provisioning)
    host = AdmissionHost(settings)
    async with anyio.create_task_group() as tg:
        handle = InProcess(host, tg)
        one = RemoteAdmission(handle, "worker-0", call_s=30, limits=limits)
        two = RemoteAdmission(handle, "worker-1", call_s=30, limits=limits)
        assert one.adaptive and not proxy(handle, "d").adaptive
        with anyio.fail_after(10):
            start = (await host.follow(0.0))[0]
            with pytest.raises(FleetRateLimitError):
                # A 429 read in the actor, learnt by the host.
                async with one.slot(read_create_error):
                    raise FleetRateLimitError("slow down")
            async with two.slot(read_create_error):
                pass
            await anyio.wait_all_tasks_blocked()
            state, events = await host.follow(0.0)
        tg.cancel_scope.cancel()
    assert state.creates_per_second == start.creates_per_second / 2
    assert state.creates_in_flight_limit == start.creates_in_flight_limit // 2
    assert state.creates_in_flight == 0
    assert [e.attributes["reason"] for e in events] == ["throttled"]
