"""What the training-data tests share: the shipped tasks, a server script that
solves them, the example agent, and what a server sent against what results hold."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetroll.results import RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.testing.fake_openai import Reply, completion, tool_call

TASK_FILES = sorted((config_dir() / "tasks").glob("*.jsonl"))
TASKS = {t.key: t for f in TASK_FILES for t in load_tasks(f, modalities=load_settings().modalities)}
#: The example agent (plain ``openai`` and ``mcp``, not fleetroll's loop).
AGENT = Path(__file__).resolve().parents[1] / "examples" / "agent_openai_mcp.py"


def solving(tasks: Sequence[TaskSpec]) -> Any:
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


def sent_and_recorded(
    replies: Sequence[dict[str, Any]], results: Sequence[RolloutResult]
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The token ids and logprobs the server sent, and those the results' turns hold."""
    sent = {
        (tuple(r["prompt_token_ids"]), tuple(r["choices"][0]["token_ids"])): [
            e["logprob"] for e in r["choices"][0]["logprobs"]["content"]
        ]
        for r in replies
    }
    recorded = {
        (tuple(t.prompt_token_ids or ()), tuple(t.completion_token_ids or ())): t.logprobs
        for r in results
        for t in r.turns
    }
    return sent, recorded
