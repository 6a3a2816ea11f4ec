"""Pre-flight: a typo in an env, a key or a policy URL costs seconds, never a batch."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetroll._internal.serving import serve_asgi
from fleetroll.emulator import Emulator
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.errors import PreflightError
from fleetroll.jobs.same_failures import SameFailures
from fleetroll.pool.assembly import fleet_provider, mcp_provider, mixed_provider
from fleetroll.pool.journal import read_journal
from fleetroll.pool.preflight import check_policy, missing_environments, preflight
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.service import serve_app
from fleetroll.settings import Settings, config_dir, load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.tasks.mcp import McpEnvironment
from fleetroll.telemetry import Events
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape
from fleetroll.testing.fake_provider import FakeProvider


def check_policy_of(settings: Settings) -> Awaitable[list[str]]:
    """The policy pre-flight as a job runs it, from ``settings``' sections."""
    return check_policy(
        settings.policy, api_key=settings.openai_api_key, timeout_s=settings.timeouts.preflight_s
    )


LEDGER = config_dir() / "tasks" / "ledger.jsonl"


def task(env_key: str, version: str | None = "v1", key: str = "t") -> TaskSpec:
    return TaskSpec(key=key, prompt="p", env_key=env_key, env_version=version)


def dead_url() -> str:
    """A loopback URL nothing listens on (a port just bound and let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def openai_settings(base_url: str) -> Settings:
    return load_settings(policy={"kind": "openai", "base_url": base_url})


# -- unit: what is missing, said once per distinct env version -------------------------


def test_an_unknown_environment_is_named_once_with_a_suggestion_and_what_exists() -> None:
    tasks = [task("ledgr", key="a"), task("ledgr", key="b"), task("ledger")]

    problems = missing_environments(tasks, {"ledger": {"v1"}, "desktop": {"v1"}})

    assert problems == [
        "unknown environment 'ledgr' (2 tasks); did you mean 'ledger'? "
        "environments: desktop, ledger"
    ]


def test_an_unknown_version_lists_the_versions_and_a_task_without_one_takes_the_default() -> None:
    tasks = [task("ledger", "v3"), task("ledger", None)]

    problems = missing_environments(tasks, {"ledger": {"v1", "v2"}})

    assert problems == ["environment 'ledger' has no version 'v3' (1 task); versions: v1, v2"]


async def test_the_provider_s_problems_and_the_policy_s_come_in_one_error() -> None:
    provider = FakeProvider(
        load_settings().modalities, preflight_problems=["environment x is gone"]
    )
    settings = openai_settings(f"{dead_url()}/v1")

    with pytest.raises(PreflightError) as caught:
        await preflight(provider, [task("x")], lambda: check_policy_of(settings))

    assert provider.preflights == 1
    assert caught.value.problems[0] == "environment x is gone"
    assert "GET http://127.0.0.1:" in caught.value.problems[1]
    assert "--no-preflight" in str(caught.value)


async def test_a_clean_provider_and_the_scripted_policy_pass() -> None:
    provider = FakeProvider(load_settings().modalities)

    await preflight(provider, [task("ledger")], lambda: check_policy_of(load_settings()))

    assert provider.preflights == 1


# -- the policy endpoint ------------------------------------------------------------


async def test_a_policy_endpoint_that_answers_its_model_listing_passes() -> None:
    async with FakeChatServer() as server:
        assert await check_policy_of(openai_settings(server.base_url)) == []
        assert server.requests == []  # no chat completion was spent on it


async def test_a_policy_base_url_missing_its_v1_is_a_problem_with_the_url() -> None:
    async with FakeChatServer() as server:
        base = server.base_url.removesuffix("/v1")
        problems = await check_policy_of(openai_settings(base))

    assert problems == [
        f"the policy endpoint answered 404 to GET {base}/models"
        " (is --base-url / policy.base_url right? it usually ends in /v1)"
    ]


async def test_token_in_against_a_server_without_its_routes_is_a_problem_before_the_batch() -> None:
    async with FakeChatServer(vllm=VllmShape()) as server:
        policy = {"kind": "openai", "token_in": True, "base_url": server.base_url}
        settings = load_settings(policy=policy)
        problems = await check_policy_of(settings)
        root = server.base_url.removesuffix("/v1")

    assert [p.split(",")[0] for p in problems] == [
        f"policy.token_in needs POST {root}/tokenize",
        f"policy.token_in needs POST {server.base_url}/chat/completions/tokens",
    ]
    assert all("set policy.token_in = false" in p for p in problems)


async def test_token_in_against_a_server_with_its_routes_passes_without_generating() -> None:
    async with FakeChatServer(vllm=VllmShape(token_in=True)) as server:
        policy = {"kind": "openai", "token_in": True, "base_url": server.base_url}
        settings = load_settings(policy=policy)
        assert await check_policy_of(settings) == []
        assert server.requests == [] and server.replies == []


async def test_a_policy_url_s_password_never_appears_in_the_problem() -> None:
    url = dead_url().replace("http://", "http://user:s3cret@") + "/v1"

    problems = await check_policy_of(openai_settings(url))

    assert len(problems) == 1 and "s3cret" not in problems[0], problems


# -- FleetProvider against the emulator -----------------------------------------------


async def test_fleet_s_preflight_finds_unknown_envs_and_versions_in_the_listing(
    emulator: Emulator,
) -> None:
    provider = fleet_provider(
        load_settings(), Events(), api_key=emulator.api_key, base_url=emulator.base_url
    )
    try:
        ok = await provider.preflight([task("ledger"), task("desktop", None)])
        bad = await provider.preflight([task("ledger", "v9"), task("ledgre")])
    finally:
        await provider.aclose()

    assert ok == []
    assert bad[0].startswith("environment 'ledger' has no version 'v9' (1 task); versions: ")
    assert bad[1].startswith("unknown environment 'ledgre' (1 task); did you mean 'ledger'?")


async def test_fleet_s_preflight_says_a_key_was_refused_and_never_shows_it(
    emulator: Emulator,
) -> None:
    wrong = "sk-wrong-key-1234"
    provider = fleet_provider(load_settings(), Events(), api_key=wrong, base_url=emulator.base_url)
    try:
        problems = await provider.preflight([task("ledger")])
    finally:
        await provider.aclose()

    assert problems == [
        f"FLEET_API_KEY was refused by the Fleet control plane at {emulator.base_url} (401)"
    ]


async def test_fleet_s_preflight_says_when_nothing_answers_at_the_base_url() -> None:
    url = dead_url()
    provider = fleet_provider(load_settings(), Events(), api_key="k", base_url=url)
    try:
        problems = await provider.preflight([task("ledger")])
    finally:
        await provider.aclose()

    assert len(problems) == 1
    assert problems[0].startswith(f"cannot reach a Fleet control plane at {url}")
    assert "FLEET_BASE_URL" in problems[0]


async def test_fleet_s_preflight_asks_a_busy_control_plane_again(emulator: Emulator) -> None:
    headers = {"Authorization": f"Bearer {emulator.api_key}"}
    async with httpx.AsyncClient() as http:
        listing = (await http.get(f"{emulator.base_url}/v1/env/", headers=headers)).json()
    answers = [503, 429]

    async def envs(request: Request) -> Response:
        if answers:  # busy twice, then the real listing
            return JSONResponse({"detail": "busy"}, status_code=answers.pop(0))
        return JSONResponse(listing)

    app = Starlette(routes=[Route("/v1/env/", envs)])
    settings = load_settings(provisioning={"backoff_initial_s": 0.01, "backoff_max_s": 0.01})
    async with serve_app(app, "127.0.0.1", 0) as url:
        provider = fleet_provider(settings, Events(), api_key="k", base_url=url)
        try:
            with anyio.fail_after(30):
                problems = await provider.preflight([task("ledger")])
        finally:
            await provider.aclose()

    assert problems == []
    assert answers == []  # both busy answers were asked again


async def test_fleet_s_preflight_says_when_the_base_url_is_not_a_fleet() -> None:
    async with FakeChatServer() as server:  # answers HTTP, but not Fleet's routes
        url = server.base_url.removesuffix("/v1")
        provider = fleet_provider(load_settings(), Events(), api_key="k", base_url=url)
        try:
            problems = await provider.preflight([task("ledger")])
        finally:
            await provider.aclose()

    assert problems == [
        f"{url} answered 404 to the environment listing (GET /v1/env/):"
        " not a Fleet control plane? (is FLEET_BASE_URL right?)"
    ]


# -- the early stop -------------------------------------------------------------------


def failed(n: int, reason: FailureReason, error: str) -> RolloutResult:
    return RolloutResult(
        rollout_id=f"r{n}",
        batch_id="b",
        task_key="t",
        env_key="ledger",
        modality="tool_use",
        status="failed",
        failure_reason=reason,
        error=error,
    )


def test_the_same_failure_n_times_stops_and_numbers_in_the_error_do_not_matter() -> None:
    same = SameFailures(3)
    says = [
        same.add(failed(n, FailureReason.INIT_ERROR, f"create of inst-{n} failed after {n} s"))
        for n in range(3)
    ]

    assert says[:2] == [None, None]
    assert says[2] is not None and says[2].startswith(
        "the first 3 rollouts to finish all failed with init_error: create of inst-0 failed"
    )


def test_a_completed_rollout_or_another_failure_among_the_first_n_never_stops() -> None:
    mixed, other = SameFailures(2), SameFailures(2)
    ok = failed(1, FailureReason.INIT_ERROR, "x").model_copy(
        update={"status": "completed", "failure_reason": None, "error": None, "reward": 1.0}
    )

    assert mixed.add(failed(0, FailureReason.INIT_ERROR, "boom")) is None
    assert mixed.add(ok) is None
    assert mixed.add(failed(2, FailureReason.INIT_ERROR, "boom")) is None  # past the first 2
    assert other.add(failed(0, FailureReason.INIT_ERROR, "boom")) is None
    assert other.add(failed(1, FailureReason.POLICY_ERROR, "boom")) is None


def test_scored_failures_like_max_steps_never_stop_a_batch() -> None:
    same = SameFailures(2)
    scored = failed(0, FailureReason.MAX_STEPS, "ran out of steps").model_copy(
        update={"reward": 0.0}
    )

    assert [same.add(scored), same.add(scored)] == [None, None]


def test_cancelled_rollouts_do_not_count_and_zero_turns_it_off() -> None:
    same, off = SameFailures(2), SameFailures(0)
    boom = failed(0, FailureReason.INIT_ERROR, "boom")

    assert same.add(failed(9, FailureReason.CANCELLED, "cancelled")) is None
    assert same.add(boom) is None
    assert same.add(boom) is not None
    assert [off.add(boom) for _ in range(50)] == [None] * 50


# -- the real command line, on an emulator process ------------------------------------


@pytest.fixture(scope="module")
async def fleet() -> AsyncIterator[EmulatorProcess]:
    async with EmulatorProcess() as emu:
        yield emu


async def fleetroll_run(
    tmp_path: Path, fleet: EmulatorProcess, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    environment |= {"FLEETROLL_TELEMETRY__DB_PATH": os.devnull}
    environment |= {"FLEET_BASE_URL": fleet.base_url, "FLEET_API_KEY": fleet.api_key}
    with anyio.fail_after(180):
        done = await anyio.run_process(
            [sys.executable, "-m", "fleetroll", "run", *args],
            cwd=tmp_path,
            env=environment | (env or {}),
            check=False,
        )
    return done.returncode, done.stderr.decode()


def creates(ledger: dict[str, Any]) -> int:
    return int(ledger["created"]) + sum(ledger["creates_by_outcome"].values())


def typo_tasks(tmp_path: Path) -> Path:
    path = tmp_path / "typo.jsonl"
    lines = [json.loads(line) for line in LEDGER.read_text().splitlines() if line.strip()]
    lines[0]["env_id"] = "ledgr"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["unknown env", "wrong key", "dead policy endpoint"])
async def test_run_refuses_a_bad_batch_with_exit_code_2_before_any_create(
    tmp_path: Path, fleet: EmulatorProcess, problem: str
) -> None:
    before = creates(await fleet.ledger())
    tasks, env, more = str(LEDGER), {}, []
    policy = f"{dead_url()}/v1"
    if problem == "unknown env":
        tasks = str(typo_tasks(tmp_path))
    elif problem == "wrong key":
        env = {"FLEET_API_KEY": "sk-not-the-key-0042"}
    else:
        more = ["--policy", "openai", "--base-url", policy]

    code, stderr = await fleetroll_run(
        tmp_path, fleet, tasks, "--out", str(tmp_path / "r.jsonl"), *more, env=env
    )

    assert code == 2, stderr
    assert creates(await fleet.ledger()) == before
    assert "Traceback" not in stderr and not (tmp_path / "r.jsonl").exists()
    error = [line for line in stderr.splitlines() if "pre-flight failed" in line]
    assert len(error) == 1, stderr
    expected = {
        "unknown env": "unknown environment 'ledgr' (1 task); did you mean 'ledger'?",
        "wrong key": f"FLEET_API_KEY was refused by the Fleet control plane at {fleet.base_url}",
        "dead policy endpoint": f"GET {policy}/models failed with ConnectError",
    }[problem]
    assert expected in error[0]
    assert fleet.api_key not in stderr and "sk-not-the-key-0042" not in stderr


@pytest.mark.slow
async def test_no_preflight_skips_the_checks_and_runs_the_batch(
    tmp_path: Path, fleet: EmulatorProcess
) -> None:
    before = creates(await fleet.ledger())
    out = tmp_path / "r.jsonl"
    args = ["--policy", "openai", "--base-url", f"{dead_url()}/v1", "--no-preflight"]

    env = {"FLEETROLL_POOL__STOP_AFTER_SAME_FAILURES": "0"}  # run to the end

    code, stderr = await fleetroll_run(
        tmp_path, fleet, str(LEDGER), "--out", str(out), *args, env=env
    )

    assert code == 0, stderr
    assert "pre-flight" not in stderr
    assert creates(await fleet.ledger()) > before  # instances were made: nothing checked first
    assert {r.failure_reason for r in read_journal(out)} == {FailureReason.POLICY_ERROR}


@pytest.mark.slow
async def test_a_batch_whose_first_rollouts_all_fail_the_same_way_stops_early(
    tmp_path: Path, fleet: EmulatorProcess
) -> None:
    out, samples = tmp_path / "r.jsonl", 8
    args = ["--policy", "openai", "--base-url", f"{dead_url()}/v1", "--no-preflight"]
    args += ["--samples", str(samples), "--concurrency", "1"]
    env = {"FLEETROLL_POOL__STOP_AFTER_SAME_FAILURES": "3", "FLEETROLL_POLICY__MAX_RETRIES": "0"}

    code, stderr = await fleetroll_run(
        tmp_path, fleet, str(LEDGER), "--out", str(out), *args, env=env
    )

    assert code == 1, stderr
    assert "Traceback" not in stderr
    stopped = [line for line in stderr.splitlines() if "stopped early" in line]
    assert (
        len(stopped) == 1
        and "the first 3 rollouts to finish all failed with policy_error" in (stopped[0])
    ), stderr
    results = read_journal(out)
    tasks = sum(1 for line in LEDGER.read_text().splitlines() if line.strip())
    assert len({r.rollout_id for r in results}) == len(results) == tasks * samples
    outcomes = Counter(r.failure_reason for r in results)
    assert set(outcomes) == {FailureReason.POLICY_ERROR, FailureReason.CANCELLED}, outcomes
    assert outcomes[FailureReason.CANCELLED] > 0
    assert (await fleet.ledger())["running"] == 0


# -- mcp tasks: the command's executable, the URL --------------------------------------


def mcp_task(key: str, **environment: Any) -> TaskSpec:
    return TaskSpec(key=key, prompt="p", env_key="mcp", environment=McpEnvironment(**environment))


async def test_an_mcp_command_not_on_path_and_a_dead_url_are_problems_and_python_is_not() -> None:
    url = f"{dead_url()}/mcp"
    tasks = [
        mcp_task("ok", command=["{python}", "-c", "pass"]),
        mcp_task("typo", command=["no-such-mcp-server-xyz", "--stdio"]),
        mcp_task("dead", url=url),
    ]
    provider = mixed_provider(load_settings(), Events())
    try:
        problems = await provider.preflight(tasks)
    finally:
        await provider.aclose()

    assert problems == [
        "environment.command of task typo: 'no-such-mcp-server-xyz' is not an executable on PATH",
        f"MCP server {url} (1 task(s)) does not answer: ConnectError",
    ]


async def test_an_mcp_url_that_answers_any_status_passes() -> None:
    async with FakeChatServer() as server:  # 404 on this path: it answers all the same
        problems = await mcp_provider(load_settings(), Events()).preflight(
            [mcp_task("up", url=f"{server.base_url}/mcp")]
        )

    assert problems == []


class AwkwardMcpUrls:
    """ASGI: what pre-flight's GET meets at real MCP URLs.

    * ``/mcp``: an SSE stream that does not end (a stateless MCP server's
      answer to a GET): a comment, then nothing until the client leaves;
    * ``/elsewhere``: 307 to the same server under another host name
      (``localhost`` for ``127.0.0.1``);
    * ``/moved``: 307 to ``/mcp`` on its own origin.
    """

    def __init__(self) -> None:
        self.base = ""
        self.streams_left = anyio.Event()  # a client left the endless stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in ("/elsewhere", "/moved"):
            target = self.base.replace("127.0.0.1", "localhost") if path == "/elsewhere" else ""
            headers = [(b"location", f"{target}/mcp".encode()), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 307, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b": open\n\n", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        self.streams_left.set()


@pytest.mark.parametrize("client", ["thin", "sdk"])
async def test_an_mcp_url_whose_get_is_an_endless_event_stream_passes_without_reading_it(
    client: str,
) -> None:
    """Pre-flight read the whole answer to its GET: with a stateless MCP server's
    endless stream, every run ended at ``timeouts.preflight_s`` with exit code 2."""
    app = AwkwardMcpUrls()
    settings = load_settings(pool={"mcp_client": client}, timeouts={"preflight_s": 10})
    async with serve_asgi(app, lifespan="off") as base:
        provider = mcp_provider(settings, Events())
        with anyio.fail_after(20):
            problems = await provider.preflight([mcp_task("sse", url=f"{base}/mcp")])
            await app.streams_left.wait()  # it left the stream: nothing kept reading
        await provider.aclose()

    assert problems == []


@pytest.mark.parametrize("client", ["thin", "sdk"])
async def test_an_mcp_url_redirecting_to_another_host_is_one_problem_naming_both_hosts(
    client: str,
) -> None:
    """No MCP client follows it, so every session failed (after retrying for
    ``mcp_connect_s``); a redirect within the URL's origin passes, as before."""
    app = AwkwardMcpUrls()
    settings = load_settings(pool={"mcp_client": client}, timeouts={"preflight_s": 10})
    async with serve_asgi(app, lifespan="off") as base:
        app.base = base
        provider = mcp_provider(settings, Events())
        with anyio.fail_after(20):
            problems = await provider.preflight(
                [mcp_task("away", url=f"{base}/elsewhere"), mcp_task("near", url=f"{base}/moved")]
            )
        await provider.aclose()

    here = base.removeprefix("http://")
    there = here.replace("127.0.0.1", "localhost")
    assert problems == [
        f"MCP server {base}/elsewhere (1 task(s)): it redirects to http://{there}/mcp,"
        f" on another host ({here} -> {there}), and an MCP client follows a redirect only"
        " within the URL's own origin: use that URL as the endpoint if it is the intended"
        " server"
    ]
