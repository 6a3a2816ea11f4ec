"""Bring your own agent: ``fleetroll run --agent-command`` with the example agent
(plain ``openai`` and ``mcp``), the emulator and a vLLM-shaped fake server, over real HTTP."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.journal import read_journal
from fleetroll.results import RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.testing.fake_openai import FakeChatServer, Reply, VllmShape, completion, tool_call

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASK_FILES = sorted((config_dir() / "tasks").glob("*.jsonl"))
TASKS = {t.key: t for f in TASK_FILES for t in load_tasks(f, modalities=SETTINGS.modalities)}
TOOL_USE = TASKS["ledger-010"]  # four steps, then "done"
COMPUTER_USE = next(
    t for t in TASKS.values() if t.modality == "computer_use" and len(t.solution or ()) >= 3
)
AGENT = Path(__file__).resolve().parents[1] / "examples" / "agent_openai_mcp.py"


def solving(tasks: list[TaskSpec]) -> Any:
    """A script that plays each task's solution (found by its prompt), then says done."""
    by_prompt = {t.prompt: [(s.name, dict(s.arguments)) for s in t.solution or ()] for t in tasks}

    def script(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        steps = by_prompt[prompt]
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if turn >= len(steps):
            return completion("done")
        name, arguments = steps[turn]
        return completion(tool_calls=[tool_call(name, arguments, id=f"call_{turn}")])

    return script


async def fleetroll_run(
    tmp_path: Path, tasks: list[TaskSpec], agent: tuple[str, ...] | None = None
) -> tuple[list[RolloutResult], list[dict[str, Any]], list[dict[str, Any]]]:
    """``fleetroll run`` of ``tasks``; with ``agent``, ``--agent-command`` running it.

    Returns the results, the server's replies and the requests it got.
    """
    task_file = tmp_path / "tasks.jsonl"
    lines = {
        json.loads(line)["key"]: line
        for f in TASK_FILES
        for line in f.read_text().splitlines()
        if line.strip()
    }
    task_file.write_text("".join(lines[t.key] + "\n" for t in tasks))
    out = tmp_path / ("built_in.jsonl" if agent is None else "agent.jsonl")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    async with FakeChatServer(solving(tasks), vllm=VllmShape()) as server:
        env |= {
            "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
            "FLEETROLL_POLICY__RETURN_TOKEN_IDS": "true",
            "FLEETROLL_POLICY__LOGPROBS": "true",
        }
        args = [sys.executable, "-m", "fleetroll", "run", str(task_file), "--out", str(out)]
        args += ["--policy", "openai", "--base-url", server.base_url, "--model", "served"]
        if agent is not None:
            args += ["--agent-command", " ".join([sys.executable, str(AGENT), *agent])]
        with anyio.fail_after(180):
            done = await anyio.run_process(args, cwd=tmp_path, env=env, check=False)
        replies, requests = list(server.replies), list(server.requests)
    assert done.returncode == 0, done.stderr.decode()
    return read_journal(out), replies, requests


def sent_by_server(replies: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[float]]:
    return {
        (tuple(r["prompt_token_ids"]), tuple(r["choices"][0]["token_ids"])): [
            e["logprob"] for e in r["choices"][0]["logprobs"]["content"]
        ]
        for r in replies
    }


def recorded(results: list[RolloutResult]) -> dict[tuple[Any, ...], list[float] | None]:
    return {
        (tuple(t.prompt_token_ids or ()), tuple(t.completion_token_ids or ())): t.logprobs
        for r in results
        for t in r.turns
    }


@pytest.mark.parametrize("streaming", [False, True], ids=["not_streaming", "streaming"])
async def test_the_example_agent_scores_every_task_as_the_built_in_loop_with_the_server_s_ids(
    tmp_path: Path, streaming: bool
) -> None:
    tasks = [TOOL_USE, COMPUTER_USE]
    built_in, _, _ = await fleetroll_run(tmp_path, tasks)
    flags = ("--stream",) if streaming else ()
    results, replies, requests = await fleetroll_run(tmp_path, tasks, flags)

    rewards = {r.task_key: (r.status, r.reward) for r in results}
    assert rewards == {r.task_key: (r.status, r.reward) for r in built_in}
    assert set(rewards.values()) == {("completed", 1.0)}
    # Every call the agent made is one turn holding exactly what the server sent.
    assert recorded(results) == sent_by_server(replies)
    assert sum(len(r.turns) for r in results) == len(replies) == len(requests)
    assert {t.model for r in results for t in r.turns} == {"served"}
    # The gateway asked for the training data the settings ask for, for the agent.
    assert all(q["return_token_ids"] and q["logprobs"] for q in requests)
    assert all("stream" not in q for q in requests)
