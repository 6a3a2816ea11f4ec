"""`fleetroll run` as a user runs it: a real process, a real journal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from fleetroll.journal import read_journal
from fleetroll.settings import config_dir

LEDGER = config_dir() / "tasks" / "ledger.jsonl"
TASKS = sum(1 for line in LEDGER.read_text().splitlines() if line.strip())


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env["FLEETROLL_TELEMETRY__DB_PATH"] = os.devnull  # keep test runs out of ./.fleetroll
    return env


def fleetroll(*args: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetroll", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=clean_env(),
    )


def test_run_writes_one_result_per_rollout_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    done = fleetroll("run", str(LEDGER), "--out", str(out), "--samples", "2", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    results = read_journal(out)
    assert len(results) == 2 * TASKS and len({r.rollout_id for r in results}) == 2 * TASKS
    assert all(r.reward == 1.0 for r in results)
    assert "ledger:v1" in done.stderr and "reward mean" in done.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"key": "a", "env_id": "ledger"}\n', "missing required field 'prompt'"),
        (
            '{"key": "a", "prompt": "p", "env_id": "ledger", "modality": "telepathy"}\n',
            "unknown modality 'telepathy'",
        ),
        ("not json\n", "tasks.jsonl:1: invalid JSON"),
    ],
)
def test_bad_task_files_fail_with_exit_code_2_and_say_where(
    tmp_path: Path, content: str, message: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(content)
    done = fleetroll("run", str(tasks), tmp_path=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr and "tasks.jsonl" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_existing_journal_is_not_overwritten_without_resume(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    out.write_text("")
    out.write_text(json.dumps({"x": 1}) + "\n")
    done = fleetroll("run", str(LEDGER), "--out", str(out), tmp_path=tmp_path)
    assert done.returncode == 2 and "--resume" in done.stderr


def test_a_bad_config_file_fails_with_exit_code_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[timeouts]\ncall_tool_s = -3\n")
    done = fleetroll("run", str(LEDGER), "--config", str(bad), tmp_path=tmp_path)
    assert done.returncode == 2 and "timeouts.call_tool_s" in done.stderr


def test_a_run_killed_with_sigkill_resumes_to_exactly_one_result_per_rollout(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results.jsonl"
    slow = tmp_path / "slow.toml"
    slow.write_text("[policy]\nthink_time_s = 0.2\n[pool]\nconcurrency = 8\n")
    samples = 4
    args = [
        sys.executable,
        "-m",
        "fleetroll",
        "run",
        str(LEDGER),
        "--out",
        str(out),
        "--samples",
        str(samples),
        "--config",
        str(slow),
    ]
    child = subprocess.Popen(
        args, cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while not out.exists() or out.read_bytes().count(b"\n") < 10:
            assert child.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no results within 120 s"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    before = read_journal(out)
    assert 10 <= len(before) < samples * TASKS

    done = fleetroll(
        "run",
        str(LEDGER),
        "--out",
        str(out),
        "--samples",
        str(samples),
        "--resume",
        tmp_path=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    after = read_journal(out)
    counts = Counter(r.rollout_id for r in after)
    assert len(counts) == samples * TASKS and set(counts.values()) == {1}
    assert {r.rollout_id for r in before} <= set(counts)  # nothing finished was lost
    assert len({r.batch_id for r in after}) == 1
    assert out.read_bytes().endswith(b"\n")
