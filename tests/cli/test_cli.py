"""`fleetroll run` as a user runs it: a real process, a real journal."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from anyio.abc import ByteReceiveStream, Process
from anyio.streams.text import TextReceiveStream

from fleetroll.cli.run import _describe
from fleetroll.emulator import Emulator
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.jobs.progress import Progress, Watch
from fleetroll.pool.assembly import policy_from_settings
from fleetroll.pool.journal import read_journal
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

LEDGER = config_dir() / "tasks" / "ledger.jsonl"
TASKS = sum(1 for line in LEDGER.read_text().splitlines() if line.strip())
#: Tasks of the interrupt and resume tests: what they prove is not about the batch's size,
#: and 8 tasks x 4 samples at 4 to 8 at once still leave, when the signal comes, rollouts
#: done, running and not started (each test asserts the mix it needs).
SOME = 8


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env["FLEETROLL_TELEMETRY__DB_PATH"] = os.devnull  # keep test runs out of ./.fleetroll
    return env


def fleetroll(
    *args: str, tmp_path: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetroll", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env={**clean_env(), **(env or {})},
    )


def test_a_socks_proxy_in_the_environment_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    """The HTTP clients go through http(s) proxies only: a SOCKS one was refused deep
    in the pool, a traceback with exit 1; now before anything starts, naming the
    variable and never its password."""
    done = fleetroll(
        "run",
        str(LEDGER),
        "--out",
        str(tmp_path / "r.jsonl"),
        tmp_path=tmp_path,
        env={"ALL_PROXY": "socks5://user:hunter2@127.0.0.1:1080"},
    )

    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ALL_PROXY names a socks5:// proxy" in lines[0], lines
    assert "hunter2" not in done.stderr and not (tmp_path / "r.jsonl").exists()


def test_a_proxy_that_cannot_be_reached_is_named_in_the_pre_flight_s_one_line(
    tmp_path: Path,
) -> None:
    """The environment's proxy applies to the control plane (as httpx applies it):
    when nothing answers there, the one line says the request went through it
    (it named only an address, and the advice was about FLEET_BASE_URL)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the test starts fleetroll
    done = fleetroll(
        "run",
        str(LEDGER),
        tmp_path=tmp_path,
        env={"HTTP_PROXY": f"http://user:hunter2@127.0.0.1:{port}"},
    )

    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"through the proxy http://127.0.0.1:{port}" in lines[0], lines
    assert "hunter2" not in done.stderr


def test_a_fleet_url_without_a_key_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    done = fleetroll(
        "run",
        str(LEDGER),
        "--out",
        str(tmp_path / "r.jsonl"),
        tmp_path=tmp_path,
        env={"FLEET_BASE_URL": "http://127.0.0.1:9"},
    )

    assert done.returncode == 2
    assert "FLEET_BASE_URL is set but FLEET_API_KEY is not" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "r.jsonl").exists()


def test_run_writes_one_result_per_rollout_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    done = fleetroll("run", str(LEDGER), "--out", str(out), "--samples", "2", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    results = read_journal(out)
    assert len(results) == 2 * TASKS and len({r.rollout_id for r in results}) == 2 * TASKS
    assert all(r.reward == 1.0 for r in results)
    assert "ledger:v1" in done.stderr and "reward mean" in done.stderr


def test_groups_stops_every_other_group_once_that_many_are_complete(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    done = fleetroll(
        "run", str(LEDGER), "--out", str(out), "--samples", "2", "--groups", "3", tmp_path=tmp_path
    )
    assert done.returncode == 0, done.stderr
    results = read_journal(out)
    assert len(results) == 2 * TASKS and len({r.rollout_id for r in results}) == 2 * TASKS
    rewarded = Counter(r.task_key for r in results if r.reward is not None)
    assert sum(1 for n in rewarded.values() if n == 2) == 3  # exactly the kept groups are full
    cut = [r for r in results if r.failure_reason is FailureReason.SUPERSEDED]
    assert all("groups_target" in (r.error or "") for r in cut)
    assert len(cut) + sum(rewarded.values()) == 2 * TASKS


def test_more_groups_than_tasks_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    done = fleetroll("run", str(LEDGER), "--groups", str(TASKS + 1), tmp_path=tmp_path)
    assert done.returncode == 2
    assert f"--groups {TASKS + 1} is more than the {TASKS} tasks" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"key": "a", "env_id": "ledger"}\n', "missing required field 'prompt'"),
        (
            '{"key": "a", "prompt": "p", "env_id": "ledger", "modality": "telepathy"}\n',
            "unknown modality 'telepathy'",
        ),
        ("not json\n", "tasks.jsonl:1: invalid JSON"),
        (
            '{"key": "a", "prompt": "p", "env_id": "ledger"}\n',
            "tasks.jsonl:1: field 'verifier_func': missing required field 'verifier_func'",
        ),
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


async def test_a_run_killed_with_sigkill_resumes_to_exactly_one_result_per_rollout(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results.jsonl"
    slow = tmp_path / "slow.toml"
    slow.write_text("[policy]\nthink_time_s = 0.2\n[pool]\nconcurrency = 8\n")
    samples, tasks = 4, ledger_part(tmp_path, SOME)
    args = run_args(tasks, out, "--config", str(slow), samples=samples)
    async with started(tmp_path, args) as (child, log):
        with anyio.fail_after(120):
            await log.wait_for(lambda: log.journaled >= 10)
        child.kill()
        with anyio.fail_after(30):
            await child.wait()
    before = read_journal(out)
    assert 10 <= len(before) < samples * SOME

    done = fleetroll(
        "run",
        str(tasks),
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
    assert len(counts) == samples * SOME and set(counts.values()) == {1}
    assert {r.rollout_id for r in before} <= set(counts)  # nothing finished was lost
    assert len({r.batch_id for r in after}) == 1
    assert out.read_bytes().endswith(b"\n")


# -- interrupts, resume, the journal's lock and identity, the live line (B1) ------


def run_args(tasks: Path, out: Path, *more: str, samples: int = 4) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fleetroll",
        "run",
        str(tasks),
        "--out",
        str(out),
        "--samples",
        str(samples),
        *more,
    ]


def slow_config(tmp_path: Path) -> Path:
    path = tmp_path / "slow.toml"
    path.write_text("[policy]\nthink_time_s = 0.3\n[pool]\nconcurrency = 4\n")
    return path


#: ``python -m fleetroll`` whose journal also says on stdout each time it has results on disk
#: (its debug records), so that a test can wait for them; stderr is what a user sees.
WATCHED_FLEETROLL = (
    "import logging, runpy, sys\n"
    "journal = logging.getLogger('fleetroll.pool.journal')\n"
    "journal.setLevel(logging.DEBUG)\n"
    "journal.addHandler(logging.StreamHandler(sys.stdout))\n"
    "runpy.run_module('fleetroll', run_name='__main__', alter_sys=True)\n"
)
_WRITTEN = re.compile(r"journal .*: (\d+) results written$")


class Output:
    """A child's output, read as it comes: tests wait on it instead of polling."""

    def __init__(self) -> None:
        self.stderr: list[str] = []
        #: Results on the journal's disk, as its last debug record (on stdout) said.
        self.journaled = 0
        self._open = 2
        self._changed = anyio.Event()

    def read_text(self) -> str:
        """Its stderr so far."""
        return "\n".join(self.stderr)

    async def read(self, stream: ByteReceiveStream, *, stdout: bool) -> None:
        tail = ""
        try:
            async for chunk in TextReceiveStream(stream):
                *lines, tail = (tail + chunk).split("\n")
                self._take(lines, stdout=stdout)
        finally:
            self._take([tail] if tail else [], stdout=stdout)
            self._open -= 1

    def _take(self, lines: list[str], *, stdout: bool) -> None:
        if stdout:
            for line in lines:
                if match := _WRITTEN.search(line):
                    self.journaled = int(match[1])
        else:
            self.stderr += lines
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds (the caller bounds the wait with fail_after)."""
        while not condition():
            assert self._open, f"the run ended first:\n{self.read_text()}"
            await self._changed.wait()

    async def closed(self) -> None:
        await self.wait_for(lambda: not self._open)


@asynccontextmanager
async def started(
    tmp_path: Path, args: list[str], env: dict[str, str] | None = None
) -> AsyncIterator[tuple[Process, Output]]:
    """``args`` (``python -m fleetroll ...``) as a child process, its output read as it comes
    (:data:`WATCHED_FLEETROLL`); killed if still running at the end."""
    assert args[:3] == [sys.executable, "-m", "fleetroll"], args
    child = await anyio.open_process(
        [sys.executable, "-c", WATCHED_FLEETROLL, *args[3:]],
        cwd=tmp_path,
        env=env or clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    output = Output()
    assert child.stdout is not None and child.stderr is not None
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(output.read, child.stdout, stdout=True))
        tg.start_soon(functools.partial(output.read, child.stderr, stdout=False))
        try:
            yield child, output
        finally:
            with anyio.CancelScope(shield=True):
                if child.returncode is None:
                    child.kill()
                await child.wait()
                with anyio.move_on_after(30):  # the rest of its output, up to the end
                    await output.closed()
                tg.cancel_scope.cancel()
                await child.aclose()


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
async def test_ctrl_c_then_resume_reruns_exactly_the_cancelled_and_missing_rollouts(
    tmp_path: Path,
) -> None:
    out, samples, tasks = tmp_path / "results.jsonl", 4, ledger_part(tmp_path, SOME)
    args = run_args(tasks, out, "--config", str(slow_config(tmp_path)), samples=samples)
    async with started(tmp_path, args) as (child, log):
        with anyio.fail_after(120):
            await log.wait_for(lambda: log.journaled >= 5)
        child.send_signal(signal.SIGINT)
        with anyio.fail_after(60):
            await child.wait()
    assert child.returncode == 130, log.read_text()
    before = read_journal(out)
    kept = {r.rollout_id for r in before if r.failure_reason is not FailureReason.CANCELLED}
    assert len(kept) >= 5 and len(kept) < len(before), "nothing was cancelled"
    lines_before = lines_in(out)

    with anyio.fail_after(300):
        done = await anyio.run_process(
            run_args(tasks, out, "--resume", samples=samples),
            cwd=tmp_path,
            env=clean_env(),
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    assert f"{len(kept)} already done" in done.stderr.decode()
    rerun = read_journal(out, latest=False)[lines_before:]
    rerun_ids = {r.rollout_id for r in rerun}
    # Exactly the cancelled and the missing ones ran again, each once.
    assert len(rerun_ids) == len(rerun) == samples * SOME - len(kept)
    assert not rerun_ids & kept
    after = read_journal(out)
    assert len(after) == samples * SOME
    assert not [r for r in after if r.failure_reason is FailureReason.CANCELLED]


def telemetry_pairs(db: Path) -> tuple[Counter[str], Counter[str]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT span_name, attributes ->> 'rollout_id' FROM records "
            "WHERE span_name IN ('fleet_rollout_started', 'fleet_rollout_completed')"
        ).fetchall()
    started = Counter(rid for name, rid in rows if name == "fleet_rollout_started")
    completed = Counter(rid for name, rid in rows if name == "fleet_rollout_completed")
    return started, completed


@pytest.mark.slow
async def test_a_second_ctrl_c_exits_130_with_every_result_journaled_and_nothing_leaked(
    tmp_path: Path,
) -> None:
    out, db, samples = tmp_path / "results.jsonl", tmp_path / "telemetry.db", 4
    tasks = ledger_part(tmp_path, SOME)
    args = run_args(tasks, out, "--config", str(slow_config(tmp_path)), samples=samples)
    async with EmulatorProcess() as emu:
        env = clean_env() | {
            "FLEET_BASE_URL": emu.base_url,
            "FLEET_API_KEY": emu.api_key,
            "FLEETROLL_TELEMETRY__DB_PATH": str(db),
        }
        async with started(tmp_path, args, env) as (child, log):
            with anyio.fail_after(120):
                await log.wait_for(lambda: log.journaled >= 5)
            child.send_signal(signal.SIGINT)
            with anyio.fail_after(30):  # two signals, not one the kernel merged
                await log.wait_for(lambda: "interrupted" in log.read_text())
            child.send_signal(signal.SIGINT)
            with anyio.fail_after(90):
                await child.wait()
        ledger = await emu.ledger()
    stderr = log.read_text()
    assert child.returncode == 130, stderr
    assert "Traceback" not in stderr and "already stopping" in stderr
    lines = read_journal(out, latest=False)  # every line is a whole, valid result
    delivered = re.search(r"batch \w+: (\d+) results", stderr)
    assert delivered is not None, stderr
    assert len(lines) == int(delivered[1]) == samples * SOME
    assert len({r.rollout_id for r in lines}) == len(lines)
    assert ledger["running"] == 0, ledger
    started_events, completed_events = telemetry_pairs(db)
    assert started_events == completed_events and set(started_events.values()) == {1}


@pytest.mark.slow
async def test_a_second_run_on_a_journal_in_use_gets_one_line_and_exit_code_2(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results.jsonl"
    tasks = ledger_part(tmp_path, SOME)
    args = run_args(tasks, out, "--config", str(slow_config(tmp_path)))
    async with started(tmp_path, args) as (child, log):
        with anyio.fail_after(120):
            await log.wait_for(lambda: log.journaled >= 1)
            second = await anyio.run_process(
                run_args(tasks, out, "--resume"), cwd=tmp_path, env=clean_env(), check=False
            )
        child.send_signal(signal.SIGINT)
        with anyio.fail_after(60):
            await child.wait()
    message = second.stderr.decode().strip()
    assert second.returncode == 2, message
    assert "in use by another fleetroll run" in message and len(message.splitlines()) == 1
    assert child.returncode == 130, log.read_text()
    ids = [r.rollout_id for r in read_journal(out, latest=False)]
    assert len(ids) == len(set(ids))  # the refused run wrote nothing


def ledger_part(tmp_path: Path, count: int, verifier_suffix: str = "") -> Path:
    """The first ``count`` ledger tasks in a file (the first one's verifier with a suffix)."""
    lines = [line for line in LEDGER.read_text().splitlines() if line.strip()][:count]
    records = [json.loads(line) for line in lines]
    records[0]["verifier_func"] += verifier_suffix
    path = tmp_path / f"tasks{count}-{len(verifier_suffix)}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_resume_with_other_samples_or_a_changed_task_is_refused_with_exit_code_2(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results.jsonl"
    tasks = ledger_part(tmp_path, 2)
    first = fleetroll("run", str(tasks), "--out", str(out), "--samples", "2", tmp_path=tmp_path)
    assert first.returncode == 0, first.stderr
    journaled = out.read_bytes()

    more = fleetroll(
        "run", str(tasks), "--out", str(out), "--samples", "3", "--resume", tmp_path=tmp_path
    )
    assert more.returncode == 2 and "started with --samples 2" in more.stderr, more.stderr

    changed = ledger_part(tmp_path, 2, "\n# changed\n")
    edited = fleetroll(
        "run", str(changed), "--out", str(out), "--samples", "2", "--resume", tmp_path=tmp_path
    )
    assert edited.returncode == 2 and "has changed since it was started" in edited.stderr
    assert "Traceback" not in more.stderr + edited.stderr
    assert out.read_bytes() == journaled


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_out_refuses_a_fifo_or_a_device_in_one_line(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        target = tmp_path / "pipe"
        os.mkfifo(target)
    else:
        target = Path("/dev/zero")
    done = fleetroll("run", str(LEDGER), "--out", str(target), "--resume", tmp_path=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "not a regular file" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_closing_lines_say_where_results_and_telemetry_were_written(tmp_path: Path) -> None:
    out, db = tmp_path / "results.jsonl", tmp_path / "telemetry.db"
    done = subprocess.run(
        [*run_args(LEDGER, out, "--concurrency", "2", samples=1)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=clean_env() | {"FLEETROLL_TELEMETRY__DB_PATH": str(db)},
    )
    assert done.returncode == 0, done.stderr
    assert f"fleetroll: results: {out}" in done.stderr
    assert f"fleetroll: telemetry: {db}" in done.stderr
    # The last progress line: nothing acting any more, and the limit it is held to.
    assert re.search(rf"{TASKS}/{TASKS} done · 0 acting \(max 2\)", done.stderr), done.stderr


async def test_no_more_rollouts_count_as_acting_than_the_concurrency_allows(
    emulator: Emulator,
) -> None:
    settings = load_settings(None, pool={"concurrency": 2})
    tasks = load_tasks(LEDGER, modalities=settings.modalities)
    policy = policy_from_settings(settings)
    looks: list[Progress] = []
    async with RolloutPool(settings, api_key=emulator.api_key, base_url=emulator.base_url) as pool:
        batch = pool.run_batch(tasks, policy, samples_per_task=3)
        watch = Watch(batch, settings.pool.concurrency)
        with anyio.fail_after(120):
            async for _ in batch:
                looks.append(watch.look(time.monotonic()))
    await policy.aclose()
    assert len(looks) == 3 * TASKS
    for p in looks:
        assert p.acting is not None and p.acting <= 2, p
        assert p.provisioning + p.waiting + p.acting + p.finishing == p.in_flight, p
        assert p.in_flight + p.queued + p.finished == p.total, p


def test_the_eta_is_unknown_before_any_rollout_has_finished() -> None:
    p = Progress(total=10, done=0, failed=0, in_flight=4, acting=4, queued=6, concurrency=4)
    assert _describe(p, 30.0).endswith("ETA ?")


def test_the_eta_is_unknown_when_overdue_rollouts_are_most_of_what_is_left() -> None:
    # 48 done in 60 s: the rate alone would say 2 more take 2 s; both have been
    # provisioning for over twice the mean duration (a hung create).
    p = Progress(
        total=50,
        done=48,
        failed=0,
        in_flight=2,
        provisioning=2,
        acting=0,
        concurrency=4,
        mean_s=1.0,
        overdue=2,
    )
    assert _describe(p, 60.0).endswith("ETA ? (2 overdue)")


def test_the_eta_is_a_lower_bound_while_a_few_rollouts_are_overdue() -> None:
    p = Progress(
        total=100,
        done=40,
        failed=0,
        in_flight=8,
        acting=8,
        concurrency=8,
        mean_s=2.0,
        overdue=1,
        queued=52,
    )
    assert _describe(p, 40.0).endswith("ETA >1m00s (1 overdue)")


def test_the_eta_follows_the_rate_when_nothing_is_overdue() -> None:
    p = Progress(
        total=100, done=45, failed=5, in_flight=8, acting=8, concurrency=8, mean_s=2.0, queued=42
    )
    assert _describe(p, 50.0).endswith("1.0/s · ETA 50s")


def test_the_live_line_says_what_each_number_counts() -> None:
    p = Progress(
        total=20,
        done=3,
        failed=1,
        in_flight=7,
        queued=8,
        provisioning=2,
        waiting=1,
        acting=3,
        finishing=1,
        concurrency=4,
    )
    line = _describe(p, 10.0)
    for part in (
        "4/20 done",
        "3 acting (max 4)",
        "1 finishing",
        "2 provisioning",
        "1 waiting for a slot",
        "8 queued",
        "1 failed",
    ):
        assert part in line, line
    ray = _describe(Progress(total=20, done=3, failed=1, in_flight=16), 10.0)
    assert "16 in flight" in ray and "acting" not in ray
