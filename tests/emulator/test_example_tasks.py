"""Every shipped example task is well-formed, solvable and honest.

For each task in ``config/tasks/*.jsonl``, on a fresh emulator instance made
with the real SDK: the verifier scores 0.0 before anything is done, the
task's ``solution`` (sent through a real MCP client) brings it to 1.0, and a
task that needs a final answer scores 0.0 with a wrong one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fleet._async.client import AsyncFleet
from fleet._async.tasks import Task
from mcp import Client

from fleetroll.emulator import Emulator

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

TASKS_DIR = Path(__file__).parents[2] / "config" / "tasks"
MODALITIES = ("tool_use", "computer_use")
#: Handled by the orchestrator, never sent to an environment's MCP server.
FINAL_ANSWER_TOOL = "submit_final_answer"
TASK_TIMEOUT_S = 60.0
#: What a malformed task line raises while it is read.
MALFORMED = (ValueError, KeyError, TypeError, AttributeError)


@dataclass(frozen=True, slots=True)
class Line:
    path: Path
    number: int
    text: str

    def __str__(self) -> str:
        return f"{self.path.name}:{self.number}"


@dataclass(frozen=True, slots=True)
class ExampleTask:
    """A task line, in either of the accepted spellings, reduced to what we run."""

    key: str
    prompt: str
    env_id: str
    version: str
    data_key: str | None
    modality: str
    verifier_func: str
    solution: list[dict[str, Any]]
    requires_final_answer: bool

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> ExampleTask:
        """Reads Fleet's export format or the short form (``env_key``, ``data_key``).

        Raises:
            KeyError, ValueError: when a required field is missing or malformed.
        """
        if "env_key" in raw:
            env_id, _, version = raw["env_key"].partition(":")
        else:
            env_id, version = raw["env_id"], raw["version"]
        data_key = raw.get("data_key")
        if data_key is None and raw.get("data_id"):
            data_key = f"{raw['data_id']}:{raw.get('data_version') or 'v1'}"
        metadata = raw.get("metadata") or {}
        modality = raw.get("modality") or metadata["task_modality"]
        task = cls(
            key=raw["key"],
            prompt=raw["prompt"],
            env_id=env_id,
            version=version,
            data_key=data_key,
            modality=modality,
            verifier_func=raw["verifier_func"],
            solution=raw["solution"],
            requires_final_answer=bool(metadata.get("requires_final_answer", False)),
        )
        for name in ("key", "prompt", "env_id", "version", "verifier_func"):
            value = getattr(task, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if modality not in MODALITIES:
            raise ValueError(f"unknown modality {modality!r}")
        if not isinstance(task.solution, list) or not task.solution:
            raise ValueError("solution must be a non-empty list of tool calls")
        for call in task.solution:
            if not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
                raise ValueError(f"a solution call needs a name and an arguments object: {call}")
        return task

    @property
    def final_answer(self) -> str | None:
        answers = [
            c["arguments"]["answer"] for c in self.solution if c["name"] == FINAL_ANSWER_TOOL
        ]
        return answers[-1] if answers else None

    def fleet_task(self) -> Task:
        return Task(
            key=self.key,
            prompt=self.prompt,
            env_id=self.env_id,
            version=self.version,
            verifier_func=self.verifier_func,
        )


def task_lines() -> list[Line]:
    return [
        Line(path, number, text)
        for path in sorted(TASKS_DIR.glob("*.jsonl"))
        for number, text in enumerate(path.read_text().splitlines(), start=1)
        if text.strip()
    ]


def runnable_tasks() -> list[ExampleTask]:
    """The tasks that parse; the format test reports the ones that don't."""
    tasks = []
    for line in task_lines():
        try:
            tasks.append(ExampleTask.parse(json.loads(line.text)))
        except MALFORMED:
            continue
    return tasks


TASKS = runnable_tasks()


@pytest.fixture(scope="module")
async def fleet(emulator: Emulator) -> AsyncIterator[AsyncFleet]:
    # The SDK never closes the HTTP client it makes, so it gets ours.
    async with httpx.AsyncClient(timeout=TASK_TIMEOUT_S) as client:
        yield AsyncFleet(
            api_key=emulator.api_key,
            base_url=emulator.base_url,
            max_retries=0,
            httpx_client=client,
        )


def test_every_task_line_parses_with_the_required_fields_and_a_unique_key() -> None:
    lines = task_lines()
    assert lines, f"no example tasks in {TASKS_DIR}"
    keys: dict[str, Line] = {}
    for line in lines:
        try:
            raw = json.loads(line.text)
            assert isinstance(raw, dict), "a task line must be a JSON object"
            task = ExampleTask.parse(raw)
            compile(task.verifier_func, task.key, "exec")
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            SyntaxError,
            AssertionError,
        ) as exc:
            pytest.fail(f"{line}: {type(exc).__name__}: {exc}")
        assert task.key not in keys, f"{line}: key {task.key!r} is also on {keys[task.key]}"
        keys[task.key] = line
        answer_calls = [c for c in task.solution if c["name"] == FINAL_ANSWER_TOOL]
        if task.requires_final_answer:
            assert task.solution[-1]["name"] == FINAL_ANSWER_TOOL, f"{line}: no final answer"
            assert isinstance(task.final_answer, str), f"{line}: the answer must be a string"
        else:
            assert not answer_calls, f"{line}: a final answer the task does not ask for"


@pytest.mark.parametrize("task", TASKS, ids=[task.key for task in TASKS])
async def test_the_task_scores_zero_when_fresh_and_one_after_its_solution(
    task: ExampleTask, emulator: Emulator, fleet: AsyncFleet
) -> None:
    computer_use = task.modality == "computer_use"
    verifier = task.fleet_task()
    with anyio.fail_after(TASK_TIMEOUT_S):
        env = await fleet.make(
            f"{task.env_id}:{task.version}",
            data_key=task.data_key,
            image_type="mcp" if computer_use else None,
        )
        try:
            fresh = await verifier.verify_detailed_async(env, final_answer=None)
            assert fresh.success, fresh.error
            assert fresh.result == 0.0, "the verifier passes before any work is done"

            url = f"{env.urls.root}api/v1/mcp" if computer_use else env.mcp.url
            async with Client(url) as session:
                for call in task.solution:
                    if call["name"] == FINAL_ANSWER_TOOL:
                        continue
                    result = await session.call_tool(call["name"], call["arguments"])
                    assert not result.is_error, f"{call['name']} failed: {result.content}"

            solved = await verifier.verify_detailed_async(env, final_answer=task.final_answer)
            assert solved.success, solved.error
            assert solved.result == 1.0, f"the solution does not solve it: {solved.stdout}"
            if task.requires_final_answer:
                wrong = await verifier.verify_detailed_async(env, final_answer="0")
                assert wrong.success, wrong.error
                assert wrong.result == 0.0, "a wrong final answer passes"
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(TASK_TIMEOUT_S):
                await env.close()
    assert emulator.ledger.running == 0
