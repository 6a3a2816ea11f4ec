"""Whose time ran out: the rollout's deadline (``timeouts.rollout_s``) and its timings.

When the deadline passes while the rollout waits on the platform (a reset, the
MCP connect, the tool listing, a tool call), the rollout is ``platform_timeout``
with no reward: the agent did not spend that time, and a verifier run on what
a cut-short operation left would be a fake score. Only the policy's own time
makes a scored ``timeout``. The timings account for every second of it.

These run the real state machine on the provider double; the batches on the
emulator's fault profiles, with deadlines shorter than the hangs they inject,
are in ``test_no_fake_zeros.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from test_state_machine import HANGING, TASK

from fleetroll.policies import ScriptedPolicy, ToolCall
from fleetroll.pool.assembly import rollout_config
from fleetroll.results import FailureReason, RolloutResult, Timings
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import Phase, RolloutIds
from fleetroll.rollout.progress import Progress
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events, MemorySink
from fleetroll.testing.fake_provider import FakeProvider, Operation

#: Every operation's own deadline is far away: only the rollout's can pass.
PATIENT = {"reset_s": 3600, "mcp_connect_s": 3600, "list_tools_s": 3600, "call_tool_s": 3600}


@asynccontextmanager
async def engine(
    hangs: tuple[Operation, ...] = (), **overrides: Any
) -> AsyncIterator[tuple[RolloutEngine, FakeProvider]]:
    settings = load_settings(**overrides)
    provider = FakeProvider(settings.modalities, timeouts=settings.timeouts, hangs=hangs)
    async with RolloutEngine.open(
        rollout_config(settings), Events([MemorySink()]), provider
    ) as eng:
        yield eng, provider
    assert provider.running == 0


async def run(
    task: TaskSpec, policy: ScriptedPolicy | None = None, **options: Any
) -> RolloutResult:
    async with engine(**options) as (eng, _):
        with anyio.fail_after(10):
            return await eng.rollout(task, RolloutIds("b", "r")).run(policy or ScriptedPolicy())


def assert_timings_add_up(t: Timings) -> None:
    parts = [value for name, value in t if name != "total_s"]
    assert min(parts) >= 0.0
    assert sum(parts) == pytest.approx(t.total_s, abs=1e-6)


@pytest.mark.parametrize(
    ("task", "hangs", "wait"),
    [
        (TASK, ("reset",), "resetting the instance"),
        (TASK, ("open_tools",), "connecting to the MCP endpoint memory://"),
        (TASK, ("list_tools",), "listing the tools of memory://"),
        (HANGING, (), "the tool call hang"),
    ],
    ids=["reset", "connect", "tool listing", "tool call"],
)
async def test_a_deadline_that_passes_while_the_platform_is_awaited_is_never_scored(
    task: TaskSpec, hangs: tuple[Operation, ...], wait: str
) -> None:
    # 1 s, not 0.2: on a loaded machine the steps before the hanging one (in-memory
    # fakes) took over 0.2 s, and the deadline passed in the wrong wait.
    result = await run(task, hangs=hangs, timeouts={**PATIENT, "rollout_s": 1.0})

    assert result.failure_reason is FailureReason.PLATFORM_TIMEOUT
    assert result.reward is None and result.verifier is None
    assert wait in (result.error or "") and "timeouts.rollout_s" in (result.error or "")
    assert_timings_add_up(result.timings)


async def test_a_deadline_that_passes_while_the_policy_thinks_is_timeout_and_still_scored() -> None:
    result = await run(
        TASK, ScriptedPolicy(think_time_s=3600), timeouts={**PATIENT, "rollout_s": 0.2}
    )

    assert result.failure_reason is FailureReason.TIMEOUT
    assert result.reward == 0.0  # the verifier's verdict: nothing was written
    assert result.verifier is not None and result.verifier.success


async def test_a_deadline_that_passes_during_a_session_step_is_platform_timeout() -> None:
    async with engine(timeouts={**PATIENT, "rollout_s": 0.2}) as (eng, _):
        with anyio.fail_after(10):
            async with eng.session(HANGING, RolloutIds("b", "r")) as env:
                step = await env.step(ToolCall(id="c1", name="hang", arguments={}))
            result = await env.close()
    assert step.done and result is not None
    assert result.failure_reason is FailureReason.PLATFORM_TIMEOUT and result.reward is None


async def test_a_deadline_passing_inside_a_wait_is_its_overrun_even_when_the_wait_finishes() -> (
    None
):
    # Where the deadline's cancellation lands can be a later await (a busy event
    # loop): the clock decides whose time ran out, not the await it lands on.
    progress = Progress()
    with progress.platform_wait("the tool call note"):
        # Time goes on inside the wait first: uvloop's clock is read once per loop
        # iteration, in whole milliseconds, so a deadline set at once would be the
        # wait's own start (nothing passed inside it).
        await anyio.sleep(0.002)
        progress.deadline = anyio.current_time()  # passes now, inside the wait
    assert progress.overrun is not None and progress.overrun[0] == "the tool call note"

    after = Progress(deadline=anyio.current_time())
    with after.platform_wait("the tool call note"):  # began after the deadline passed
        await anyio.lowlevel.checkpoint()
    assert after.overrun is None


async def test_the_timings_of_a_rollout_that_waited_for_a_slot_add_up_to_its_total() -> None:
    slots = anyio.CapacityLimiter(1)
    async with engine() as (eng, _):
        rollout = eng.rollout(TASK, RolloutIds("b", "r"), gate=lambda: slots)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await slots.acquire()
                tg.start_soon(rollout.run, ScriptedPolicy())
                await rollout.wait_until(lambda r: r.phase is Phase.WAITING)
                slots.release()
    assert rollout.result is not None and rollout.result.reward == 1.0
    t = rollout.result.timings
    assert t.slot_wait_s > 0.0 and t.connect_s > 0.0 and t.release_s > 0.0
    assert_timings_add_up(t)
