"""The policy path: CPU per policy turn against turn index.

Does building a request grow with the transcript? A computer_use rollout's
transcript, as the rollout builds it (a prompt, then per turn an assistant
tool call, a tool answer and a screenshot as a ``user`` image part), grows by
one screenshot a turn. At each turn index this measures, on the calling
thread's CPU clock (``time.thread_time``), median over fresh rollouts:

- **build, encoded once**: ``OpenAIChatPolicy._request`` over the
  transcript's messages, which keep each message's JSON (what rollouts do);
- **build, whole**: the same over a plain list, so the whole transcript is
  JSON-encoded again (what every turn cost before);
- **act**: one whole ``OpenAIChatPolicy.act`` (request built, sent through
  ``httpx.MockTransport``, the answer parsed), encoded once;
- **act, max_images=3**: the same with ``policy.max_images = 3``.

The request's size is given too: with every screenshot sent, the bytes on
the wire grow with the transcript whatever the encoding (a join of cached
bytes is a copy, not an encoding); ``max_images`` bounds that too. No
network and no emulator: the model's answers come from a mock transport.
"""

from __future__ import annotations

import base64
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx

from fleetroll.bench.records import PolicyTurnRecord, PolicyTurnRow
from fleetroll.policies import AssistantTurn, OpenAIChatPolicy, ToolCall, ToolSpec
from fleetroll.rollout.transcript import Transcript
from fleetroll.tasks import TaskSpec
from fleetroll.testing.fake_openai import completion, tool_call
from fleetroll.tools.session import ToolResult

__all__ = ["policy_turn_bench"]

_TASK = TaskSpec(key="bench", prompt="Fill in the contact form.", env_key="desktop")
_TOOLS = (
    ToolSpec(
        name="computer",
        description="Use the mouse and keyboard; every action answers a screenshot.",
        input_schema={
            "type": "object",
            "properties": {"action": {"type": "string"}, "x": {"type": "integer"}},
        },
    ),
)
_ANSWER = completion(tool_calls=[tool_call("computer", {"action": "click", "x": 10}, id="c")])
#: The screenshots ``max_images`` keeps in the capped run.
_CAPPED_IMAGES = 3


def _screenshot(kb: int) -> str:
    return "data:image/png;base64," + base64.b64encode(os.urandom(kb * 1024 * 3 // 4)).decode()


def _policy() -> OpenAIChatPolicy:
    client = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, json=_ANSWER))
    )
    return OpenAIChatPolicy(base_url="http://model.bench/v1", model="m", http_client=client)


def _cpu_ms(work: Callable[[], Any]) -> float:
    began = time.thread_time()
    work()
    return (time.thread_time() - began) * 1000


async def _one_rollout(turns: int, kb: int, max_images: int | None) -> list[dict[str, float]]:
    """Per turn index: the CPU of each way of making the request, on a fresh transcript."""
    model = _policy()
    transcript = Transcript(max_images=max_images)
    transcript.add_prompt(_TASK.prompt)
    rows = []
    try:
        for turn in range(1, turns + 1):
            call = ToolCall(id=f"call_{turn}", name="computer", arguments={"action": "click"})
            transcript.add_turn(AssistantTurn(tool_calls=(call,)))
            transcript.add_answer(call, ToolResult(text="clicked", images=(_screenshot(kb),)))
            row: dict[str, float] = {}
            messages = transcript.messages
            if max_images is None:
                # Whole first: it leaves the per-message cache as it found it.
                row["whole"] = _cpu_ms(partial(model._request, list(messages), _TOOLS))
                row["encoded"] = _cpu_ms(partial(model._request, messages, _TOOLS))
                # The next act would find every message cached: measure a turn's real
                # work by dropping this turn's three messages from the cache first.
                for index in range(len(messages) - 3, len(messages)):
                    messages._encoded.pop(index, None)
            began = time.thread_time()
            await model.act(_TASK, messages, _TOOLS)
            row["act"] = (time.thread_time() - began) * 1000
            row["bytes"] = len(model._request(messages, _TOOLS))
            rows.append(row)
    finally:
        await model.aclose()
    return rows


async def policy_turn_bench(*, turns: int, screenshot_kb: int, repeat: int) -> PolicyTurnRecord:
    """Median CPU per turn index over ``repeat`` fresh ``turns``-turn rollouts."""
    every = [await _one_rollout(turns, screenshot_kb, None) for _ in range(repeat)]
    capped = [await _one_rollout(turns, screenshot_kb, _CAPPED_IMAGES) for _ in range(repeat)]

    def median(runs: list[list[dict[str, float]]], i: int, key: str) -> float:
        return statistics.median(run[i][key] for run in runs)

    rows = [
        PolicyTurnRow(
            turn=i + 1,
            request_mb=median(every, i, "bytes") / 1e6,
            encoded_ms=median(every, i, "encoded"),
            whole_ms=median(every, i, "whole"),
            act_ms=median(every, i, "act"),
            capped_act_ms=median(capped, i, "act"),
            capped_request_mb=median(capped, i, "bytes") / 1e6,
        )
        for i in range(turns)
    ]
    return PolicyTurnRecord(turns=turns, screenshot_kb=screenshot_kb, repeat=repeat, rows=rows)
