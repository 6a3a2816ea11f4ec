"""Many policy servers: the router's choice, stickiness, cap and ejection, and the
policy moving a rollout off a dead server (in-process; no sleeps, a hand-held clock)."""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from click.testing import CliRunner

from fleetroll.cli.main import main
from fleetroll.errors import PolicyError
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.policies.servers import (
    Affinity,
    PolicyServers,
    Server,
    ServerLimits,
    shown_url,
    sticky,
)
from fleetroll.pool.preflight import check_policy
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.testing.fake_openai import completion

A, B = "http://a.test/v1", "http://b.test/v1"
TASK = TaskSpec(key="t", prompt="hi", env_key="ledger")
PROMPT = [{"role": "user", "content": "hi"}]


def check_policy_of(settings: Settings) -> Awaitable[list[str]]:
    """The policy pre-flight as a job runs it, from ``settings``' sections."""
    return check_policy(
        settings.policy, api_key=settings.openai_api_key, timeout_s=settings.timeouts.preflight_s
    )


class Clock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def router(*urls: str, clock: Clock | None = None, **limits: Any) -> PolicyServers:
    return PolicyServers(list(urls) or [A, B], ServerLimits(**limits), clock=clock or Clock())


async def hold(
    servers: PolicyServers, stack: AsyncExitStack, affinity: Affinity | None = None
) -> Server:
    """Start a call and keep it in flight until ``stack`` closes."""
    return await stack.enter_async_context(servers.call(affinity))


# -- choice and stickiness ----------------------------------------------------------------


async def test_a_new_rollout_goes_to_the_server_with_the_fewest_calls_in_flight() -> None:
    servers = router()
    async with AsyncExitStack() as stack:
        first = await hold(servers, stack)
        second = await hold(servers, stack)
        third = await hold(servers, stack)
        fourth = await hold(servers, stack)
        assert {first.url, second.url} == {A, B}  # the second had room only on the other
        assert {third.url, fourth.url} == {A, B}
        assert [s.in_flight for s in servers.servers] == [2, 2]
    assert [s.in_flight for s in servers.servers] == [0, 0]


async def test_every_call_of_a_rollout_goes_to_the_server_of_its_first_call() -> None:
    servers = router()
    rollout = Affinity()
    async with servers.call(rollout) as own:
        pass
    async with AsyncExitStack() as stack:
        for _ in range(5):
            # Its server is busier than the other now, yet its calls stay there.
            await hold(servers, stack, Affinity())
            async with servers.call(rollout) as server:
                assert server is own
    assert rollout.used == [own]


# -- the cap ------------------------------------------------------------------------------


async def test_calls_over_a_servers_cap_wait_until_one_of_its_calls_ends() -> None:
    servers = router(A, max_calls=1)
    entered = anyio.Event()

    async def second_call() -> None:
        async with servers.call():
            entered.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            async with servers.call():
                tg.start_soon(second_call)
                await anyio.wait_all_tasks_blocked()
                assert not entered.is_set()
                assert servers.servers[0].in_flight == 2  # the waiting call counts as load
            await entered.wait()
    assert servers.servers[0].in_flight == 0


# -- health -------------------------------------------------------------------------------


async def test_a_failing_server_is_ejected_its_rollouts_move_and_it_comes_back_later() -> None:
    clock = Clock()
    servers = router(clock=clock, eject_after_failures=2, eject_s=10.0)
    rollout = Affinity()
    a, b = servers.servers
    assert servers.choose(rollout) is a

    servers.failed(a)  # one failure is not enough
    assert servers.choose(rollout) is a
    servers.failed(a)
    assert servers.choose(rollout) is b  # ejected: the rollout goes on elsewhere
    assert rollout.used == [a, b]
    assert {servers.choose(Affinity()) for _ in range(4)} == {b}  # new rollouts avoid it
    assert servers.choose(rollout) is b  # and the rollout stays where it moved

    clock.now = 10.0  # its time is up: it takes new rollouts again
    assert {servers.choose(Affinity()) for _ in range(4)} == {a, b}
    servers.failed(a)  # on probation: one more failure ejects it again
    assert not servers.healthy(a)

    clock.now = 20.0
    servers.succeeded(a)  # one success makes it healthy for good
    servers.failed(a)
    assert servers.healthy(a)


async def test_when_every_server_is_ejected_a_rollout_still_tries_its_own() -> None:
    servers = router(eject_after_failures=1)
    rollout = Affinity()
    a, b = servers.servers
    assert servers.choose(rollout) is a
    servers.failed(a)
    servers.failed(b)
    assert servers.choose(rollout) is a
    assert servers.choose(Affinity()) in (a, b)


def test_a_router_refuses_no_servers_and_a_server_listed_twice() -> None:
    with pytest.raises(ValueError, match="at least one"):
        PolicyServers([])
    with pytest.raises(ValueError, match="twice"):
        PolicyServers([A, A + "/"])
    with pytest.raises(ValueError, match="eject_s"):
        ServerLimits(eject_s=0)


def test_a_server_is_shown_without_its_credentials_or_query() -> None:
    assert shown_url("http://user:s3cret@a.test:8000/v1/?key=s3cret") == "http://a.test:8000/v1"
    assert PolicyServers(["http://u:p@a.test/v1"]).servers[0].name == "http://a.test/v1"


# -- the policy over the router -----------------------------------------------------------


def two_servers(dead: set[str]) -> tuple[httpx.AsyncClient, list[str]]:
    """One transport for both hosts (``dead`` ones refuse), and the hosts asked, in order."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host in dead:
            raise httpx.ConnectError("connection refused", request=request)
        json.loads(request.content)
        return httpx.Response(200, json=completion("done"))

    return httpx.AsyncClient(transport=httpx.MockTransport(handler)), asked


async def test_a_rollout_whose_server_dies_has_its_call_retried_on_the_other_server() -> None:
    dead: set[str] = set()
    client, asked = two_servers(dead)
    servers = router(eject_after_failures=2)
    async with OpenAIChatPolicy(
        servers=servers, model="m", http_client=client, backoff_initial_s=0, backoff_max_s=0
    ) as model:
        with sticky(), anyio.fail_after(5):
            first = await model.act(TASK, PROMPT, [])
            dead.add("a.test")
            second = await model.act(TASK, PROMPT, [])
            third = await model.act(TASK, PROMPT, [])

    assert first.data is not None and first.data.server == A
    assert second.data is not None and second.data.server == B
    assert third.data is not None and third.data.server == B
    # Two refusals ejected a.test; the retry went to b.test, and so did the next call.
    assert asked == ["a.test", "a.test", "a.test", "b.test", "b.test"]
    assert not servers.healthy(servers.servers[0])


async def test_with_one_server_a_turn_does_not_say_where_it_went() -> None:
    client, _ = two_servers(set())
    async with OpenAIChatPolicy(base_url=A, model="m", http_client=client) as model:
        with anyio.fail_after(5):
            turn = await model.act(TASK, PROMPT, [])
    assert turn.data is not None and turn.data.server is None


# -- settings and pre-flight --------------------------------------------------------------


def test_base_urls_win_over_base_url_and_a_server_listed_twice_is_refused() -> None:
    assert load_settings(policy={"base_url": A}).policy.servers == [A]
    assert load_settings(policy={"base_url": A, "base_urls": [B, A]}).policy.servers == [B, A]
    with pytest.raises(Exception, match="listed twice"):
        load_settings(policy={"base_urls": [A, A + "/"]})


def test_fleetroll_run_refuses_the_same_base_url_twice_in_one_line(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"key": "t", "prompt": "hi", "env_key": "ledger"}\n')
    args = ["run", str(tasks), "--policy", "openai", "--base-url", A, "--base-url", A + "/"]

    done = CliRunner().invoke(main, args)

    assert done.exit_code == 2, done.output
    assert done.stderr == "Error: --base-url names the same policy server twice: give each once\n"


def dead_url() -> str:
    """A loopback URL nothing listens on (a port just bound and let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


async def test_the_pre_flight_asks_every_server_and_names_each_dead_one() -> None:
    first, second = dead_url(), dead_url()
    settings: Settings = load_settings(
        policy={"kind": "openai", "base_urls": [first, second]}, timeouts={"preflight_s": 5}
    )

    problems = await check_policy_of(settings)

    assert len(problems) == 2
    assert first in problems[0] and second in problems[1]


async def test_a_malformed_answer_is_blamed_on_the_server_that_sent_it() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b.test":
            return httpx.Response(200, json={"choices": []})
        return httpx.Response(200, json=completion("done"))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    async with OpenAIChatPolicy(servers=router(), model="m", http_client=client) as model:
        with anyio.fail_after(5):
            await model.act(TASK, PROMPT, [])  # a.test: new rollouts take turns on ties
            with pytest.raises(PolicyError, match=r"^http://b\.test/v1/chat/completions answered"):
                await model.act(TASK, PROMPT, [])
