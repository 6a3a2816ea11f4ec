"""Every policy on either executor: the scripted policy, the built-in ``openai``
policy and an agent command, each running a batch to scored results in this
process and on Ray actors; on Ray, the ``openai`` policy travels as its settings
(an HTTP client does not pickle), a rollout that fails on its actor is that
rollout's failure, never the pool's, and ``PUT /v1/policy/version`` answers once
every actor has the version.

One file, so one worker process of the run starts Ray, once (``local_ray``),
and one pool of two actors (under a service, as ``fleetroll serve --ray``
opens it) serves every test on Ray; the chat server (vLLM-shaped: token ids and
logprobs) and the emulator are shared too.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

ray = pytest.importorskip("ray")

from fleetroll.client import FleetrollClient  # noqa: E402
from fleetroll.emulator import Emulator  # noqa: E402
from fleetroll.jobs.job import run_job  # noqa: E402
from fleetroll.policies import (  # noqa: E402
    OpenAIChatPolicy,
    Policy,
    ScriptedPolicy,
)
from fleetroll.pool.assembly import chat_policy_config, policy_from_settings  # noqa: E402
from fleetroll.pool.batch_pool import FleetTarget, open_batch_pool  # noqa: E402
from fleetroll.pool.journal import read_journal  # noqa: E402
from fleetroll.pool.ray.executor import RayExecutor  # noqa: E402
from fleetroll.pool.rollout_pool import RolloutPool  # noqa: E402
from fleetroll.results import FailureReason, RolloutResult  # noqa: E402
from fleetroll.rollout.agent_command import CommandAgent  # noqa: E402
from fleetroll.service import Service, create_app, serve_app  # noqa: E402
from fleetroll.settings import Settings, config_dir, load_settings  # noqa: E402
from fleetroll.tasks import TaskSpec, load_tasks  # noqa: E402
from fleetroll.telemetry import Events, MemorySink  # noqa: E402
from fleetroll.testing.fake_openai import FakeChatServer, Reply, VllmShape  # noqa: E402
from training_helpers import AGENT, sent_and_recorded, solving  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SETTINGS = load_settings(
    provisioning={"backoff_initial_s": 0.05, "backoff_max_s": 0.5},
    service={"tasks_root": str(config_dir())},
)
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
#: Two tasks, one sample each: a batch per policy and executor stays cheap.
TASKS = LEDGER[:2]


class Held:
    """The chat server's script: it plays each task's solution and, while armed,
    holds each call until released (counting the calls it holds)."""

    def __init__(self, tasks: list[TaskSpec]) -> None:
        self._solve = solving(tasks)
        self.armed = False
        self.held = 0
        self.arrived = anyio.Event()
        self.release = anyio.Event()
        self.expected = 0

    def arm(self, expected: int) -> None:
        self.armed, self.held, self.expected = True, 0, expected
        self.arrived, self.release = anyio.Event(), anyio.Event()

    def open(self) -> None:
        self.armed = False
        self.release.set()

    async def __call__(self, body: dict[str, Any]) -> Reply:
        if self.armed:
            self.held += 1
            if self.held >= self.expected:
                self.arrived.set()
            await self.release.wait()
        reply: Reply = self._solve(body)
        return reply


@dataclass
class Shared:
    """What the module's tests share: the emulator, the chat server and its script,
    a pool in this process, and a service on a pool of two Ray actors."""

    emu: Emulator
    chat: FakeChatServer
    script: Held
    local: RolloutPool
    on_ray: RolloutPool
    url: str
    sink: MemorySink

    @property
    def executor(self) -> RayExecutor:
        executor = self.on_ray.executor
        assert isinstance(executor, RayExecutor)
        return executor

    def settings(self) -> Settings:
        """The settings of an ``openai`` policy answered by the chat server."""
        policy = {"kind": "openai", "base_url": self.chat.base_url, "model": "served"}
        policy |= {"return_token_ids": True, "logprobs": True}
        return SETTINGS.model_copy(update={"policy": SETTINGS.policy.model_copy(update=policy)})


@pytest.fixture(scope="module")
async def shared(local_ray: None) -> AsyncIterator[Shared]:
    script = Held(LEDGER)
    sink = MemorySink()
    async with AsyncExitStack() as stack:
        emu = await stack.enter_async_context(Emulator())
        chat = await stack.enter_async_context(FakeChatServer(script, vllm=VllmShape()))
        local = await stack.enter_async_context(
            RolloutPool(SETTINGS, api_key=emu.api_key, base_url=emu.base_url)
        )
        on_ray, _ = await open_batch_pool(
            stack,
            SETTINGS,
            FleetTarget(emu.api_key, emu.base_url, "emulator"),
            Events([sink]),
            ray_address="local",
            ray_actors=2,
        )
        service = Service(on_ray, SETTINGS)
        url = await stack.enter_async_context(
            serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop)
        )
        yield Shared(emu, chat, script, local, on_ray, url, sink)


@asynccontextmanager
async def policy_of(kind: str, shared: Shared) -> AsyncIterator[Policy]:
    """A policy of ``kind``, as ``fleetroll run`` makes it from its settings."""
    if kind == "scripted":
        yield ScriptedPolicy()
    elif kind == "openai":
        async with OpenAIChatPolicy.from_config(chat_policy_config(shared.settings())) as policy:
            yield policy
    else:
        argv = [sys.executable, str(AGENT)]
        async with CommandAgent.from_config(argv, chat_policy_config(shared.settings())) as agent:
            yield agent


def ran_on_actors(shared: Shared, results: list[RolloutResult]) -> bool:
    """Whether every rollout's completed event came from a Ray actor (with its index)."""
    ids = {r.rollout_id for r in results}
    completed = [
        e for e in shared.sink.named("fleet_rollout_completed") if e.attributes["rollout_id"] in ids
    ]
    return len(completed) == len(ids) and all("worker" in e.attributes for e in completed)


async def actor_gates(shared: Shared) -> list[tuple[int, bool, int]]:
    """Each actor's gate now (version, paused, calls admitted): asked of all at once."""
    refs = [worker.gate_state.remote() for worker in shared.executor.workers]
    return [await ref for ref in refs]


@pytest.mark.parametrize("executor", ["local", "ray"])
@pytest.mark.parametrize("kind", ["scripted", "openai", "agent"])
async def test_every_policy_runs_a_batch_to_scored_results_on_either_executor(
    shared: Shared, executor: str, kind: str
) -> None:
    pool = shared.local if executor == "local" else shared.on_ray
    replied = len(shared.chat.replies)
    with anyio.fail_after(300):
        async with policy_of(kind, shared) as policy:
            batch = pool.run_batch(TASKS, policy, batch_id=f"{kind}-{executor}")
            results = await batch.results()
    replies = shared.chat.replies[replied:]
    assert sorted((r.task_key, r.reward) for r in results) == [(t.key, 1.0) for t in TASKS]
    if kind == "scripted":
        assert replies == []
    else:
        # The server's token ids and logprobs, recorded on the rollouts' turns.
        sent, recorded = sent_and_recorded(replies, results)
        assert recorded == sent and sum(len(r.turns) for r in results) == len(replies)
    if executor == "ray":
        assert ran_on_actors(shared, results)


async def test_run_on_ray_with_the_openai_policy_journals_every_rollout_scored(
    shared: Shared, tmp_path: Path
) -> None:
    """``fleetroll run --ray --policy openai``'s job (it journaled every rollout
    ``cancelled`` and exited 1: the policy did not pickle)."""
    settings = shared.settings()
    out = tmp_path / "results.jsonl"
    with anyio.fail_after(300):
        async with policy_from_settings(settings) as policy:  # as `fleetroll run` makes it
            report = await run_job(
                settings,
                TASKS,
                policy,
                out=out,
                ray_address="local",
                ray_actors=1,
            )
    journaled = read_journal(out)
    assert not report.interrupted and report.stopped is None
    assert sorted((r.task_key, r.reward) for r in journaled) == [(t.key, 1.0) for t in TASKS]
    assert all(r.turns for r in journaled)


class Unpicklable(ScriptedPolicy):
    """A policy that holds what cannot be pickled (as an HTTP client is)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = anyio.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("cannot pickle 'Unpicklable' object: it holds a lock")


class FailsOnTheActor(ScriptedPolicy):
    """A policy that pickles here and fails to load on the actor."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (operator.truediv, (1, 0))


async def test_on_ray_a_policy_that_cannot_travel_or_load_fails_its_rollouts_not_the_pool(
    shared: Shared,
) -> None:
    pool = shared.on_ray
    with anyio.fail_after(300):
        # A policy made by hand holds its HTTP client (not made from settings).
        by_hand = OpenAIChatPolicy(base_url=shared.chat.base_url, model="served")
        async with by_hand:
            unsent = await pool.run_batch(TASKS, by_hand, batch_id="by-hand").results()
        locked = await pool.run_batch(TASKS, Unpicklable(), batch_id="locked").results()
        unloaded = await pool.run_batch(TASKS, FailsOnTheActor(), batch_id="unloaded").results()
        # The pool (and the service on it) goes on: the next batch is scored.
        after = await pool.run_batch(TASKS, ScriptedPolicy(), batch_id="after").results()
        async with httpx.AsyncClient(base_url=shared.url, timeout=30) as http:
            health = await http.get("/v1/policy")
    for results, says in [
        (unsent, "OpenAIChatPolicy.from_config"),
        (locked, "it holds a lock"),
        (unloaded, "division by zero"),
    ]:
        assert len(results) == len(TASKS)
        for r in results:
            assert r.status == "failed" and r.reward is None
            assert r.failure_reason is FailureReason.INIT_ERROR
            assert r.error is not None and says in r.error
    assert "could not be sent to its Ray actor" in str(unsent[0].error)
    assert "failed on its Ray actor" in str(unloaded[0].error)
    assert [r.reward for r in after] == [1.0] * len(TASKS)
    assert health.status_code == 200


async def test_on_serve_ray_an_openai_batch_runs_and_each_call_after_a_version_put_records_it(
    shared: Shared,
) -> None:
    """``PUT /v1/policy/version`` answers once every actor has the version: the
    actors' gates hold it when the answer comes, and every policy call made
    after it (each rollout's second and later) records it."""
    executor, script = shared.executor, shared.script
    tasks = LEDGER[2:6]
    policy = {"kind": "openai", "base_url": shared.chat.base_url, "model": "served"}
    async with (
        httpx.AsyncClient(base_url=shared.url, timeout=30) as http,
        FleetrollClient(shared.url) as client,
    ):
        with anyio.fail_after(300):
            version = shared.on_ray.policy_version + 1
            script.arm(expected=len(tasks))  # each rollout's first call is held
            batch = client.run_batch(tasks, policy, batch_id="put")
            await batch.submit()
            await script.arrived.wait()
            put = await http.put("/v1/policy/version", json={"version": version})
            gates = await actor_gates(shared)  # when the answer came
            script.open()  # every later call is made after the answer
            results = [r async for r in batch]
    assert put.status_code == 200
    assert put.json()["version"] == version
    assert [v for v, _, _ in gates] == [version] * len(executor.workers)
    assert sorted((r.task_key, r.reward) for r in results) == sorted((t.key, 1.0) for t in tasks)
    for r in results:
        first, *later = [turn.policy_version for turn in r.turns]
        assert first == version - 1 and later and set(later) == {version}


async def test_on_ray_a_pause_and_a_version_set_return_once_every_actor_has_them(
    shared: Shared,
) -> None:
    pool = shared.on_ray
    with anyio.fail_after(60):
        version = pool.policy_version
        async with pool.policy_paused():
            in_pause = await actor_gates(shared)
            pool.policy_version = version + 1  # the weights swapped in the pause
        after_pause = await actor_gates(shared)
        await pool.set_policy_version(version + 2)
        after_set = await actor_gates(shared)
    assert {(v, paused) for v, paused, _ in in_pause} == {(version, True)}
    assert {(v, paused) for v, paused, _ in after_pause} == {(version + 1, False)}
    assert {(v, paused) for v, paused, _ in after_set} == {(version + 2, False)}
