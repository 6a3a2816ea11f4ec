"""The dashboard's training-run panels on hand-made stores, its ETA, and its login cookie."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from pathlib import Path

import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from telemetry_helpers import insert_event

from fleetroll._internal.guard import Guard
from fleetroll.telemetry.dashboard import PAGE_PATHS, dashboard_routes, snapshot
from fleetroll.telemetry.dashboard_auth import COOKIE, cookie_authorizer
from fleetroll.telemetry.dashboard_panels import Panels, eta


def _t(clock: str) -> str:
    return f"2026-01-01T00:{clock}.000000Z"


def _epoch(clock: str) -> float:
    return datetime.fromisoformat(_t(clock)).timestamp()


# -- the ETA --------------------------------------------------------------------------


def test_the_eta_goes_by_the_recent_rate_not_the_average_since_the_start() -> None:
    # Ten minutes at one completion a minute (instances warming up), then five
    # minutes at ten a minute: 100 left at 10/min is 10 minutes, where the
    # average since the start (60 in 15 min) would say 25.
    slow = [30.0 + 60 * i for i in range(10)]
    fast = [606.0 + 6 * i for i in range(50)]
    rate, left = eta(slow + fast, now=900.0, started=0.0, remaining=100, window_s=300.0)
    assert rate == pytest.approx(50 / 300)
    assert left == pytest.approx(600.0)


def test_the_eta_window_starts_no_earlier_than_the_batch() -> None:
    # A batch 100 s old with a 300 s window: 20 completions in 100 s.
    done = [800.0 + 5 * i for i in range(1, 21)]
    rate, left = eta([100.0, *done], now=900.0, started=800.0, remaining=10, window_s=300.0)
    assert rate == pytest.approx(0.2)
    assert left == pytest.approx(50.0)


def test_the_eta_is_unknown_without_recent_completions_and_zero_when_nothing_is_left() -> None:
    assert eta([10.0], now=900.0, started=0.0, remaining=5, window_s=300.0) == (None, None)
    assert eta([], now=900.0, started=0.0, remaining=0, window_s=300.0) == (None, 0.0)


# -- the panels on a hand-made store ----------------------------------------------------


def _fill(conn: sqlite3.Connection) -> None:
    n = iter(range(1, 1000))

    def put(message: str, clock: str, **attributes: object) -> None:
        insert_event(conn, message, n=next(n), at=_t(clock), **attributes)

    # An old batch from before `total` existed: its `rollouts` is the total.
    put("fleet_batch_started", "00:00", batch_id="old", rollouts=2, concurrency=2)
    put("fleet_batch_started", "01:00", batch_id="b1", rollouts=6, total=6, concurrency=4)
    rewards = {"r1": ("t1", 1.0), "r2": ("t1", 1.0), "r3": ("t2", 0.0), "r4": ("t2", 1.0)}
    for rid, (task, _) in rewards.items():
        put("fleet_rollout_started", "01:01", batch_id="b1", rollout_id=rid, task_key=task)
    put("fleet_rollout_started", "01:01", batch_id="b1", rollout_id="r5", task_key="t3")
    put("fleet_rollout_started", "01:02", batch_id="b1", rollout_id="r6", task_key="t3")
    put("fleet_provisioning_completed", "01:03", batch_id="b1", rollout_id="r6", instance_id="i-6")
    # One completion at minute 2, then three in the last five minutes (05:00-10:00).
    for (rid, (task, reward)), clock in zip(
        rewards.items(), ("02:00", "06:00", "07:00", "08:00"), strict=True
    ):
        put(
            "fleet_rollout_completed",
            clock,
            batch_id="b1",
            rollout_id=rid,
            task_key=task,
            env_key="ledger",
            reward=reward,
        )
    put(
        "fleet_rollout_completed",
        "09:00",
        batch_id="b1",
        rollout_id="r5",
        task_key="t3",
        env_key="desktop",
        reward=None,
        failure_reason="tools_error",
        error_message="the tool server went away",
    )
    for message, clock, key in (
        ("fleet_env_quarantined", "03:00", "ledger"),
        ("fleet_env_recovered", "04:00", "ledger"),
        ("fleet_env_quarantined", "05:00", "desktop"),
    ):
        put(message, clock, env_key=key, env_version="v1", failure_share=0.8, window=10)


def test_the_panels_show_progress_groups_stuck_errors_and_breakers(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    _fill(conn)
    now = _epoch("10:00")
    data = snapshot(db, now=now, panels=Panels(stuck_after_s=60, eta_window_s=300, errors=5))

    progress = data["progress"]
    assert (progress["batch_id"], progress["total"], progress["done"]) == ("b1", 6, 5)
    assert (progress["failed"], progress["remaining"], progress["state"]) == (1, 1, "running")
    # r2, r3, r4 and r5 completed in the last 300 s: 4 per 5 min; 1 left.
    assert progress["rate_per_min"] == pytest.approx(4 / 5)
    assert progress["eta_s"] == pytest.approx(75.0)

    old = snapshot(db, batch="old", now=now)["progress"]
    assert (old["total"], old["done"]) == (2, 0)

    assert [(b["batch_id"], b["reward_mean"]) for b in data["batch_rewards"]] == [("b1", 0.75)]
    assert data["groups"]["groups"] == 2 and data["groups"]["uniform"] == 1
    (group,) = data["groups"]["rows"]
    assert (group["task_key"], group["samples"], group["reward"]) == ("t1", 2, 1.0)

    (stuck,) = data["unfinished"]["rows"]
    assert stuck["rollout_id"] == "r6" and stuck["state"] == "stuck"
    assert (stuck["phase"], stuck["instance_id"]) == ("acting", "i-6")
    assert stuck["age_s"] == pytest.approx(now - _epoch("01:02"))
    assert data["unfinished"]["lost"] == 0 and data["totals"]["lost"] == 0

    (error,) = data["errors"]
    assert (error["rollout_id"], error["failure_reason"]) == ("r5", "tools_error")
    assert error["message"] == "the tool server went away" and error["batch_id"] == "b1"

    breakers = {e["env"]: e["state"] for e in data["admission"]["envs"]}
    assert breakers == {"ledger:v1": "recovered", "desktop:v1": "quarantined"}
    assert data["admission"]["gauges"] is None
    assert sum(p["per_min"] for p in data["throughput"]) > 0


def test_a_rollout_younger_than_the_threshold_is_not_stuck(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    _fill(conn)
    data = snapshot(db, now=_epoch("10:00"), panels=Panels(stuck_after_s=3600))
    assert data["unfinished"]["rows"] == [] and data["unfinished"]["in_flight"] == 1


# -- the login cookie -------------------------------------------------------------------

TOKEN = "a-dashboard-token-of-32-characters"


def _guarded(tmp_path: Path) -> Guard:
    async def stats(request: Request) -> Response:
        return PlainTextResponse("secret stats")

    token = SecretStr(TOKEN)
    app = Starlette(
        routes=[
            *dashboard_routes(tmp_path / "none-yet.db", token=token),
            Route("/v1/stats", stats),
        ]
    )
    return Guard(
        app,
        token=token,
        max_body_bytes=1024,
        open_paths={"/healthz", *PAGE_PATHS},
        also_authorized=cookie_authorizer(token),
    )


def test_the_login_url_sets_a_cookie_that_opens_the_dashboard_data_and_nothing_else(
    tmp_path: Path,
) -> None:
    with TestClient(_guarded(tmp_path), follow_redirects=False) as client:
        assert client.get("/dashboard/data").status_code == 401
        login = client.get("/dashboard/login", params={"token": TOKEN})
        assert login.status_code == 303 and login.headers["location"] == "../dashboard"
        cookie = login.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=") and TOKEN not in cookie
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert "Path=/dashboard" in cookie
        data = client.get("/dashboard/data")
        assert data.status_code == 200 and "no telemetry store" in data.json()["note"]
        assert client.get("/v1/stats").status_code == 401  # the cookie opens nothing else


@pytest.mark.parametrize("given", ["", "nope", TOKEN[:-1], TOKEN + "x"])
def test_a_wrong_token_at_the_login_url_is_a_401_in_one_line_that_does_not_echo_it(
    tmp_path: Path, given: str
) -> None:
    with TestClient(_guarded(tmp_path), follow_redirects=False) as client:
        answer = client.get("/dashboard/login", params={"token": given})
        assert answer.status_code == 401
        assert "set-cookie" not in answer.headers
        assert len(answer.text.strip().splitlines()) == 1
        assert "/dashboard/login?token=<FLEETROLL_SERVICE_TOKEN>" in answer.text
        assert not given or given not in answer.text


def test_a_cookie_from_another_token_is_refused(tmp_path: Path) -> None:
    other = cookie_authorizer(SecretStr("another-token-of-32-characters-xx"))
    assert other is not None
    with TestClient(_guarded(tmp_path), follow_redirects=False) as client:
        login = client.get("/dashboard/login", params={"token": TOKEN})
        value = login.cookies[COOKIE]
    assert not other("/dashboard/data", {"cookie": f"{COOKIE}={value}"})
    mine = cookie_authorizer(SecretStr(TOKEN))
    assert mine is not None and mine("/dashboard/data", {"cookie": f"{COOKIE}={value}"})
