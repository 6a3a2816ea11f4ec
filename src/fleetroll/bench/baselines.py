"""The baselines fleetroll is measured against, written honestly with the same
SDK (``fleet-python``) and MCP client (``mcp``) fleetroll uses.

``fresh-session``
    The reference design's habits: a fresh MCP session for every tool call,
    and a fixed wait before tool discovery (8 s in the reference; a
    parameter here). Otherwise it has fleetroll's deadlines and concurrency:
    every operation under the same timeout, creates retried as the reference
    did (5 attempts, 2 s * 2^n backoff, on top of the SDK's own transport
    retries), the instance released shielded and bounded.

``cpu-floor`` (:mod:`fleetroll.bench.cpu_floor`)
    fleetroll's requests written by hand over one keep-alive connection per
    rollout: the CPU floor. Only when asked for (``--baselines cpu-floor``).

``naive-gather``
    The loop a user writes by hand: ``asyncio.gather`` over every rollout,
    each doing ``AsyncFleet.make`` (SDK defaults: its transport retries on),
    ``env.reset()``, one ``mcp.Client`` session for the calls, the SDK's
    ``Task.verify_detailed_async`` and ``env.close()`` in a ``finally``. No
    deadlines, no limits. The harness bounds it with ``move_on_after`` and
    reports whether it finished on its own.

Both record one :class:`~fleetroll.bench.records.Sample` per rollout that
ended (instrumentation only: the naive loop's caller gets what ``gather``
returns, and nothing if it never returns).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
from fleet import AsyncFleet
from fleet import Task as FleetTask
from mcp import Client

from fleetroll.bench.cpu_floor import run_cpu_floor
from fleetroll.bench.records import Sample
from fleetroll.bench.systems import Outcome, RunContext
from fleetroll.policies import Policy, ToolSpec
from fleetroll.results import Timings
from fleetroll.tasks import TaskSpec

__all__ = ["BASELINE_SYSTEMS", "run_fresh_session", "run_naive_gather"]

_REFERENCE_ATTEMPTS = 5
_REFERENCE_BACKOFF_S = 2.0


def _fleet_task(task: TaskSpec) -> FleetTask:
    """The SDK's Task for one of ours (the SDK builds its verifier from the code)."""
    return FleetTask(
        key=task.key,
        prompt=task.prompt,
        env_id=task.env_key,
        version=task.env_version,
        data_id=task.data_key,
        data_version=task.data_version,
        verifier_func=task.verifier_func,
    )


def _expand(ctx: RunContext) -> list[TaskSpec]:
    return [task for task in ctx.tasks for _ in range(ctx.samples_per_task)]


def _specs(listed: Any) -> list[ToolSpec]:
    return [
        ToolSpec(name=t.name, description=t.description or "", input_schema=dict(t.input_schema))
        for t in listed.tools
    ]


def _reward(response: Any) -> float | None:
    if not getattr(response, "success", False):
        return None
    result = response.result
    return float(result) if isinstance(result, int | float) else None


class _Clock:
    """Adds the time spent in a block to one field of a Timings."""

    def __init__(self, timings: Timings, phase: str) -> None:
        self._timings = timings
        self._phase = phase
        self._began = 0.0

    def __enter__(self) -> None:
        self._began = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._began
        setattr(self._timings, self._phase, getattr(self._timings, self._phase) + elapsed)


# ------------------------------------------------------------- fresh-session


async def run_fresh_session(ctx: RunContext) -> Outcome:
    """The reference design's habits, under fleetroll's deadlines."""
    t = ctx.settings.timeouts
    wait_s = ctx.scenario.discovery_wait_s
    rollouts = anyio.CapacityLimiter(ctx.concurrency)
    fleet = AsyncFleet(api_key=ctx.api_key, base_url=ctx.base_url)
    fleet_tasks = {task.key: _fleet_task(task) for task in ctx.tasks}
    policy = ctx.policy()
    samples: list[Sample] = []

    async def make(task: TaskSpec, timings: Timings) -> Any:
        with _Clock(timings, "provision_s"), anyio.fail_after(t.provision_total_s):
            for attempt in range(_REFERENCE_ATTEMPTS):
                try:
                    with anyio.fail_after(t.provision_create_s):
                        return await fleet.make(task.env_spec, data_key=task.data_spec)
                except Exception:
                    if attempt == _REFERENCE_ATTEMPTS - 1:
                        raise
                await anyio.sleep(_REFERENCE_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    async def call(url: str, name: str, arguments: Mapping[str, Any]) -> None:
        with anyio.fail_after(t.call_tool_s):
            async with Client(url) as client:
                await client.call_tool(name, dict(arguments))

    async def one(task: TaskSpec) -> None:
        async with rollouts:
            began = time.perf_counter()
            timings = Timings()
            env: Any = None
            failure: str | None = None
            reward: float | None = None
            try:
                env = await make(task, timings)
                with _Clock(timings, "reset_s"), anyio.move_on_after(t.reset_s):
                    await env.reset()
                with anyio.fail_after(t.rollout_s):
                    await anyio.sleep(wait_s)  # the reference's fixed wait
                    with anyio.fail_after(t.mcp_connect_s + t.list_tools_s):
                        async with Client(env.mcp.url) as client:
                            tools = _specs(await client.list_tools())
                    await _play(policy, task, tools, t.policy_s, timings, env.mcp.url, call)
                with _Clock(timings, "verify_s"), anyio.fail_after(t.verifier_s):
                    reward = _reward(await fleet_tasks[task.key].verify_detailed_async(env))
                if reward is None:
                    failure = "verifier_error"
            except Exception as exc:
                failure = type(exc).__name__
            finally:
                if env is not None:
                    # A failed close shows up in the ledger's leak count.
                    with (
                        anyio.CancelScope(shield=True),
                        anyio.move_on_after(t.release_s),
                        contextlib.suppress(Exception),
                    ):
                        await env.close()
                timings.total_s = time.perf_counter() - began
                samples.append(Sample(reward=reward, failure=failure, timings=timings))

    with anyio.move_on_after(ctx.scenario.wall_limit_s) as scope:
        async with anyio.create_task_group() as tg:
            for task in _expand(ctx):
                tg.start_soon(one, task)
    return Outcome(
        samples=samples,
        returned=len(samples),
        finished_on_its_own=not scope.cancelled_caught,
        notes=[f"fixed wait before tool discovery: {wait_s:g} s"],
    )


async def _play(
    policy: Policy,
    task: TaskSpec,
    tools: Sequence[ToolSpec],
    policy_s: float | None,
    timings: Timings,
    url: str,
    call: Callable[[str, str, Mapping[str, Any]], Any],
) -> None:
    """The agent loop: ask the policy, run its calls, until it stops calling tools.

    A failed call is an error observation, as in fleetroll; the loop goes on.
    """
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    for _ in range((task.max_steps or 30) + 1):
        with _Clock(timings, "policy_s"):
            if policy_s is None:
                turn = await policy.act(task, messages, tools)
            else:
                with anyio.fail_after(policy_s):
                    turn = await policy.act(task, messages, tools)
        messages.append({"role": "assistant", "content": turn.content})
        if not turn.tool_calls:
            return
        for tool_call in turn.tool_calls:
            with _Clock(timings, "tools_s"):
                try:
                    await call(url, tool_call.name, tool_call.arguments)
                    text = "ok"
                except Exception as exc:
                    text = f"Error: {type(exc).__name__}"
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": text})


# -------------------------------------------------------------- naive-gather


async def run_naive_gather(ctx: RunContext) -> Outcome:
    """``asyncio.gather`` over hand-written rollouts, bounded only by the harness."""
    fleet = AsyncFleet(api_key=ctx.api_key, base_url=ctx.base_url)  # SDK defaults
    fleet_tasks = {task.key: _fleet_task(task) for task in ctx.tasks}
    policy = ctx.policy()
    samples: list[Sample] = []

    async def rollout(task: TaskSpec) -> float | None:
        began = time.perf_counter()
        timings = Timings()
        reward: float | None = None
        failure: str | None = "cancelled"  # unless it ends some other way
        try:
            with _Clock(timings, "provision_s"):
                env = await fleet.make(task.env_spec, data_key=task.data_spec)
            try:
                with _Clock(timings, "reset_s"):
                    await env.reset()
                async with Client(env.mcp.url) as client:
                    tools = _specs(await client.list_tools())

                    async def call(url: str, name: str, arguments: Mapping[str, Any]) -> None:
                        await client.call_tool(name, dict(arguments))

                    await _play(policy, task, tools, None, timings, env.mcp.url, call)
                with _Clock(timings, "verify_s"):
                    reward = _reward(await fleet_tasks[task.key].verify_detailed_async(env))
                failure = "verifier_error" if reward is None else None
                return reward
            finally:
                await env.close()
        except Exception as exc:  # instrumentation: record, then re-raise as is
            failure = type(exc).__name__
            raise
        finally:
            timings.total_s = time.perf_counter() - began
            samples.append(Sample(reward=reward, failure=failure, timings=timings))

    before = asyncio.all_tasks()
    gathered = asyncio.gather(*(rollout(t) for t in _expand(ctx)), return_exceptions=True)
    returned = 0
    # The harness's bound, not the baseline's. Cancelling a gather from an
    # anyio scope re-cancels the waiting task while gather's children unwind,
    # so the scope waits on a shield and the gather is cancelled separately.
    with anyio.move_on_after(ctx.scenario.wall_limit_s) as scope:
        results = await asyncio.shield(gathered)
        returned = sum(1 for r in results if not isinstance(r, BaseException))
    leftovers = asyncio.all_tasks() - before

    async def cleanup() -> None:
        # After the ledger was read: cancel what gather left running, as a
        # user's asyncio.wait_for would, so it cannot disturb the next run.
        gathered.add_done_callback(_retrieve)
        gathered.cancel()
        if leftovers:
            with anyio.move_on_after(30):
                await asyncio.wait(leftovers)

    notes = []
    if scope.cancelled_caught:
        notes.append("gather never returned: the caller got no results")
    return Outcome(
        samples=samples,
        returned=returned,
        finished_on_its_own=not scope.cancelled_caught,
        notes=notes,
        cleanup=cleanup if scope.cancelled_caught else None,
    )


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a cancelled gather's outcome as seen (asyncio logs it otherwise)."""
    if not future.cancelled():
        future.exception()


BASELINE_SYSTEMS = {
    "fresh-session": run_fresh_session,
    "naive-gather": run_naive_gather,
    "cpu-floor": run_cpu_floor,
}
