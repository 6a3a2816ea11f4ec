"""The dashboard: its JSON after a real batch, and the page as a real browser draws it."""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import anyio
import httpx
import pytest
from click.testing import CliRunner
from PIL import Image, ImageStat
from pydantic import SecretStr
from telemetry_helpers import PYTHON, child_env, local_settings, lost_batch_writer

from fleetroll._internal.guard import Guard
from fleetroll._internal.serving import serve_asgi
from fleetroll.cli.main import main
from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.policies import AssistantTurn, ScriptedPolicy
from fleetroll.policies.turns import Message, ToolSpec
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry import Telemetry, open_telemetry
from fleetroll.telemetry.dashboard import (
    PAGE_PATHS,
    dashboard_app,
    dashboard_routes,
    page,
    parse_since,
)
from fleetroll.telemetry.dashboard_auth import cookie_authorizer
from fleetroll.telemetry.dashboard_panels import Panels

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASKS = [
    *load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities),
    *load_tasks(config_dir() / "tasks" / "desktop.jsonl", modalities=SETTINGS.modalities),
]
#: Enough faults that every chart has something to draw, none that hang.
FAULTS = FaultProfile(
    seed=11,
    create_latency=Latency(min_s=0.01, max_s=0.25),
    p_create_5xx=0.25,
    retry_after_s=0.01,
    tool_latency=Latency(min_s=0.02, max_s=0.1),
    p_tool_hang=0.03,
    p_tool_error=0.1,
    p_instance_death=0.15,
    death_after=Latency(min_s=0.2, max_s=1.0),
    p_verifier_error=0.3,
)
BATCH_SETTINGS = {
    "provisioning": {
        "creates_per_second": 1000,
        "max_attempts": 2,  # so that some creates give up: init_error
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.02,
    },
    "timeouts": {"reset_s": 2.0, "call_tool_s": 0.5, "mcp_connect_s": 1.0, "release_s": 5.0},
    "pool": {"concurrency": 16},
}
WINDOW = (1400, 1800)
CHARTS = ("chart-timeline", "chart-failures", "chart-provisioning", "chart-rewards")


@dataclass(frozen=True)
class Batch:
    db: Path
    results: list[RolloutResult]


async def run_batch(db: Path) -> list[RolloutResult]:
    settings = local_settings(db, **BATCH_SETTINGS)
    async with (
        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events,
        Emulator(FAULTS) as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as pool,
    ):
        batch = pool.run_batch(
            TASKS, ScriptedPolicy(think_time_s=0.01), samples_per_task=3, batch_id="dash"
        )
        with anyio.fail_after(120):
            return [result async for result in batch]


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    """One store with a finished batch, shared by this module's tests (they only read it)."""
    db = tmp_path_factory.mktemp("dashboard") / "telemetry.db"
    return Batch(db, anyio.run(run_batch, db))


@pytest.fixture
async def url(batch: Batch) -> AsyncIterator[str]:
    async with serve_asgi(dashboard_app(batch.db)) as base:
        yield base


# -- the JSON the page polls -------------------------------------------------------------


async def test_the_data_counts_equal_the_batchs_results(batch: Batch, url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answer = await client.get("/dashboard/data", params={"batch": "dash"})
    assert answer.status_code == 200
    data = answer.json()
    results = batch.results
    failed = [r for r in results if r.failure_reason is not None]
    assert failed, "the fault profile should make some rollouts fail"
    totals = data["totals"]
    assert totals["started"] == totals["completed"] == len(results)
    assert totals["in_flight"] == 0
    assert totals["failed"] == len(failed)
    assert totals["failed_pct"] == pytest.approx(100 * len(failed) / len(results))
    rewards = [r.reward for r in results if r.reward is not None]
    assert totals["rewarded"] == len(rewards)
    assert totals["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))

    by_env = {e["env"]: Counter(e["reasons"]) for e in data["failures"]["envs"] if e["reasons"]}
    expected: dict[str, Counter[str]] = {}
    for r in failed:
        assert r.failure_reason is not None
        expected.setdefault(r.env_key, Counter())[r.failure_reason.value] += 1
    assert by_env == expected
    assert {e["env"] for e in data["failures"]["envs"]} == {"ledger", "desktop"}

    buckets = data["timeline"]["buckets"]
    assert buckets[-1]["started_total"] == buckets[-1]["completed_total"] == len(results)
    assert sum(b[2] for b in data["provisioning"]["bins"]) == data["provisioning"]["count"] > 0
    assert sum(e["count"] for e in data["rewards"]["envs"]) == len(rewards)
    durations = sorted((r.timings.total_s for r in results), reverse=True)
    slowest = data["slowest"]
    assert [s["duration_s"] for s in slowest] == pytest.approx(durations[: len(slowest)], abs=1e-3)
    assert {s["rollout_id"] for s in slowest} <= {r.rollout_id for r in results}
    assert [b["batch_id"] for b in data["batches"]] == ["dash"]

    # The cost: the results' sums, per env and in total. Each event rounds instance
    # seconds to 4 decimals, off by at most 5e-5, so a sum of n is off by n * 5e-5.
    def rounding(n: int) -> float:
        return n * 5e-5 + 1e-9

    fields = ("instance_s", "prompt_tokens", "completion_tokens", "policy_calls", "tool_calls")
    cost = data["cost"]
    for env in {r.env_key for r in results}:
        (row,) = [e for e in cost["envs"] if e["env"] == env]
        mine = [r for r in results if r.env_key == env]
        assert row["completed"] == len(mine)
        for name in fields:
            expected_sum = sum(getattr(r.cost, name) for r in mine)
            assert row[name] == pytest.approx(expected_sum, abs=rounding(len(mine)))
    for name in fields:
        expected_sum = sum(getattr(r.cost, name) for r in results)
        assert cost["total"][name] == pytest.approx(expected_sum, abs=rounding(len(results)))
    assert cost["total"]["tool_calls"] > 0 and cost["total"]["policy_calls"] > 0


async def test_since_filters_by_time(batch: Batch, url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        recent = (await client.get("/dashboard/data", params={"since": "1d"})).json()
        future = (await client.get("/dashboard/data", params={"since": "2999-01-01"})).json()
    assert recent["totals"]["started"] == len(batch.results)
    assert future["totals"]["started"] == 0
    assert future["since"] == "2999-01-01T00:00:00.000000Z"
    assert future["timeline"]["buckets"] == [] and future["slowest"] == []


@pytest.mark.parametrize("since", ["yesterday", "15x", "-5m", "2026-13-01"])
async def test_a_bad_since_is_answered_with_422_and_what_is_accepted(url: str, since: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answer = await client.get("/dashboard/data", params={"since": since})
    assert answer.status_code == 422
    (error,) = answer.json()["detail"]
    assert error["loc"] == ["query", "since"]
    assert repr(since) in error["msg"] and "15m" in error["msg"] and "ISO 8601" in error["msg"]


async def test_a_missing_store_gives_an_empty_dashboard_not_an_error(tmp_path: Path) -> None:
    async with (
        serve_asgi(dashboard_app(tmp_path / "nothing-yet.db")) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        answer = await client.get("/dashboard/data")
        root = await client.get("/", follow_redirects=True)
    assert answer.status_code == 200
    data = answer.json()
    assert data["totals"]["started"] == 0 and "no telemetry store" in data["note"]
    assert root.status_code == 200 and root.text == page()


def test_since_accepts_durations_and_iso_times() -> None:
    from datetime import UTC, datetime

    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert parse_since("90s", now=now) == "2026-05-01T11:58:30.000000Z"
    assert parse_since("1.5h", now=now) == "2026-05-01T10:30:00.000000Z"
    assert parse_since("2026-05-01T14:00:00+02:00") == "2026-05-01T12:00:00.000000Z"
    assert parse_since("2026-05-01") == "2026-05-01T00:00:00.000000Z"


def test_the_routes_mount_in_another_app_and_the_page_ships_in_the_package() -> None:
    from importlib.resources import files

    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    app = Starlette(routes=[*dashboard_routes(os.devnull)])
    with TestClient(app) as client:
        html = client.get("/dashboard")
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert (files("fleetroll.telemetry") / "dashboard.html").read_text() == html.text
    # Self-contained: nothing is fetched from anywhere but this server.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html.text)


async def test_fleetroll_dashboard_serves_until_interrupted(batch: Batch) -> None:
    command = [PYTHON, "-m", "fleetroll", "dashboard", "--db", str(batch.db), "--port", "0"]
    async with await anyio.open_process(command, env=child_env()) as process:
        assert process.stdout is not None
        with anyio.fail_after(60):
            line = b""
            while b"\n" not in line:
                line += await process.stdout.receive()
            page_url = re.search(r"http://\S+/dashboard", line.decode())
            assert page_url is not None, line
            async with httpx.AsyncClient(timeout=30) as client:
                data = (await client.get(page_url.group() + "/data")).json()
            assert data["totals"]["started"] == len(batch.results)
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0


@asynccontextmanager
async def fleetroll_dashboard(db: Path, *args: str, **env: str) -> AsyncIterator[str]:
    """``fleetroll dashboard`` in a child process; yields the first line it prints."""
    command = [PYTHON, "-m", "fleetroll", "dashboard", "--db", str(db), "--port", "0", *args]
    async with await anyio.open_process(command, env={**child_env(), **env}) as process:
        assert process.stdout is not None
        with anyio.fail_after(60):
            line = b""
            while b"\n" not in line:
                line += await process.stdout.receive()
            yield line.decode()
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0


def test_fleetroll_dashboard_beyond_loopback_without_a_token_is_refused_in_one_line() -> None:
    done = CliRunner().invoke(main, ["dashboard", "--host", "0.0.0.0", "--port", "0"])
    assert done.exit_code == 2
    assert done.stderr.startswith("Error: refusing to serve on 0.0.0.0")
    assert len(done.stderr.splitlines()) == 1 and done.stdout == ""


@pytest.mark.slow
async def test_fleetroll_dashboard_with_a_token_wants_it_for_data_but_not_for_the_page(
    batch: Batch,
) -> None:
    token = "a-dashboard-token-of-32-characters"
    async with fleetroll_dashboard(batch.db, FLEETROLL_SERVICE_TOKEN=token) as line:
        assert token not in line
        found = re.search(r"(http://\S+/dashboard)/login\?token=<FLEETROLL_SERVICE_TOKEN>", line)
        assert found is not None, line
        page_url = found.group(1)
        async with httpx.AsyncClient(timeout=30) as client:
            page_answer = await client.get(page_url)
            anonymous = await client.get(page_url + "/data")
            wrong = await client.get(page_url + "/data", headers={"Authorization": "Bearer nope"})
            right = await client.get(
                page_url + "/data", headers={"Authorization": f"Bearer {token}"}
            )
            refused = await client.get(page_url + "/login", params={"token": "nope"})
            login = await client.get(page_url + "/login", params={"token": token})
            by_cookie = await client.get(page_url + "/data")  # the login's cookie
    assert page_answer.status_code == 200 and token not in page_answer.text
    assert (anonymous.status_code, wrong.status_code, refused.status_code) == (401, 401, 401)
    assert right.status_code == 200
    assert right.json()["totals"]["started"] == len(batch.results)
    assert login.status_code == 303 and token not in login.headers["set-cookie"]
    assert by_cookie.status_code == 200


@pytest.mark.slow
async def test_fleetroll_dashboard_without_a_token_answers_only_loopback_host_names(
    batch: Batch,
) -> None:
    async with fleetroll_dashboard(batch.db) as line:
        page_url = re.search(r"http://\S+/dashboard", line)
        assert page_url is not None, line
        async with httpx.AsyncClient(timeout=30) as client:
            rebound = await client.get(
                page_url.group() + "/data", headers={"Host": "attacker.example"}
            )
            local = await client.get(page_url.group() + "/data")
    assert rebound.status_code == 421
    assert local.status_code == 200


# -- a real browser ----------------------------------------------------------------------


async def browse(chromium: str, url: str, profile: Path, *args: str) -> str:
    """Load ``url`` in headless chromium, let the page poll a few times, return stdout."""
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--virtual-time-budget=8000",
        *args,
        url,
    ]
    env = {**child_env(), "HOME": str(profile)}
    with anyio.fail_after(90):
        done = await anyio.run_process(command, check=False, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout.decode()


class _Dom(HTMLParser):
    """Counts what each chart drew: the elements inside each ``<svg>``, the table's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.svgs: dict[str, dict[str, str]] = {}
        self.drawn: dict[str, Counter[str]] = {}
        self.rollout_ids: list[str] = []
        self._svg: str | None = None
        self._in_id_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg":
            self._svg = a.get("id", "")
            self.svgs[self._svg] = a
            self.drawn[self._svg] = Counter()
        elif self._svg is not None:
            self.drawn[self._svg][tag] += 1
        if tag == "td" and "rollout-id" in a.get("class", ""):
            self._in_id_cell = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._svg = None
        elif tag == "td":
            self._in_id_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_id_cell and data.strip():
            self.rollout_ids.append(data.strip())


@pytest.mark.slow
async def test_the_browser_draws_every_chart_and_the_slowest_rollouts(
    chromium: str, batch: Batch, url: str, tmp_path: Path
) -> None:
    html = await browse(chromium, f"{url}/dashboard", tmp_path / "profile", "--dump-dom")
    dom = _Dom()
    dom.feed(html)
    for chart in CHARTS:
        assert chart in dom.svgs, f"{chart} is missing from the page"
        assert int(dom.svgs[chart]["data-points"]) > 0, f"{chart} has no data"
        assert "is-empty" not in html.split(f'id="{chart}"')[0].rsplit("<div", 1)[-1]
    assert dom.drawn["chart-timeline"]["path"] >= 3  # started, completed, in flight
    assert dom.drawn["chart-failures"]["rect"] > 0
    assert dom.drawn["chart-provisioning"]["rect"] > 0
    assert dom.drawn["chart-rewards"]["rect"] > 0
    ids = {r.rollout_id for r in batch.results}
    assert len(dom.rollout_ids) >= 5
    assert set(dom.rollout_ids) <= ids
    slowest = max(batch.results, key=lambda r: r.timings.total_s)
    assert dom.rollout_ids[0] == slowest.rollout_id
    started = re.search(r'id="stat-started">([\d,]+)<', html)
    assert started is not None and int(started.group(1).replace(",", "")) == len(batch.results)
    assert "live · updated" in html
    costs = re.findall(r'<tr class="cost" data-env="([^"]+)">', html)
    assert costs == [*sorted({r.env_key for r in batch.results}), "total"]


@pytest.mark.slow
async def test_the_screenshot_shows_charts_drawn_in_colour(
    chromium: str, batch: Batch, url: str, tmp_path: Path
) -> None:
    shot = tmp_path / "dash.png"
    await browse(chromium, f"{url}/dashboard", tmp_path / "profile", f"--screenshot={shot}")
    if keep := os.environ.get("DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, keep)  # to look at it
    with Image.open(shot) as image:
        assert image.size == WINDOW
        rgb = image.convert("RGB")
    # The chart area (below the header and the headline numbers, to the window's
    # end: the training-run panels moved the failure bars down): several distinct
    # saturated colours (series, bars, failure reasons), not a blank or grey page.
    charts = rgb.crop((0, 200, WINDOW[0], WINDOW[1])).quantize(colors=64).convert("RGB")
    colours = charts.getcolors(64) or []
    saturated = [c for n, c in colours if n > 150 and max(c) - min(c) > 60 and max(c) > 90]
    assert len(saturated) >= 5, f"too few chart colours: {saturated}"
    (spread,) = ImageStat.Stat(charts.convert("L")).stddev
    assert spread > 10  # not one flat colour


class HeldPolicy:
    """The scripted policy, except that rollouts of the ``held`` tasks wait for ``release``."""

    def __init__(self, held: set[str]) -> None:
        self.inner = ScriptedPolicy()
        self.held = held
        self.release = anyio.Event()

    async def act(
        self, task: TaskSpec, messages: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if task.key in self.held:
            await self.release.wait()
        return await self.inner.act(task, messages, tools)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.slow
async def test_the_browser_logs_in_with_a_token_and_shows_a_live_batch_and_a_killed_process(
    chromium: str, tmp_path: Path
) -> None:
    db = tmp_path / "telemetry.db"
    # A process killed with -9 in the middle of its batch: two rollouts lost.
    async with lost_batch_writer(db, "start") as child:
        child.kill()
        with anyio.fail_after(30):
            await child.wait()

    # A live batch: 6 tasks x 2 samples; the rollouts of two tasks wait in their policy.
    tasks = TASKS[:6]
    policy = HeldPolicy({tasks[0].key, tasks[1].key})
    token = SecretStr("a-dashboard-token-of-32-characters")
    settings = local_settings(db, pool={"concurrency": 12})
    results: list[RolloutResult] = []
    eight_done, all_done = anyio.Event(), anyio.Event()

    async def collect(batch: AsyncIterator[RolloutResult]) -> None:
        async for result in batch:
            results.append(result)
            if len(results) == 8:
                eight_done.set()
        all_done.set()

    with Telemetry(
        settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
    ) as telemetry:
        async with (
            Emulator() as emu,
            RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=telemetry.events
            ) as pool,
            anyio.create_task_group() as tg,
        ):
            batch = pool.run_batch(tasks, policy, samples_per_task=2, batch_id="live")
            tg.start_soon(collect, batch)
            with anyio.fail_after(60):
                await eight_done.wait()
                assert await anyio.to_thread.run_sync(telemetry.flush)
            app = Guard(
                dashboard_app(db, panels=Panels(stuck_after_s=0.001), token=token),
                token=token,
                max_body_bytes=1024,
                open_paths={"/healthz", *PAGE_PATHS},
                also_authorized=cookie_authorizer(token),
            )
            async with serve_asgi(app) as base:
                login = f"{base}/dashboard/login?token={token.get_secret_value()}"
                html = await browse(chromium, login, tmp_path / "profile", "--dump-dom")
            policy.release.set()
            with anyio.fail_after(60):
                await all_done.wait()
    assert len(results) == 12

    assert token.get_secret_value() not in html
    assert "live · updated" in html
    # The live batch's progress: 8 of 12, running.
    assert re.search(r'id="card-progress"[^>]*data-state="running"', html), html[:3000]
    assert re.search(r'id="progress-batch">live<', html)
    assert re.search(r'id="progress-done">8<', html)
    assert re.search(r'id="progress-total">12<', html)
    # The killed process's two rollouts are lost; the four held ones are stuck, acting.
    row = r'<tr class="unfinished" data-rollout-id="([^"]+)" data-state="(\w+)"'
    states = re.findall(row, html)
    lost = sorted(rid for rid, state in states if state == "lost")
    assert lost == ["doomed-1", "doomed-2"]
    assert sum(1 for _, state in states if state == "stuck") == 4
    assert re.search(r'id="stat-lost"[^>]*>2<', html)
    # The finished groups scored 1.0 on both samples: uniform.
    assert len(re.findall(r'<tr class="group"', html)) == 4
