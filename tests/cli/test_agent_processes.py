"""``fleetroll run --agent-command`` as a real process: its agents' processes end with
it however it ends (SIGTERM, kill -9), and no agent can read fleetroll's keys or
its siblings' keys in /proc.

Real processes: ``fleetroll run`` as a child on the embedded emulator (or this
test's emulator, where fleetroll holds a Fleet key), its agents' calls going to
a vLLM-shaped fake server on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import anyio
import httpx
import pytest

from agent_helpers import end_marked, leaving_descendants, marked, new_mark
from fleetroll.emulator import Emulator
from fleetroll.settings import config_dir
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape, completion

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def mark() -> Iterator[str]:
    """A mark for the test's agents' descendants; what is left of them is ended after."""
    mark = new_mark()
    yield mark
    end_marked(mark)


TASK_LINES = (config_dir() / "tasks" / "ledger.jsonl").read_text().splitlines()[:3]


def child_env(**more: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_", "OTEL_"))
    }
    return env | {
        "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
        "FLEETROLL_POOL__CONCURRENCY": "3",
        **more,
    }


async def start_run(
    tmp_path: Path, env: Mapping[str, str], base_url: str, agent: list[str]
) -> anyio.abc.Process:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(TASK_LINES) + "\n")
    args = [sys.executable, "-m", "fleetroll", "run", str(tasks), "--out", "out.jsonl"]
    args += ["--policy", "openai", "--base-url", base_url, "--model", "served"]
    args += ["--agent-command", subprocess.list2cmdline(agent)]
    with (tmp_path / "run.log").open("wb") as log:  # the child keeps its own copy
        return await anyio.open_process(
            args, cwd=tmp_path, env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill_9"])
async def test_every_agent_process_ends_with_fleetroll_run_even_those_that_called_setsid(
    tmp_path: Path, stop: signal.Signals, mark: str
) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(leaving_descendants(mark)[2])
    async with FakeChatServer([completion("hello")] * 3, vllm=VllmShape()) as server:
        child = await start_run(
            tmp_path, child_env(), server.base_url, [sys.executable, str(agent)]
        )
        try:
            with anyio.fail_after(120):  # 3 agents, each with a child and a grandchild
                while len(marked(mark)) < 6:
                    assert child.returncode is None, (tmp_path / "run.log").read_text()
                    await anyio.sleep(0.05)
            child.send_signal(stop)
            with anyio.fail_after(60):
                await child.wait()
        finally:
            if child.returncode is None:
                child.kill()
                with anyio.fail_after(30):
                    await child.wait()
        # SIGTERM: gone before fleetroll exits. kill -9: each agent's init sees its
        # lifeline end and ends the rest, a moment after.
        with anyio.fail_after(30):
            while left := marked(mark):
                assert stop is signal.SIGKILL, left
                await anyio.sleep(0.05)
    notes = tmp_path / "out.jsonl.agents"  # beside the journal: what a next start ends
    if stop is signal.SIGTERM:
        assert child.returncode == 130, (tmp_path / "run.log").read_text()
        assert not notes.exists()
    else:
        assert len(list(notes.iterdir())) == 1


#: An agent that looks for secrets: it notes its own key, waits until its
#: siblings have noted theirs (so all run at once), then copies everything it can
#: read of other processes' environments and command lines, its parent's first.
SNOOP = """
import os, sys, time
where = sys.argv[1]
key = os.environ["OPENAI_API_KEY"]
open(os.path.join(where, key + ".key"), "w").close()
deadline = time.monotonic() + 60
while sum(name.endswith(".key") for name in os.listdir(where)) < 3:
    assert time.monotonic() < deadline, "the siblings never ran together"
    time.sleep(0.05)
seen = []
for pid in [str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]:
    if pid == str(os.getpid()):
        continue
    for part in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as f:
                seen.append(f"{pid}/{part}: " + f.read().decode("utf-8", "replace"))
        except OSError:
            pass
with open(os.path.join(where, key + ".seen"), "w") as f:
    f.write("\\n".join(seen))
"""


async def test_an_agent_finds_neither_fleetroll_s_keys_nor_its_siblings_keys_in_proc(
    tmp_path: Path,
) -> None:
    where = tmp_path / "snooped"
    where.mkdir()
    agent = tmp_path / "snoop.py"
    agent.write_text(SNOOP)
    secrets = {
        "FLEETROLL_SERVICE_TOKEN": "service-token-of-the-test-0123456789abcdef",
        "OPENAI_API_KEY": "sk-the-policy-server-key-of-the-test",
    }
    async with (
        Emulator() as emu,
        FakeChatServer([completion("hello")] * 3, vllm=VllmShape()) as server,
    ):
        env = child_env(FLEET_BASE_URL=emu.base_url, FLEET_API_KEY=emu.api_key, **secrets)
        command = [sys.executable, str(agent), str(where)]
        child = await start_run(tmp_path, env, server.base_url, command)
        with anyio.fail_after(180):
            code = await child.wait()
        secrets["FLEET_API_KEY"] = emu.api_key
    said = (tmp_path / "run.log").read_text()
    assert code == 0, said
    keys = sorted(p.stem for p in where.glob("*.key"))
    seen = {key: (where / f"{key}.seen").read_text() for key in keys}
    assert len(keys) == 3 and all(seen.values())  # each read something (its own init)
    for key, text in seen.items():
        for name, secret in secrets.items():
            assert secret not in text, f"an agent read {name}"
        assert not [other for other in keys if other != key and other in text], text
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(results) == 3


TOKEN = "an-agent-test-token-of-32-chars!"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def start_serve(tmp_path: Path, port: int, name: str) -> anyio.abc.Process:
    """``fleetroll serve`` on ``port`` over ``tmp_path/state``, once it answers."""
    env = child_env(
        FLEETROLL_SERVICE_TOKEN=TOKEN,
        FLEETROLL_SERVICE__STATE_DIR=str(tmp_path / "state"),
        FLEETROLL_SERVICE__ALLOW_COMMAND_TASKS="true",
    )
    command = [sys.executable, "-m", "fleetroll", "serve", "--port", str(port)]
    with (tmp_path / f"{name}.log").open("wb") as log:
        process = await anyio.open_process(
            command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    async with httpx.AsyncClient() as http:
        with anyio.fail_after(60):
            while True:
                assert process.returncode is None, (tmp_path / f"{name}.log").read_text()
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                        return process
                await anyio.sleep(0.05)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill_9"])
async def test_every_agent_process_ends_when_serve_stops_and_the_restart_finds_none(
    tmp_path: Path, stop: signal.Signals, mark: str
) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(leaving_descendants(mark)[2])
    port = free_port()
    async with FakeChatServer([completion("hello")] * 3, vllm=VllmShape()) as server:
        first = await start_serve(tmp_path, port, "first")
        try:
            async with httpx.AsyncClient() as http:
                with anyio.fail_after(30):
                    answer = await http.post(
                        f"http://127.0.0.1:{port}/v1/batches",
                        headers={"Authorization": f"Bearer {TOKEN}"},
                        json={
                            "tasks": [json.loads(line) for line in TASK_LINES],
                            "policy": {"kind": "openai", "base_url": server.base_url},
                            "agent_command": [sys.executable, str(agent)],
                        },
                    )
            assert answer.is_success, answer.text
            with anyio.fail_after(120):
                while len(marked(mark)) < 6:
                    assert first.returncode is None, (tmp_path / "first.log").read_text()
                    await anyio.sleep(0.05)
        finally:
            first.send_signal(stop)  # to this child only
            with anyio.fail_after(60):
                await first.wait()
        # Ended by serve's stop (SIGTERM), or by their inits when the lifeline ends.
        with anyio.fail_after(30):
            while marked(mark):
                await anyio.sleep(0.05)
        second = await start_serve(tmp_path, port, "second")
        try:
            notes = sorted(p.name for p in (tmp_path / "state" / "agents").iterdir())
            said = (tmp_path / "first.log").read_text() + (tmp_path / "second.log").read_text()
            assert len(notes) == 1, said  # the second's; a killed first's was found and removed
        finally:
            second.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                await second.wait()
    assert not (tmp_path / "state" / "agents").exists()  # nothing left to end
