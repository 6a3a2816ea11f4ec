"""One RolloutPool on Ray actors (``RolloutPool(executor=RayExecutor)``, as ``--ray``
opens it) on a local Ray instance: the pool's guarantees across processes,
and the cluster's one admission controller (the instance cap and the circuit
breakers hold across actors).

One file, so one worker process of the run starts Ray (and stops it after).
Every actor is a process that imports fleetroll, mcp and Ray (seconds of CPU),
and so is every emulator: the tests share what they can. Two emulators (Fleet
with no limit, and Fleet with an account limit and a broken environment), one
service on Ray opened as ``fleetroll serve --ray`` opens it (one pool), and one pool with
a cluster-wide instance cap and breaker; tests that kill an actor, or need a
pool's own limits, open their own pool. On what is shared, a test reads the
ledger before and after (a peak is over the emulator's life: every pool on it
holds the same limit, one test at a time), waits for its batches to end, and
sees only its own events (:class:`Tap`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest

ray = pytest.importorskip("ray")

from mcp import Client  # noqa: E402

from fleetroll.client import FleetrollClient  # noqa: E402
from fleetroll.emulator import Emulator, FaultProfile, Latency  # noqa: E402
from fleetroll.emulator.process import EmulatorProcess  # noqa: E402
from fleetroll.errors import PoolFullError  # noqa: E402
from fleetroll.policies import ScriptedPolicy  # noqa: E402
from fleetroll.pool.batch_pool import FleetTarget, open_batch_pool  # noqa: E402
from fleetroll.pool.ray.admission import RemoteAdmission  # noqa: E402
from fleetroll.pool.ray.executor import RayExecutor, ray_pool  # noqa: E402
from fleetroll.pool.rollout_pool import RolloutPool  # noqa: E402
from fleetroll.results import FailureReason  # noqa: E402
from fleetroll.service import Service, create_app, serve_app  # noqa: E402
from fleetroll.service.metrics import Metrics  # noqa: E402
from fleetroll.settings import config_dir, load_settings  # noqa: E402
from fleetroll.tasks import TaskSpec, load_tasks  # noqa: E402
from fleetroll.telemetry import Events, MemorySink  # noqa: E402
from fleetroll.telemetry.events import Event, EventSink  # noqa: E402
from ledger_watch import Changes, creates_sent  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
DESKTOP = load_tasks(config_dir() / "tasks" / "desktop.jsonl", modalities=SETTINGS.modalities)
CREATE_LIMIT = 4
#: Samples per ledger task: 100 rollouts of 25 tasks, half on each of two actors.
SAMPLES = 4
ORDER = ["provisioning", "waiting", "resetting", "connecting", "acting", "verifying"]
ORDER += ["releasing", "done"]


def settings(**overrides):
    return load_settings(
        **overrides,
        pool={"concurrency": 32},
        provisioning={
            "max_concurrent_creates": CREATE_LIMIT,
            "creates_per_second": 500,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.5,
        },
    )


def assert_pairs(sink: MemorySink) -> None:
    started = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started"))
    completed = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed"))
    assert started == completed and set(completed.values()) <= {1}


class Tap:
    """The events of a pool the module's tests share, passed on to the sinks of the
    test running now: a test sees its own events, never an earlier test's."""

    def __init__(self) -> None:
        self._sinks: list[EventSink] = []

    def emit(self, event: Event) -> None:
        for sink in self._sinks:
            sink.emit(event)

    @contextmanager
    def into(self, sink: EventSink) -> Iterator[None]:
        self._sinks.append(sink)
        try:
            yield
        finally:
            self._sinks.remove(sink)


@dataclass
class OnRay:
    """A pool on Ray the module's tests share, the emulator it runs on, and its events."""

    emu: EmulatorProcess
    pool: RolloutPool
    tap: Tap

    @property
    def executor(self) -> RayExecutor:
        return on_ray(self.pool)


@dataclass
class ServiceOnRay(OnRay):
    """A service on Ray (its one pool, sessions included) and its URL besides."""

    url: str


def on_ray(pool: RolloutPool) -> RayExecutor:
    """The pool's Ray executor (its actors, their liveness, the cluster's limiter)."""
    executor = pool.executor
    assert isinstance(executor, RayExecutor)
    return executor


async def settled(pool: RolloutPool, *batch_ids: str) -> None:
    """Until each batch has ended on every actor (their pools closed, instances
    released), as closing a pool of its own would."""
    for batch_id in batch_ids:
        await pool.batches[batch_id].finished.wait()


@pytest.fixture(scope="module")
async def fleet() -> AsyncIterator[EmulatorProcess]:
    """Fleet with no account limit, for every test but the admission ones."""
    async with EmulatorProcess(FaultProfile(create_latency=Latency(min_s=0.01, max_s=0.05))) as emu:
        yield emu


@pytest.fixture(scope="module")
async def service_on_ray(local_ray: None, fleet: EmulatorProcess) -> AsyncIterator[ServiceOnRay]:
    """The pool as `fleetroll serve --ray --ray-actors 2` opens it, and the service on it."""
    s = settings(service={"tasks_root": str(config_dir())})
    tap = Tap()
    async with AsyncExitStack() as stack:
        pool, _ = await open_batch_pool(
            stack,
            s,
            FleetTarget(fleet.api_key, fleet.base_url, "emulator"),
            Events([tap]),
            ray_address="local",
            ray_actors=2,
        )
        on_ray(pool)  # its rollouts run on the actors
        service = Service(pool, s)
        url = await stack.enter_async_context(
            serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop)
        )
        yield ServiceOnRay(fleet, pool, tap, url)


async def test_two_actors_run_a_hundred_rollouts_with_one_result_each_and_no_leak(
    service_on_ray: ServiceOnRay,
) -> None:
    emu, pool = service_on_ray.emu, service_on_ray.pool
    sink = MemorySink()
    before = await emu.ledger()
    with service_on_ray.tap.into(sink), anyio.fail_after(300):
        results = await pool.run_batch(
            LEDGER[:25], ScriptedPolicy(), samples_per_task=SAMPLES
        ).results()
        limiter = await service_on_ray.executor.limiter.stats.remote()
    ledger = await emu.ledger()
    ids = Counter(r.rollout_id for r in results)
    assert len(ids) == 25 * SAMPLES and set(ids.values()) == {1}
    assert all(r.reward == 1.0 for r in results)
    assert ledger["running"] == 0 and ledger["created"] - before["created"] == 25 * SAMPLES
    # The create limit held cluster-wide, in the limiter and in Fleet's own view.
    assert limiter["peak"] <= CREATE_LIMIT
    assert ledger["peak_concurrent_creates"] <= CREATE_LIMIT
    assert_pairs(sink)
    # Every tool call measured on the actors reaches the driver's events (and /metrics).
    measured = sink.named("fleet_tool_call")
    assert {e.attributes["rollout_id"] for e in measured} == set(ids)
    assert all(e.attributes["outcome"] == "ok" for e in measured)


async def test_a_killed_actor_s_rollouts_run_again_once_or_end_cancelled_if_their_batch_was(
    local_ray: None, fleet: EmulatorProcess
) -> None:
    """Killed mid-batch, an actor's rollouts run again on the other one: every result
    once. Then the last actor, killed in a cancelled batch: its unfinished rollouts
    end cancelled. Each actor start costs seconds: one pool of two for both."""
    rerun = Watch("fleet_batch_completed")  # emitted once the batch's instances are swept
    tap = Tap()
    async with ray_pool(
        settings(),
        api_key=fleet.api_key,
        base_url=fleet.base_url,
        num_actors=2,
        events=Events([tap]),
    ) as pool:
        executor = on_ray(pool)
        batch = pool.run_batch(
            LEDGER[:10], ScriptedPolicy(think_time_s=0.05), samples_per_task=SAMPLES
        )
        results = []
        with tap.into(rerun), anyio.fail_after(300):
            async for result in batch:
                results.append(result)
                # Each actor holds 20 rollouts: killed at the 10th result in all,
                # it still has at least 10 to lose, and so to run again.
                if len(results) == 10:
                    ray.kill(executor.workers[1])
            # A create in flight when the actor died ends after its rollout was
            # rerun: the batch's sweep, at its end, releases that instance.
            await rerun.seen.wait()
        alive = list(executor.alive)
        ledger = await fleet.ledger()

        # The one actor left runs a batch, which is cancelled; then the actor dies.
        batch = pool.run_batch(LEDGER[:10], ScriptedPolicy(think_time_s=0.2), samples_per_task=4)
        dead_results = []
        with anyio.fail_after(300):
            async for result in batch:
                dead_results.append(result)
                if len(dead_results) == 3:
                    batch.cancel()
                    ray.kill(executor.workers[0])  # its unfinished rollouts die with it
    dead_ledger = await fleet.ledger()

    ids = Counter(r.rollout_id for r in results)
    assert len(ids) == 10 * SAMPLES and set(ids.values()) == {1}
    assert alive == [True, False]
    unscored = [(r.rollout_id, r.failure_reason, r.error) for r in results if r.reward != 1.0]
    assert unscored == []  # the lost ones were re-run
    assert ledger["running"] == 0
    assert rerun.named("fleet_worker_lost")
    assert_pairs(rerun)

    ids = Counter(r.rollout_id for r in dead_results)
    assert len(ids) == 40 and set(ids.values()) == {1}
    unfinished = [r for r in dead_results if r.reward is None]
    assert unfinished and {r.failure_reason for r in unfinished} == {FailureReason.CANCELLED}
    assert dead_ledger["running"] == 0


async def idle(pool: RolloutPool) -> bool:
    """Whether the cluster's admission holds no instance and no create."""
    await pool.admission.refresh(Events())
    state = pool.admission.state()
    return state.in_use == 0 and state.starting == 0


async def test_a_service_on_ray_streams_each_result_once_keeps_deadlines_and_still_serves_sessions(
    service_on_ray: ServiceOnRay,
) -> None:
    pool, url = service_on_ray.pool, service_on_ray.url
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        FleetrollClient(url) as client,
    ):
        with anyio.fail_after(120):
            created = await http.post(
                "/v1/batches",
                json={"tasks_file": "tasks/ledger.jsonl", "batch_id": "on-ray"},
            )
            lines = []
            async with http.stream("GET", "/v1/batches/on-ray/results?after=0") as body:
                async for line in body.aiter_lines():
                    lines.append(json.loads(line))
                    if lines[-1]["type"] == "end":
                        break
            # Past its deadline, a batch on Ray is cancelled on every actor.
            late = client.run_batch(
                LEDGER[:4],
                {"kind": "scripted", "think_time_s": 60},
                samples_per_task=2,
                deadline_s=1,
            )
            cancelled = [r async for r in late]
            # The cancelled rollouts' creates still in flight end (and release
            # what they made) on their actors after their results came back.
            while not await idle(pool):
                await anyio.sleep(0.1)
            async with client.session(LEDGER[0]) as env:
                await env.reset()
                for step in LEDGER[0].solution or ():
                    await env.step({"name": step.name, "arguments": step.arguments})
                # The session's instance counts in the cluster's one admission.
                await pool.admission.refresh(Events())
                during = pool.admission.state()
            session = await env.close()
            await settled(pool, "on-ray", *{r.batch_id for r in cancelled})
    assert "on-ray" in pool.batches
    ledger = await service_on_ray.emu.ledger()
    assert created.status_code == 201 and created.json()["rollouts"] == len(LEDGER)
    results = [line["result"] for line in lines if line["type"] == "result"]
    ids = Counter(r["rollout_id"] for r in results)
    assert len(ids) == len(LEDGER) and set(ids.values()) == {1}
    assert [line["cursor"] for line in lines if line["type"] == "result"] == list(
        range(1, len(LEDGER) + 1)
    )
    assert lines[-1] == {"type": "end", "cursor": len(LEDGER), "status": "finished"}
    assert all(r["reward"] == 1.0 for r in results)
    assert len({r.rollout_id for r in cancelled}) == 8
    assert {r.failure_reason for r in cancelled} == {FailureReason.CANCELLED}
    assert session is not None and session.reward == 1.0
    assert during.in_use == 1 and isinstance(pool.admission, RemoteAdmission)
    assert ledger["running"] == 0


async def test_a_service_on_ray_answers_the_policy_routes_and_runs_an_oversampled_batch(
    service_on_ray: ServiceOnRay,
) -> None:
    pool, url = service_on_ray.pool, service_on_ray.url
    tasks = LEDGER[5:8]
    async with httpx.AsyncClient(base_url=url, timeout=30) as http, FleetrollClient(url) as client:
        with anyio.fail_after(300):
            batch = client.run_batch(tasks, samples_per_task=2, oversample=1)
            async with client.policy_paused(ttl_s=60):
                await batch.submit()  # its rollouts start; their policy calls wait
                set_to = await http.put("/v1/policy/version", json={"version": 7})
                paused = (await http.get("/v1/policy")).json()
            results = [r async for r in batch]
            await settled(pool, *{r.batch_id for r in results})
            turns = []
            for r in results:
                if r.reward is not None:
                    async for event in client.follow(r.rollout_id):
                        turns += [event] if event.kind == "turn" else []
            await client.set_policy_version(0)
    assert set_to.status_code == 200 and set_to.json()["version"] == 7
    assert paused["paused"] is True and paused["version"] == 7
    assert len({r.rollout_id for r in results}) == len(results) == 9
    scored = Counter(r.task_key for r in results if r.reward is not None)
    assert scored == {t.key: 2 for t in tasks}
    superseded = [r for r in results if r.reward is None]
    assert {r.failure_reason for r in superseded} == {FailureReason.SUPERSEDED}
    # Every policy call ran on the actors under the version set on the driver.
    assert turns and {e.data["policy_version"] for e in turns} == {7}


async def test_a_ray_pool_refuses_shared_keys_and_forgets_what_it_delivered(
    local_ray: None, fleet: EmulatorProcess
) -> None:
    async with ray_pool(
        load_settings(pool={"keep_finished_batches": 1, "max_queued_rollouts": 4}),
        api_key=fleet.api_key,
        base_url=fleet.base_url,
        num_actors=1,
    ) as pool:
        with pytest.raises(ValueError, match=f"duplicate task key '{LEDGER[0].key}'"):
            pool.run_batch([LEDGER[0], LEDGER[0]], ScriptedPolicy())
        with pytest.raises(PoolFullError):
            pool.run_batch(LEDGER[:5], ScriptedPolicy())
        with anyio.fail_after(120):
            for n in range(3):
                await pool.run_batch(LEDGER[:2], ScriptedPolicy(), batch_id=f"r{n}").results()
        kept = set(pool.batches)
        pool.forget("r2")
    assert kept == {"r2"} and not pool.batches


class Watch(MemorySink):
    """Every event, and a signal when the first one of a name comes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.seen = anyio.Event()

    def emit(self, event: Event) -> None:
        super().emit(event)
        if event.name == self.name:
            self.seen.set()


def mcp_task(task: TaskSpec) -> dict[str, Any]:
    """A task as an MCP client sends it (the short form of a task file's line)."""
    return {
        "key": task.key,
        "prompt": task.prompt,
        "env_key": task.env_spec,
        "data_key": task.data_spec,
        "modality": task.modality,
        "verifier_func": task.verifier_func,
        "solution": [s.model_dump() for s in task.solution or ()],
    }


async def call(mcp: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """The tool's structured answer (an error answer fails the test)."""
    result = await mcp.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def test_the_mcp_tools_of_a_service_on_ray_run_and_read_rollouts_on_an_actor(
    service_on_ray: ServiceOnRay,
) -> None:
    pool, executor = service_on_ray.pool, service_on_ray.executor
    sink = Watch("fleet_provisioning_completed")
    held_policy = {"kind": "scripted", "think_time_s": 3600}
    with service_on_ray.tap.into(sink):
        async with Client(f"{service_on_ray.url}/mcp") as mcp:
            with anyio.fail_after(120):
                held = await call(
                    mcp, "start_rollout", task=mcp_task(LEDGER[3]), policy=held_policy
                )
                await sink.seen.wait()  # it is on the actor now
                live = await call(mcp, "get_state", rollout_id=held["rollout_id"])
                await call(mcp, "abort_rollout", rollout_id=held["rollout_id"])
                aborted = await call(mcp, "finalize_rollout", rollout_id=held["rollout_id"])
                ran = await call(mcp, "run_rollout", task=mcp_task(LEDGER[4]))
                after = await call(mcp, "get_state", rollout_id=ran["rollout_id"])
                transcript = await call(mcp, "get_messages", rollout_id=ran["rollout_id"])
                pids = {await w.start.remote() for w in executor.workers}
                await settled(pool, held["batch_id"], ran["batch_id"])
        ran_in = set(pool.batches)
    ledger = await service_on_ray.emu.ledger()
    # Both rollouts ran on an actor each, in another process.
    assert {held["batch_id"], ran["batch_id"]} <= ran_in
    assert os.getpid() not in pids
    for rid in (held["rollout_id"], ran["rollout_id"]):
        events = [e for e in sink.events if e.attributes.get("rollout_id") == rid]
        assert events and len({e.attributes["worker"] for e in events}) == 1
    assert_pairs(sink)
    # The live view came from the actor (the driver alone knows only pending or done).
    assert live["phase"] not in ("pending", "done") and not live["done"]
    assert live["task_key"] == LEDGER[3].key
    assert aborted["failure_reason"] == "cancelled" and aborted["reward"] is None
    assert ran["reward"] == 1.0 and ran["task_key"] == LEDGER[4].key
    assert after["done"] and after["phase"] == "done" and after["steps"] == ran["steps"]
    assert transcript["done"] and transcript["messages"] == ran["transcript"]
    assert ledger["running"] == 0


def in_order(phases: list[str]) -> bool:
    """Each phase once, in the order a rollout goes through them (some may be missing:
    once the result is in, the actor lets the log go)."""
    positions = [ORDER.index(p) for p in phases]
    return positions == sorted(set(positions))


async def test_a_rollout_on_a_ray_actor_is_followed_live_and_reports_mcp_progress(
    service_on_ray: ServiceOnRay,
) -> None:
    pool, url = service_on_ray.pool, service_on_ray.url
    held = {"kind": "scripted", "think_time_s": 3600}
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async with Client(f"{url}/mcp") as mcp, FleetrollClient(url) as client:
        with anyio.fail_after(120):
            started = await mcp.call_tool(
                "start_rollout", {"task": mcp_task(LEDGER[3]), "policy": held}
            )
            assert isinstance(started.structured_content, dict)
            rid = started.structured_content["rollout_id"]
            followed = []
            async for event in client.follow(rid):
                followed.append(event)
                if event.kind == "phase" and event.data["phase"] == "acting":
                    # Seen live, from the actor: the policy holds it there.
                    await mcp.call_tool("abort_rollout", {"rollout_id": rid})
            ran = await mcp.call_tool(
                "run_rollout", {"task": mcp_task(LEDGER[4])}, progress_callback=on_progress
            )
            assert isinstance(ran.structured_content, dict)
            batch_ids = (started.structured_content["batch_id"], ran.structured_content["batch_id"])
            await settled(pool, *batch_ids)
    # The phases below were seen live on the actor: the driver's handle of a
    # rollout on Ray knows only pending, provisioning and done.
    ledger = await service_on_ray.emu.ledger()

    phases = [e.data["phase"] for e in followed if e.kind == "phase"]
    assert phases[:5] == ORDER[:5] and in_order(phases)
    assert followed[-1].kind == "end" and followed[-1].data["failure_reason"] == "cancelled"
    assert not ran.is_error
    reported = [m.removeprefix("phase ") for m in progress if m.startswith("phase ")]
    assert reported[:5] == ORDER[:5] and in_order(reported)
    assert any(m.startswith("tool ") for m in progress)
    assert progress[-1] == "end: completed"
    assert ledger["running"] == 0


#: Fleet's account limit in the emulator, and the cluster's instance cap.
LIMIT = 5


@pytest.fixture(scope="module")
async def admission_emu() -> AsyncIterator[EmulatorProcess]:
    profile = FaultProfile(
        instance_limit=LIMIT,
        broken_envs=("desktop:v1",),
        create_latency=Latency(min_s=0.01, max_s=0.05),
    )
    async with EmulatorProcess(profile) as emu:
        yield emu


@pytest.fixture(scope="module")
async def admitted(local_ray: None, admission_emu: EmulatorProcess) -> AsyncIterator[OnRay]:
    """Two actors under one cap of LIMIT instances, and one breaker per environment."""
    admission = {
        "max_instances": LIMIT,
        # One desktop instance at a time, cluster-wide: the breaker sees each failure in turn.
        "env": {"desktop:v1": {"max_instances": 1}},
        "breaker": {
            "window": 4,
            "min_rollouts": 4,
            "failure_share": 0.75,
            "on_open": "fail",
            "probe_interval_s": 3600,
        },
    }
    s = load_settings(
        pool={"concurrency": 32},
        provisioning={
            "max_concurrent_creates": 4,
            "creates_per_second": 500,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.5,
        },
        retries={"mcp_connect_attempts": 1},
        admission=admission,
    )
    tap = Tap()
    fleet = {"api_key": admission_emu.api_key, "base_url": admission_emu.base_url}
    async with ray_pool(s, **fleet, num_actors=2, events=Events([tap])) as pool:
        yield OnRay(admission_emu, pool, tap)


async def test_two_actors_hold_one_cap_of_5_instances_through_a_batch_of_30(
    admitted: OnRay,
) -> None:
    emu, pool = admitted.emu, admitted.pool
    refused_before = (await emu.ledger())["creates_by_outcome"].get("instance_limit", 0)
    with anyio.fail_after(300):
        results = await pool.run_batch(LEDGER[:15], ScriptedPolicy(), samples_per_task=2).results()
        await pool.admission.refresh(pool.events)
        state = pool.admission.state()
        limiter = await admitted.executor.limiter.stats.remote()
    ledger = await emu.ledger()
    assert len(results) == 30
    reasons = Counter(r.failure_reason for r in results)
    assert reasons[FailureReason.INIT_ERROR] == 0, [r.error for r in results if r.error][:3]
    assert all(r.status == "completed" for r in results)
    # Fleet's own count of running instances, at its highest, and no create it
    # had to refuse: the cap held across both actors (each with its own cap, 10 tried).
    assert ledger["peak_running"] <= LIMIT and ledger["running"] == 0
    assert ledger["creates_by_outcome"].get("instance_limit", 0) - refused_before == 0
    assert (state.limit, state.in_use, state.starting, state.queued) == (LIMIT, 0, 0, 0)
    assert limiter["peak"] <= 4 and limiter["in_use"] == 0


async def test_a_broken_environment_trips_one_breaker_for_the_cluster_while_a_healthy_one_runs_on(
    admitted: OnRay,
) -> None:
    emu, pool = admitted.emu, admitted.pool
    sink = Watch("fleet_env_quarantined")
    before = (await emu.ledger())["creates_by_env"].get("desktop", 0)
    with admitted.tap.into(sink), anyio.fail_after(300):
        results = await pool.run_batch([*LEDGER[:9], *DESKTOP[:9]], ScriptedPolicy()).results()
        await pool.admission.refresh(pool.events)
        # The pool's follower may be shipping it still (a pool of the test's own
        # would have had its last look on closing).
        with anyio.fail_after(30):
            await sink.seen.wait()
    state = pool.admission.state()
    ledger = await emu.ledger()
    by_env: dict[str, Counter[str | None]] = {"ledger": Counter(), "desktop": Counter()}
    for r in results:
        env = "desktop" if r.task_key.startswith("desktop") else "ledger"
        by_env[env][r.failure_reason.value if r.failure_reason else None] += 1
    assert by_env["ledger"] == Counter({None: 9})  # the healthy one ran on
    failed = by_env["desktop"]["init_error"]
    # The 4th failure's verdict reaches the limiter just after its place is
    # released: one more desktop rollout may have been admitted in between.
    # Per actor (before), each of the two actors tripped its own after 4 (8 in all).
    assert failed in (4, 5) and by_env["desktop"]["env_unavailable"] == 9 - failed
    assert ledger["creates_by_env"]["desktop"] - before == failed  # none for the rest
    [event] = sink.named("fleet_env_quarantined")
    assert (event.attributes["env_key"], event.attributes["env_version"]) == ("desktop", "v1")
    assert not sink.named("fleet_env_recovered")
    assert state.open_breakers == 1
    metrics = Metrics().render(in_flight=0, sessions_open=0, batches={}, admission=state)
    assert "fleetroll_admission_open_breakers 1" in metrics.splitlines()


async def test_batches_on_ray_cancelled_mid_provisioning_give_back_every_place_and_instance(
    local_ray: None,
) -> None:
    # Fleet here is this process's emulator (the actors reach it over loopback),
    # whose creates go on after their client left, as Fleet's do.
    cap, per_batch, cancels = 8, 4, 2
    s = load_settings(
        pool={"concurrency": cap},
        provisioning={
            "adaptive_creates": False,
            "max_concurrent_creates": cap,
            "creates_per_second": 500,
        },
        admission={"max_instances": cap},
    )
    slow = FaultProfile(create_latency=Latency(min_s=3.0, max_s=4.0), creates_outlive_clients=True)
    sink = MemorySink()
    async with Emulator(slow) as emu:
        changes = Changes(emu.ledger)
        fleet = {"api_key": emu.api_key, "base_url": emu.base_url}
        async with ray_pool(s, **fleet, num_actors=1, events=Events([sink, changes])) as pool:
            for n in range(cancels):
                batch = pool.run_batch(LEDGER[:per_batch], ScriptedPolicy(), batch_id=f"cut-{n}")

                async def arrived(sent: int = (n + 1) * per_batch) -> bool:
                    return creates_sent(emu.ledger) == sent

                with anyio.fail_after(120):
                    await changes.until(arrived)
                    batch.cancel()
                    results = await batch.results()
                assert {r.failure_reason for r in results} == {FailureReason.CANCELLED}

            async def returned() -> bool:
                ledger = emu.ledger.snapshot()
                await pool.admission.refresh(Events())
                state = pool.admission.state()
                return (
                    ledger["running"] == ledger["creates_in_flight"] == 0
                    and state.in_use == state.starting == state.creates_in_flight == 0
                )

            with anyio.move_on_after(10):  # from the last cancel
                await changes.until(returned)
            state, ledger = pool.admission.state(), emu.ledger.snapshot()
    # The cluster's one controller holds nothing; Fleet runs nothing.
    assert (state.in_use, state.starting, state.creates_in_flight) == (0, 0, 0), state
    assert (ledger["running"], ledger["created"]) == (0, cancels * per_batch), ledger
    events = sink.named("fleet_create_abandoned")
    assert len({e.attributes["instance_id"] for e in events}) == cancels * per_batch
    assert {e.attributes["outcome"] for e in events} == {"released"}
