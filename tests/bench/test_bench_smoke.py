"""`fleetroll bench` end to end on its smoke scenario: structure only, never timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetroll.bench.records import ScenarioReport
from fleetroll.bench.scenarios import SCENARIOS

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env["FLEETROLL_TELEMETRY__DB_PATH"] = os.devnull
    return env


Run = tuple[Path, subprocess.CompletedProcess[str]]


def bench(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetroll", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=clean_env(),
    )


@pytest.fixture(scope="module")
def smoke(
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    """One smoke run of every system (fleetroll with telemetry and without), with the
    default ``--out``, in a folder of its own: the tests read it."""
    cwd = tmp_path_factory.mktemp("smoke")
    every = ("--baselines", "fresh-session,naive-gather,cpu-floor", "--telemetry", "both")
    return cwd, bench("--scenario", "smoke", *every, "--no-plot", cwd=cwd, timeout=110)


def test_the_smoke_scenario_runs_every_system_and_writes_its_report(
    smoke: Run,
) -> None:
    cwd, done = smoke
    assert done.returncode == 0, done.stderr
    out = cwd / ".fleetroll" / "bench"
    report = ScenarioReport.model_validate(json.loads((out / "smoke.json").read_text()))
    systems = ["fleetroll", "fleetroll-telemetry-off", "fresh-session", "cpu-floor", "naive-gather"]
    assert [r.system for r in report.runs] == systems
    assert report.parameters["telemetry"] == "both"
    # An unmeasured warm-up batch ran first: no system pays the process's one-time set-up.
    assert "warm-up: 1/1 rollouts through fleetroll, not measured" in done.stderr
    assert report.parameters["warm_up_rollouts"] == 8
    for run in report.runs:
        assert run.requested == 8
        assert run.returned == 8, run
        assert run.leaked == 0, run
        assert run.finished_on_its_own, run
    fleetroll = report.runs[0]
    assert fleetroll.scored == 8 and fleetroll.failures == {"none": 8}
    assert fleetroll.ledger["created"] == fleetroll.ledger["deleted"] == 8
    markdown = (out / "smoke.md").read_text()
    assert "| fleetroll | 8 | 8 / 8 |" in markdown
    assert "| fleetroll-telemetry-off | 8 | 8 / 8 |" in markdown


def test_reports_go_under_dot_fleetroll_by_default_and_the_output_says_where(
    smoke: Run,
) -> None:
    cwd, done = smoke
    assert done.returncode == 0, done.stderr
    out = cwd / ".fleetroll" / "bench"
    assert sorted(p.name for p in out.iterdir()) == ["smoke.json", "smoke.md"]
    assert sorted(p.name for p in cwd.iterdir()) == [".fleetroll"]
    assert f"fleetroll bench: reports go to {out}" in done.stderr


def test_the_scenario_list_names_every_scenario(tmp_path: Path) -> None:
    done = bench("--list", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names == [
        "smoke",
        "realistic",
        "tool-heavy",
        "scale",
        "chaos",
        "create-queue",
        "create-queue-fresh",
        "tool-call",
        "policy-turn",
        "weight-updates",
    ]
    # Its columns line up, whatever the length of a name or of its concurrency levels.
    lines = done.stdout.splitlines()
    assert len({line.index(" x C=") for line in lines}) == 1, done.stdout
    descriptions = {line.index(SCENARIOS[line.split()[0]].description) for line in lines}
    assert len(descriptions) == 1, done.stdout


def test_the_policy_turn_scenario_reports_cpu_per_turn_for_every_turn_index(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench"
    args = ("--scenario", "policy-turn", "--rollouts", "1", "--out", str(out), "--no-plot")
    done = bench(*args, cwd=tmp_path, timeout=110)
    assert done.returncode == 0, done.stderr
    assert f"fleetroll bench: reports go to {out}" in done.stderr  # --out is where they go
    assert sorted(p.name for p in out.iterdir()) == ["policy-turn.json", "policy-turn.md"]
    report = ScenarioReport.model_validate(json.loads((out / "policy-turn.json").read_text()))
    record = report.policy_turns
    assert record is not None and (record.turns, record.screenshot_kb, record.repeat) == (
        30,
        100,
        1,
    )
    assert [r.turn for r in record.rows] == list(range(1, 31))
    # One ~100 KB screenshot more per turn; max_images=3 stops the growth at four.
    sizes = [r.request_mb for r in record.rows]
    assert sizes == sorted(sizes) and sizes[-1] > 29 * 0.1
    assert max(r.capped_request_mb for r in record.rows) < 4 * 0.11
    markdown = (out / "policy-turn.md").read_text()
    assert "| turn | request (all images) | build, encoded once |" in markdown
    assert "| 30 | 3." in markdown


def test_an_unknown_baseline_is_a_usage_error(tmp_path: Path) -> None:
    done = bench("--baselines", "ray", cwd=tmp_path)
    assert done.returncode == 2
    assert "unknown baseline(s) ray" in done.stderr


def test_the_cpu_floor_runs_only_when_asked_for_and_its_cpu_per_rollout_is_in_the_table(
    smoke: Run,
) -> None:
    assert all("cpu-floor" not in scenario.baselines for scenario in SCENARIOS.values())
    cwd, done = smoke
    assert done.returncode == 0, done.stderr
    out = cwd / ".fleetroll" / "bench"
    report = ScenarioReport.model_validate(json.loads((out / "smoke.json").read_text()))
    (floor,) = [r for r in report.runs if r.system == "cpu-floor"]
    assert floor.scored == 8 and floor.leaked == 0 and floor.cpu_ms_per_rollout > 0
    markdown = (out / "smoke.md").read_text()
    assert "| CPU ms / rollout | emulator CPU ms / rollout |" in markdown
    assert "| cpu-floor | 8 | 8 / 8 | 8 |" in markdown


def test_repeat_rotates_the_systems_each_round_and_reports_their_medians(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = ("--scenario", "smoke", "--baselines", "cpu-floor", "--telemetry", "off")
    done = bench(*args, "--repeat", "2", "--no-plot", "--out", str(out), cwd=tmp_path, timeout=110)
    assert done.returncode == 0, done.stderr
    report = ScenarioReport.model_validate(json.loads((out / "smoke.json").read_text()))
    assert report.parameters["repeat"] == 2
    # Round 2 starts with the system that ran second in round 1.
    assert [(r.system, r.round) for r in report.runs] == [
        ("fleetroll", 1),
        ("cpu-floor", 1),
        ("cpu-floor", 2),
        ("fleetroll", 2),
    ]
    assert all(r.scored == 8 and r.leaked == 0 for r in report.runs)
    fleetroll, floor = report.summary
    assert (fleetroll.system, fleetroll.rounds, fleetroll.scored) == ("fleetroll", 2, 8)
    by_round = {r.round: r.cpu_ms_per_rollout for r in report.runs if r.system == "cpu-floor"}
    ratios = sorted(
        r.cpu_ms_per_rollout / by_round[r.round] for r in report.runs if r.system == "fleetroll"
    )
    assert fleetroll.cpu_vs_floor == pytest.approx(sum(ratios) / 2)  # the median of two
    assert floor.cpu_vs_floor == pytest.approx(1.0)
    assert "medians over 2 rounds:" in done.stderr
    assert "Medians over 2 rounds" in (out / "smoke.md").read_text()
