"""Shared servers score right: a failed reset that makes the state fresh is never
scored, and a url server serves its rollouts one at a time (or as many as the task
says) from before their reset until they are released. In-process: the provider
double, the mcp provider's url instances (making one opens no socket) and
:class:`~fleetroll.environments.mcp.leases.ServerLeases` itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.environments.mcp.leases import ServerLeases
from fleetroll.environments.mcp.provider import McpHandle, McpProvider
from fleetroll.environments.provider import Instance
from fleetroll.errors import ToolsError
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import mcp_provider, rollout_config
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec, parse_task
from fleetroll.telemetry.events import Events, MemorySink
from fleetroll.testing.fake_provider import FakeProvider

URL = "http://127.0.0.1:9/mcp"  # nothing listens: provisioning a url instance opens no socket
#: Writes "done": the provider double's verifier then says 1.0.
DONE = parse_task(
    {"key": "note-done", "prompt": "Write done.", "env_key": "fake",
     "solution": [{"name": "note", "arguments": {"word": "done"}}],
     # Fleet tasks carry a verifier; the provider double scores by the note instead.
     "verifier_func": "def verify(env, final_answer=None):\n    return 1.0\n"},
    source="test",
    modalities={"tool_use"},
)  # fmt: skip


async def waits(leases: ServerLeases, work: Callable[[], Awaitable[object]]) -> bool:
    """Whether ``work`` ends up waiting for a lease on ``URL`` (it is then cancelled)
    rather than finishing."""
    done = False

    async def run() -> None:
        nonlocal done
        await work()
        done = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        # Until one or the other: making a workdir runs on a thread first.
        while not done and leases.waiting(URL) == 0:
            await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    return not done


async def run_on_fake(provider_options: dict[str, Any]) -> tuple[RolloutResult, MemorySink]:
    settings = load_settings()
    sink = MemorySink()
    provider = FakeProvider(settings.modalities, timeouts=settings.timeouts, **provider_options)
    async with RolloutEngine.open(rollout_config(settings), Events([sink]), provider) as engine:
        with anyio.fail_after(10):
            result = await engine.rollout(DONE, RolloutIds("b", "r")).run(ScriptedPolicy())
    assert provider.running == 0  # released, whatever the outcome
    return result, sink


async def test_a_failed_reset_where_it_makes_the_state_fresh_is_reset_failed_unscored() -> None:
    failure = ToolsError(
        "reset (POST http://server/reset) answered an error: HTTP 500", operation="reset"
    )

    result, sink = await run_on_fake({"reset_error": failure, "reset_required": True})

    assert result.failure_reason is FailureReason.RESET_FAILED and result.status == "failed"
    assert result.reward is None and result.verifier is None  # never scored
    assert result.steps == 0  # the agent never acted on a state it did not start from
    assert result.error is not None and "POST http://server/reset" in result.error
    [event] = sink.named("fleet_env_reset_failed")
    assert event.level == "error"


async def test_a_failed_reset_of_an_instance_fresh_anyway_is_only_logged() -> None:
    failure = ToolsError("the reset endpoint answered 500", operation="reset")

    result, sink = await run_on_fake({"reset_error": failure})

    assert result.failure_reason is None and result.reward == 1.0
    [event] = sink.named("fleet_env_reset_failed")
    assert event.level == "warn"


# -- the leases -----------------------------------------------------------------


async def test_a_url_s_leases_are_given_one_at_a_time_in_the_order_asked() -> None:
    leases = ServerLeases()
    first, second, third = object(), object(), object()
    order: list[str] = []

    async def take(name: str, holder: object, asked: anyio.Event) -> None:
        asked.set()
        await leases.acquire(URL, 1, holder)
        order.append(name)

    with anyio.fail_after(5):
        await leases.acquire(URL, 1, first)
        async with anyio.create_task_group() as tg:
            for name, holder in (("second", second), ("third", third)):
                asked = anyio.Event()
                tg.start_soon(take, name, holder, asked)
                await asked.wait()
            await anyio.wait_all_tasks_blocked()
            assert order == [] and leases.held(URL) == 1
            leases.release(URL, first)
            await anyio.wait_all_tasks_blocked()
            assert order == ["second"]
            leases.release(URL, second)
    assert order == ["second", "third"] and leases.held(URL) == 1
    leases.release(URL, third)
    assert leases.held(URL) == 0


async def test_other_urls_do_not_wait_and_a_declared_limit_lets_that_many_in() -> None:
    leases = ServerLeases()
    with anyio.fail_after(5):
        for n in range(3):
            await leases.acquire(URL, 3, ("a", n))
        await leases.acquire("http://127.0.0.1:10/mcp", 1, "b")
    assert leases.held(URL) == 3 and leases.held("http://127.0.0.1:10/mcp") == 1


async def test_tasks_declaring_different_limits_on_one_url_get_the_smallest() -> None:
    leases = ServerLeases()
    with anyio.fail_after(5):
        await leases.acquire(URL, 4, "a")
        await leases.acquire(URL, 2, "b")
        assert leases.limit(URL) == 2
        assert await waits(leases, lambda: leases.acquire(URL, 4, "c"))  # a third waits
        assert leases.held(URL) == 2
        leases.release(URL, "a")
        assert not await waits(leases, lambda: leases.acquire(URL, 4, "c"))


# -- the mcp provider's url instances ---------------------------------------------


def url_task(key: str = "shared", **environment: Any) -> TaskSpec:
    record = {
        "key": key,
        "prompt": "Use the server.",
        "environment": {"url": URL, **environment},
        "verifier": {"tool": {"name": "check"}},
    }
    return parse_task(record, source="test", modalities={"tool_use"})


def provider_in(root: Path) -> McpProvider:
    return mcp_provider(load_settings(mcp={"workdir_root": str(root)}), Events())


def workdirs(root: Path) -> list[Path]:
    return list(root.iterdir()) if root.exists() else []


async def test_a_url_server_s_next_rollout_is_provisioned_once_the_last_is_released(
    tmp_path: Path,
) -> None:
    provider = provider_in(tmp_path)
    task = url_task()
    got: list[Instance] = []

    async def provision() -> None:
        got.append(await provider.provision(task, run_id="b"))

    with anyio.fail_after(5):
        first = await provider.provision(task, run_id="b")
        assert first.reset_required  # the server keeps the last rollout's state
        async with anyio.create_task_group() as tg:
            tg.start_soon(provision)
            while provider.leases.waiting(URL) == 0:  # its workdir is made on a thread first
                await anyio.wait_all_tasks_blocked()
            assert got == [] and provider.leases.held(URL) == 1  # waiting, as provisioning
            await provider.release(first)
        [second] = got
        await provider.release(second)
    assert provider.leases.held(URL) == 0 and workdirs(tmp_path) == []


async def test_a_rollout_cancelled_while_it_waits_for_the_server_leaks_no_lease_or_workdir(
    tmp_path: Path,
) -> None:
    provider = provider_in(tmp_path)
    task = url_task()
    with anyio.fail_after(5):
        holder = await provider.provision(task, run_id="b")
        assert await waits(provider.leases, lambda: provider.provision(task, run_id="b"))
        assert provider.leases.held(URL) == 1 and len(workdirs(tmp_path)) == 1  # the holder's
        await provider.release(holder)
        # The lease is free: the next one gets it at once.
        again = await provider.provision(task, run_id="b")
        assert await provider.sweep("b") == 1  # a sweep gives leases back too
    assert provider.leases.held(URL) == 0 and workdirs(tmp_path) == []
    assert isinstance(again.handle, McpHandle) and not again.handle.leased


async def test_a_url_task_declaring_two_lets_two_rollouts_hold_the_server(tmp_path: Path) -> None:
    provider = provider_in(tmp_path)
    task = url_task(max_concurrent_rollouts=2)
    with anyio.fail_after(5):
        both = [await provider.provision(task) for _ in range(2)]
        assert await waits(provider.leases, lambda: provider.provision(task))
        assert provider.leases.held(URL) == 2
        for instance in both:
            await provider.release(instance)
    assert provider.leases.held(URL) == 0


@pytest.mark.parametrize(
    "reset",
    [
        {"http": {"url": "http://user:hunter2@127.0.0.1:9/reset?token=hunter2"}},
        {"tool": {"name": "clear"}},
    ],
)
async def test_a_url_server_s_failed_reset_names_where_without_its_secrets(
    tmp_path: Path, reset: dict[str, Any]
) -> None:
    settings = load_settings(
        mcp={"workdir_root": str(tmp_path)},
        timeouts={"mcp_connect_s": 2.0, "reset_s": 5.0},
        retries={"mcp_connect_attempts": 1},
    )
    provider = mcp_provider(settings, Events())
    task = url_task(reset=reset)
    with anyio.fail_after(10):
        instance = await provider.provision(task)
        try:
            with pytest.raises(ToolsError) as caught:
                await provider.reset(instance, task)
        finally:
            await provider.release(instance)
    message = str(caught.value)
    assert "http://127.0.0.1:9/" in message and message.startswith("reset (")
    assert "hunter2" not in message and "user" not in message
