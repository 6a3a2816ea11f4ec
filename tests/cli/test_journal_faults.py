"""``fleetroll run --out`` under faults of its journal (issue 37): a result JSON
cannot hold, a full disk, a corrupt line.

Real processes: ``fleetroll run`` as a child on this test's emulator (a real
HTTP server on loopback); a full disk is a real one, the child's file-size
limit (``RLIMIT_FSIZE``: its writes past it fail with EFBIG, as they fail with
ENOSPC on a full disk); a lone surrogate comes from a real policy server on
loopback, as a model's text (JSON's ``\\udc80`` escape, which ``json`` accepts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.pool.journal import read_journal
from fleetroll.results import FailureReason
from fleetroll.settings import config_dir
from fleetroll.testing.fake_openai import FakeChatServer, FakeRawResponse, Reply, completion
from fleetroll_children import child_env

pytestmark = pytest.mark.slow

TASK_LINES = (config_dir() / "tasks" / "ledger.jsonl").read_text().splitlines()[:6]
#: Sets the child's file-size limit, then runs ``fleetroll`` with the arguments given.
LIMITED = (
    "import os, resource, sys;"
    " resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY));"
    " os.execv(sys.executable, [sys.executable, '-m', 'fleetroll', *sys.argv[2:]])"
)


async def fleetroll(
    tmp_path: Path, env: dict[str, str], *args: str, fsize: int | None = None
) -> subprocess.CompletedProcess[bytes]:
    if fsize is None:
        command = [sys.executable, "-m", "fleetroll", *args]
    else:
        command = [sys.executable, "-c", LIMITED, str(fsize), *args]
    with anyio.fail_after(180):
        return await anyio.run_process(command, cwd=tmp_path, env=env, check=False)


def tasks_file(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(TASK_LINES) + "\n")
    return tasks


async def test_a_result_json_cannot_hold_is_journaled_as_result_error_and_the_batch_goes_on(
    emulator: Emulator, tmp_path: Path
) -> None:
    bad_prompt = json.loads(TASK_LINES[2])["prompt"]

    def script(body: dict[str, Any]) -> Reply:
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if prompt == bad_prompt:  # a file name that is not UTF-8, in the model's text
            return FakeRawResponse(json.dumps(completion("found a\udc80b.txt")))
        return completion("done")

    out = tmp_path / "out.jsonl"
    async with FakeChatServer(script) as server:
        done = await fleetroll(
            tmp_path,
            child_env(emulator),
            "run",
            str(tasks_file(tmp_path)),
            "--out",
            str(out),
            "--policy",
            "openai",
            "--base-url",
            server.base_url,
            "--model",
            "fake",
            "--no-preflight",
        )
    said = done.stderr.decode(errors="replace")
    assert done.returncode == 0, said
    assert "Traceback" not in said
    results = read_journal(out, latest=False)
    assert len(results) == len(TASK_LINES)  # every result kept, each once
    by_key = {r.task_key: r for r in results}
    bad = by_key[json.loads(TASK_LINES[2])["key"]]
    assert (bad.status, bad.failure_reason, bad.reward) == (
        "failed",
        FailureReason.RESULT_ERROR,
        None,
    )
    assert "content holds a lone surrogate (U+DC80)" in (bad.error or "")
    others = [r for r in results if r is not bad]
    assert all(r.failure_reason is not FailureReason.RESULT_ERROR for r in others)


async def test_a_full_disk_stops_run_in_one_line_and_resume_runs_only_what_was_not_journaled(
    emulator: Emulator, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    tasks = tasks_file(tmp_path)
    # One rollout at a time: one result a write, so the disk fills between two of them.
    env = child_env(emulator, FLEETROLL_POOL__CONCURRENCY="1")
    args = ("run", str(tasks), "--out", str(out), "--samples", "2", "--no-preflight")
    total = len(TASK_LINES) * 2
    # A result line is about 2 KB: the disk is full after two or three of them.
    full = await fleetroll(tmp_path, env, *args, fsize=6000)
    said = full.stderr.decode(errors="replace")
    assert full.returncode == 1, said
    assert "Traceback" not in said
    last = said.strip().splitlines()[-1]
    assert f"writing the journal {out} failed: File too large" in last
    assert "--resume" in last
    # Whole lines only, each a result: what was written, nothing torn.
    data = out.read_bytes()
    assert data.endswith(b"\n") or data == b""
    kept = read_journal(out, latest=False)
    assert 1 <= len(kept) == data.count(b"\n") < total
    assert f"({len(kept)} results of this run were journaled" in last

    resumed = await fleetroll(tmp_path, env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr.decode(errors="replace")
    every = read_journal(out, latest=False)
    assert every[: len(kept)] == kept  # nothing written before changed
    ran = Counter(r.rollout_id for r in every if r.failure_reason is not FailureReason.CANCELLED)
    assert len(ran) == total and set(ran.values()) == {1}  # each rollout once: none twice


async def test_a_resume_skips_a_corrupt_line_saying_where_and_runs_its_rollout_again(
    emulator: Emulator, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    args = ("run", str(tasks_file(tmp_path)), "--out", str(out), "--no-preflight")
    first = await fleetroll(tmp_path, child_env(emulator), *args)
    assert first.returncode == 0, first.stderr.decode(errors="replace")
    lines = out.read_bytes().splitlines(keepends=True)
    torn = json.loads(lines[1])["rollout_id"]
    lines[1] = lines[1][:100] + b"\n"  # a disk's fault in the middle of the file
    out.write_bytes(b"".join(lines))

    resumed = await fleetroll(tmp_path, child_env(emulator), *args, "--resume")
    said = resumed.stderr.decode(errors="replace")
    assert resumed.returncode == 0, said
    assert f"{out}:2: not a rollout result, skipped" in said
    after = read_journal(out, latest=False)
    assert [r.rollout_id for r in after[len(lines) - 1 :]] == [torn]  # only it ran again
    assert len(read_journal(out)) == len(TASK_LINES)
