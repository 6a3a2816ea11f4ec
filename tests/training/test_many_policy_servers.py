"""Many policy servers over real HTTP: ``fleetroll run`` with ``--base-url`` twice, two
fake servers on loopback, one of them stopped mid-batch."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.pool.journal import read_journal
from fleetroll.testing.fake_openai import FakeChatServer, FakeError, Reply
from training_helpers import TASK_FILES, TASKS, solving

#: Integration tests (the emulator over loopback, a real process): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

LEDGER = [t for t in TASKS.values() if t.env_key == "ledger" and len(t.solution or ()) >= 3][:6]
SAMPLES = 2


def task_file(tmp_path: Path) -> Path:
    keys = {t.key for t in LEDGER}
    lines = [
        line
        for f in TASK_FILES
        for line in f.read_text().splitlines()
        if line.strip() and json.loads(line)["key"] in keys
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


async def test_each_rollout_keeps_to_one_server_both_serve_and_a_dead_one_loses_no_rollout(
    tmp_path: Path,
) -> None:
    script = solving(LEDGER)
    both_served = anyio.Event()
    servers: list[FakeChatServer] = []

    def stopping_mid_rollout(body: dict[str, Any]) -> Reply:
        # The first server is stopped once both served and it answers a rollout's
        # second call (every task has three steps or more: calls follow), so some
        # rollout surely moves. Stopped after a count of replies instead, it could
        # find every one of its rollouts done when their starts were spread out.
        if both_served.is_set():
            # Dying: until its shutdown is done (it lets open connections finish,
            # slowly under load), it answers what it still gets with 503.
            return FakeError(503, "shutting down")
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if turn == 1 and all(s.replies for s in servers):
            both_served.set()
        return script(body)

    out = tmp_path / "results.jsonl"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env |= {
        "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
        # Quick retries: the kill costs backoffs, not the test's time.
        "FLEETROLL_RETRIES__POLICY_BACKOFF_INITIAL_S": "0.01",
        "FLEETROLL_RETRIES__POLICY_BACKOFF_MAX_S": "0.05",
    }

    async def doomed_server(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with FakeChatServer(stopping_mid_rollout) as doomed:
            servers.insert(0, doomed)
            task_status.started(doomed)
            await both_served.wait()
        # Stopped: its port refuses connections from here on.

    async with FakeChatServer(script) as second:
        servers.append(second)
        args = [sys.executable, "-m", "fleetroll", "run", str(task_file(tmp_path))]
        args += ["--out", str(out), "--samples", str(SAMPLES), "--concurrency", "8"]
        args += ["--policy", "openai", "--model", "served"]
        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                doomed = await tg.start(doomed_server)
                args += ["--base-url", doomed.base_url, "--base-url", second.base_url]
                done = await anyio.run_process(args, cwd=tmp_path, env=env, check=False)
                tg.cancel_scope.cancel()  # the batch ended: no kill is coming
        assert both_served.is_set(), "the batch ended before both servers had served"
        served_by_second = len(second.replies)

    assert done.returncode == 0, done.stderr.decode()
    results = read_journal(out)
    # None lost: every rollout has its result, and every one was solved.
    assert len(results) == len(LEDGER) * SAMPLES
    assert [r.failure_reason for r in results] == [None] * len(results)
    assert all(r.reward == 1.0 for r in results)
    paths = [[t.server for t in r.turns] for r in results]
    first_url, second_url = doomed.base_url, second.base_url
    # Each rollout's calls went to one server; a rollout on the dead one moved once, to the other.
    for path in paths:
        moves = [(a, b) for a, b in itertools.pairwise(path) if a != b]
        assert moves in ([], [(first_url, second_url)]), path
    assert {path[0] for path in paths} == {first_url, second_url}  # both served
    assert any(len(set(path)) == 2 for path in paths)  # the kill was mid-batch
    # The turns say truly where they went: the second server answered exactly those.
    assert sum(path.count(second_url) for path in paths) == served_by_second
