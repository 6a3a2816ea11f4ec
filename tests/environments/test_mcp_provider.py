"""The mcp provider end to end: real MCP servers as subprocesses, the scripted policy.

Every test runs a pool whose Fleet points nowhere (``http://127.0.0.1:9``): a
batch of only mcp tasks must never need it. Each test counts, after the
batch, the processes running from its working-directory root and the
folders left in it: both must be zero.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks, parse_task
from fleetroll.telemetry import Events, MemorySink

pytestmark = pytest.mark.slow

SERVER = ["{python}", "{examples}/notes_server.py", "--root", "{workdir}"]
SAYS_ONE = ["{python}", "-c", "print('checking'); print(1)"]
EXAMPLE = config_dir() / "tasks" / "mcp" / "notes.jsonl"
NOWHERE = "http://127.0.0.1:9"  # no Fleet: a batch of mcp tasks must not need one


def settings_for(root: Path, **overrides: Any) -> Any:
    timeouts = {"mcp_connect_s": 20.0, "call_tool_s": 20.0, **overrides.pop("timeouts", {})}
    mcp = {"workdir_root": str(root), "kill_grace_s": 1.0, **overrides.pop("mcp", {})}
    return load_settings(timeouts=timeouts, mcp=mcp, **overrides)


def task(key: str, *, environment: Any = None, verifier: Any = None, **fields: Any) -> TaskSpec:
    record = {
        "key": key,
        "prompt": "Use the notes.",
        "environment": environment or {"command": SERVER},
        "verifier": verifier or {"command": SAYS_ONE},
        **fields,
    }
    return parse_task(record, source="test", modalities={"tool_use", "computer_use"})


def write(path: str, content: str) -> list[dict[str, Any]]:
    return [{"name": "write_file", "arguments": {"path": path, "content": content}}]


async def run(
    tasks: Sequence[TaskSpec], root: Path, *, sink: MemorySink | None = None, **overrides: Any
) -> list[RolloutResult]:
    settings = settings_for(root, **overrides)
    events = Events([sink] if sink else [])
    with anyio.fail_after(90):
        async with RolloutPool(settings, api_key="unused", base_url=NOWHERE, events=events) as pool:
            return await pool.run_batch(tasks, ScriptedPolicy()).results()


def running_from(root: Path) -> list[int]:
    """Processes whose command line or working directory is under ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue  # gone already, or not ours
        if str(root) in cmdline or cwd.startswith(str(root)):
            found.append(int(entry.name))
    return found


def assert_nothing_left(root: Path) -> None:
    assert running_from(root) == []
    assert not root.exists() or list(root.iterdir()) == []


async def test_the_example_tasks_score_one_with_their_solution_and_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    root = tmp_path / "workdirs"
    settings = settings_for(root)
    tasks = load_tasks(EXAMPLE, modalities=settings.modalities)

    results = sorted(await run(tasks, root), key=lambda r: r.task_key)

    assert [(r.task_key, r.reward, r.failure_reason) for r in results] == [
        (t.key, 1.0, None) for t in tasks
    ]
    assert {r.env_key for r in results} == {"notes"}
    assert all(r.instance_id and r.instance_id.startswith("mcp-") for r in results)
    assert_nothing_left(root)


async def test_a_pool_without_a_fleet_key_runs_mcp_tasks(tmp_path: Path) -> None:
    root = tmp_path / "workdirs"
    settings = settings_for(root)
    tasks = load_tasks(EXAMPLE, modalities=settings.modalities)[:1]

    with anyio.fail_after(90):
        async with RolloutPool(settings) as pool:
            [result] = await pool.run_batch(tasks, ScriptedPolicy()).results()

    assert (result.reward, result.failure_reason) == (1.0, None)
    assert_nothing_left(root)


async def test_workdir_in_solution_arguments_is_the_rollout_s_working_directory(
    tmp_path: Path,
) -> None:
    root = tmp_path / "workdirs"
    # The verifier runs in the working directory: 1 when the note holds its path.
    check = [
        "{python}",
        "-c",
        "import os; print(float(os.path.samefile(open('where').read(), '.')))",
    ]
    tasks = [
        task(f"where-{n}", verifier={"command": check}, solution=write("where", "{workdir}"))
        for n in range(2)
    ]

    results = await run(tasks, root)

    assert [(r.reward, r.failure_reason) for r in results] == [(1.0, None)] * 2
    assert_nothing_left(root)


async def test_the_example_tasks_score_zero_without_a_solution(tmp_path: Path) -> None:
    root = tmp_path / "workdirs"
    settings = settings_for(root)
    tasks = [
        t.model_copy(update={"solution": ()})
        for t in load_tasks(EXAMPLE, modalities=settings.modalities)
    ]

    results = await run(tasks, root)

    assert [(r.reward, r.failure_reason) for r in results] == [(0.0, None)] * len(tasks)
    assert_nothing_left(root)


async def test_a_server_that_never_starts_is_an_init_error_with_its_stderr(
    tmp_path: Path,
) -> None:
    root = tmp_path / "workdirs"
    broken = [*SERVER, "--fail-start", "cannot open notes.db: permission denied"]

    [result] = await run([task("t", environment={"command": broken})], root)

    assert result.failure_reason is FailureReason.INIT_ERROR and result.reward is None
    assert "cannot open notes.db: permission denied" in (result.error or "")
    assert_nothing_left(root)


async def test_a_task_env_value_in_the_server_s_stderr_is_redacted_from_the_error(
    tmp_path: Path,
) -> None:
    root = tmp_path / "workdirs"
    secret = "notes-token-0123456789abcdef"
    broken = [*SERVER, "--fail-start", f"login with {secret} refused"]
    environment = {"command": broken, "env": {"NOTES_LOGIN": secret}}

    [result] = await run([task("t", environment=environment)], root)

    assert result.failure_reason is FailureReason.INIT_ERROR
    assert "login with [REDACTED] refused" in (result.error or "")
    assert secret not in result.model_dump_json()


async def test_a_missing_command_or_a_failing_setup_is_an_init_error(tmp_path: Path) -> None:
    root = tmp_path / "workdirs"
    failing_setup = ["{python}", "-c", "import sys; sys.exit('no seed data')"]
    tasks = [
        task("missing", environment={"command": ["no-such-mcp-server-binary"]}),
        task("setup", environment={"command": SERVER, "setup": failing_setup}),
    ]

    missing, setup = sorted(await run(tasks, root), key=lambda r: r.task_key)

    assert missing.failure_reason is FailureReason.INIT_ERROR
    assert "no-such-mcp-server-binary" in (missing.error or "")
    assert setup.failure_reason is FailureReason.INIT_ERROR
    assert "exited with status 1" in (setup.error or "") and "no seed data" in (setup.error or "")
    assert_nothing_left(root)


async def test_a_server_that_crashes_mid_rollout_is_instance_lost(tmp_path: Path) -> None:
    root = tmp_path / "workdirs"
    crashing = [*SERVER, "--crash-after", "2"]
    solution = write("a.txt", "1") + write("b.txt", "2") + write("c.txt", "3")

    [result] = await run([task("t", environment={"command": crashing}, solution=solution)], root)

    assert result.failure_reason is FailureReason.INSTANCE_LOST and result.reward is None
    assert_nothing_left(root)


async def test_a_hanging_tool_call_is_a_tool_failure_within_its_deadline(tmp_path: Path) -> None:
    root = tmp_path / "workdirs"
    hanging = [*SERVER, "--hang-tool"]

    [result] = await run(
        [task("t", environment={"command": hanging}, solution=[{"name": "hang"}])],
        root,
        timeouts={"call_tool_s": 1.0},
    )

    assert result.failure_reason is FailureReason.TOOL_FAILURE and result.reward is None
    assert "hang took over 1 s" in (result.error or "")
    assert_nothing_left(root)


@pytest.mark.parametrize(
    ("verifier", "words"),
    [
        ({"command": ["{python}", "-c", "import sys; print(1); sys.exit(3)"]}, "status 3"),
        ({"command": ["{python}", "-c", "import time; time.sleep(60)"]}, "took over 1 s"),
        ({"command": ["{python}", "-c", "print('all good')"]}, "printed no reward"),
        ({"command": ["{python}", "-c", "print(1)"], "reward_file": "reward.txt"}, "reward.txt"),
        ({"tool": {"name": "read_file", "arguments": {"path": "nope.txt"}}}, "failed"),
    ],
    ids=["crash", "timeout", "no-number", "no-reward-file", "tool-error"],
)
async def test_a_verifier_that_crashes_hangs_or_gives_no_number_is_a_verifier_error(
    tmp_path: Path, verifier: dict[str, Any], words: str
) -> None:
    root = tmp_path / "workdirs"

    [result] = await run(
        [task("t", verifier=verifier, solution=write("a.txt", "x"))],
        root,
        timeouts={"verifier_s": 1.0 if "over 1 s" in words else 20.0},
    )

    assert result.failure_reason is FailureReason.VERIFIER_ERROR and result.reward is None
    assert words in (result.verifier.error if result.verifier else "")
    assert_nothing_left(root)


@pytest.mark.parametrize(
    ("verifier", "written", "reward"),
    [
        ({"command": ["{python}", "-c", "print('checked'); print(0.25)"]}, "x", 0.25),
        ({"command": ["{python}", "-c", "print('{\"score\": 0.5}')"]}, "x", 0.5),
        ({"command": ["{python}", "-c", "print(True)"]}, "x", 1.0),
        ({"command": ["{python}", "-c", "print(1.5)"]}, "x", 1.5),
        (
            {
                "command": ["{python}", "-c", "open('r.txt', 'w').write('{\"value\": 0.125}')"],
                "reward_file": "r.txt",
            },
            "x",
            0.125,
        ),
        ({"tool": {"name": "read_file", "arguments": {"path": "a.txt"}}}, '{"reward": 0.75}', 0.75),
        ({"tool": {"name": "read_file", "arguments": {"path": "a.txt"}}}, "abc", None),
    ],
    ids=["number", "score", "true", "unclamped", "value-file", "reward-tool", "text-tool"],
)
async def test_an_mcp_verifier_s_answer_reads_as_fleet_s_verifiers_do(
    tmp_path: Path, verifier: dict[str, Any], written: str, reward: float | None
) -> None:
    root = tmp_path / "workdirs"

    [result] = await run([task("t", verifier=verifier, solution=write("a.txt", written))], root)

    assert result.reward == reward, result.error
    if reward is None:
        assert result.failure_reason is FailureReason.VERIFIER_ERROR
        assert "answered 'abc', not a reward" in (result.verifier.error if result.verifier else "")
    assert_nothing_left(root)


async def test_the_server_and_verifier_get_only_the_task_env_never_fleetroll_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "workdirs"
    monkeypatch.setenv("FLEET_API_KEY", "sk-fleet-secret-never-shown")
    dump = "import json, os; open('env.json', 'w').write(json.dumps(dict(os.environ))); print(1)"
    reads = ["{python}", "-c", "import os; print(1 if os.environ['ANSWER'] == '42' else 0)"]

    [result] = await run(
        [
            task(
                "t",
                environment={
                    "command": SERVER,
                    "env": {"ANSWER": "42"},
                    "setup": ["{python}", "-c", dump],
                },
                verifier={"command": reads},
                solution=[],
            )
        ],
        root,
        mcp={"keep_workdirs": True},
    )

    assert result.reward == 1.0, result.error
    [folder] = root.iterdir()
    seen = json.loads((folder / "work" / "env.json").read_text())
    # Nothing of fleetroll's own environment; the plugin switch is docs/tasks.md's.
    expected = {"PATH", "HOME", "ANSWER", "PYDANTIC_DISABLE_PLUGINS"}
    assert set(seen) - {"PWD", "SHLVL", "_", "LC_CTYPE"} == expected
    assert seen["PYDANTIC_DISABLE_PLUGINS"] == "logfire-plugin"
    assert running_from(root) == []


async def test_a_mixed_batch_runs_fleet_tasks_on_the_emulator_and_mcp_tasks_locally(
    tmp_path: Path,
) -> None:
    from fleetroll.emulator import Emulator

    root = tmp_path / "workdirs"
    settings = settings_for(root)
    ledger = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    notes = load_tasks(EXAMPLE, modalities=settings.modalities)
    tasks = [ledger[0], *notes[:2], ledger[1]]

    with anyio.fail_after(90):
        async with (
            Emulator() as emu,
            RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
        ):
            results = await pool.run_batch(tasks, ScriptedPolicy()).results()
            still_running = [i.instance_id for i in emu.store if i.alive]

    by_key = {r.task_key: r for r in results}
    assert {k: r.reward for k, r in by_key.items()} == {t.key: 1.0 for t in tasks}
    assert by_key[ledger[0].key].env_key == "ledger"
    assert by_key[notes[0].key].env_key == "notes"
    assert still_running == []
    assert_nothing_left(root)


async def test_a_url_server_is_reset_before_each_rollout_and_scored_by_a_tool(
    tmp_path: Path,
) -> None:
    from fleetroll.examples_mcp.notes_server import build
    from fleetroll.service import serve_app

    served = tmp_path / "served"
    served.mkdir()
    (served / "status.txt").write_text("done")  # a previous user's state: reset removes it
    root = tmp_path / "workdirs"
    environment = {"url": "", "reset": {"tool": {"name": "clear"}}}
    verifier = {
        "tool": {"name": "check_file", "arguments": {"path": "status.txt", "content": "done"}}
    }
    app = build(served).streamable_http_app()

    async with serve_app(app, "127.0.0.1", 0) as url:
        environment["url"] = f"{url}/mcp"
        unsolved = task("unsolved", environment=environment, verifier=verifier, solution=[])
        solved = task(
            "solved",
            environment=environment,
            verifier=verifier,
            solution=write("status.txt", "done"),
        )
        [first] = await run([unsolved], root)
        [second] = await run([solved], root)
        [third] = await run([unsolved], root)

    assert (first.reward, second.reward, third.reward) == (0.0, 1.0, 0.0)
    assert second.failure_reason is None and second.env_key == "mcp"
    assert_nothing_left(root)


async def test_cancelling_a_batch_mid_tool_call_releases_the_server_and_its_workdir(
    tmp_path: Path,
) -> None:
    root = tmp_path / "workdirs"
    sink = MemorySink()
    settings = settings_for(root, timeouts={"call_tool_s": 60.0})
    hanging = task(
        "t", environment={"command": [*SERVER, "--hang-tool"]}, solution=[{"name": "hang"}]
    )

    with anyio.fail_after(60):
        async with RolloutPool(
            settings, api_key="unused", base_url=NOWHERE, events=Events([sink])
        ) as pool:
            batch = pool.run_batch([hanging], ScriptedPolicy())
            [rollout] = batch.rollouts
            await rollout.wait_until(lambda r: r.view(messages=False).steps >= 1)
            assert running_from(root) != []  # the server runs, its tool call hangs
            batch.cancel()
            [result] = await batch.results()

    assert result.failure_reason is FailureReason.CANCELLED
    assert len(sink.named("fleet_instance_released")) == 1
    assert_nothing_left(root)


@pytest.mark.skipif(
    shutil.which("mcp-server-filesystem") is None,
    reason="the reference filesystem server (npm @modelcontextprotocol/server-filesystem) is not"
    " installed and this machine installs nothing from a registry during tests; install it"
    " globally (npm install -g) to run this test",
)
async def test_the_reference_filesystem_server_from_npm_is_an_environment(tmp_path: Path) -> None:
    root = tmp_path / "workdirs"
    check = ["{python}", "-c", "import pathlib; print(int(pathlib.Path('todo.txt').is_file()))"]
    reference = task(
        "reference",
        environment={"command": ["mcp-server-filesystem", "{workdir}"]},
        verifier={"command": check},
        solution=[{"name": "write_file", "arguments": {"path": "todo.txt", "content": "x"}}],
    )

    [result] = await run([reference], root)

    assert result.reward == 1.0, result.error
    assert_nothing_left(root)


def test_fleetroll_run_on_the_example_folder_scores_one_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "workdirs"
    out = tmp_path / "results.jsonl"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env |= {"FLEETROLL_TELEMETRY__DB_PATH": os.devnull, "FLEETROLL_MCP__WORKDIR_ROOT": str(root)}

    done = subprocess.run(
        [sys.executable, "-m", "fleetroll", "run", str(EXAMPLE.parent), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )

    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["task_key"], r["reward"]) for r in results) == [
        ("notes-001", 1.0),
        ("notes-002", 1.0),
        ("notes-003", 1.0),
    ]
    assert_nothing_left(root)
