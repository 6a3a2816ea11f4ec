"""CPU per policy turn against turn index: does building a request grow with the transcript?

    python benchmarks/policy_turn_cpu.py [--turns 30] [--screenshot-kb 100] [--repeat 5]

A computer_use rollout's transcript, as the rollout builds it (a prompt, then
per turn an assistant tool call, a tool answer and a screenshot of
``--screenshot-kb`` KB as a ``user`` image part), grows by one screenshot a
turn. At each turn index this measures, on the calling thread's CPU clock
(``time.thread_time``), median of ``--repeat`` fresh rollouts:

- **build, encoded once**: ``OpenAIChatPolicy._request`` over the
  transcript's messages, which keep each message's JSON (what rollouts do);
- **build, whole**: the same over a plain list, so the whole transcript is
  JSON-encoded again (what every turn cost before issue 15.4);
- **act**: one whole ``OpenAIChatPolicy.act`` (request built, sent through
  ``httpx.MockTransport``, the answer parsed), encoded once;
- **act, max_images=3**: the same with ``policy.max_images = 3``.

The request's size is given too: with every screenshot sent, the bytes on
the wire grow with the transcript whatever the encoding (a join of cached
bytes is a copy, not an encoding); ``max_images`` bounds that too.
Nothing here asserts: it measures.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import statistics
import time
from typing import Any

import anyio
import httpx

from fleetroll.policies import AssistantTurn, OpenAIChatPolicy, ToolCall, ToolSpec
from fleetroll.tasks import TaskSpec
from fleetroll.testing.fake_openai import completion, tool_call
from fleetroll.tools import ToolResult
from fleetroll.transcript import Transcript

TASK = TaskSpec(key="bench", prompt="Fill in the contact form.", env_key="desktop")
TOOLS = (
    ToolSpec(
        name="computer",
        description="Use the mouse and keyboard; every action answers a screenshot.",
        input_schema={
            "type": "object",
            "properties": {"action": {"type": "string"}, "x": {"type": "integer"}},
        },
    ),
)
ANSWER = completion(tool_calls=[tool_call("computer", {"action": "click", "x": 10}, id="c")])


def screenshot(kb: int) -> str:
    return "data:image/png;base64," + base64.b64encode(os.urandom(kb * 1024 * 3 // 4)).decode()


def policy() -> OpenAIChatPolicy:
    client = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, json=ANSWER))
    )
    return OpenAIChatPolicy(base_url="http://model.bench/v1", model="m", http_client=client)


def cpu_ms(work: Any) -> tuple[float, Any]:
    began = time.thread_time()
    value = work()
    return (time.thread_time() - began) * 1000, value


async def one_rollout(turns: int, kb: int, max_images: int | None) -> list[dict[str, float]]:
    """Per turn index: the CPU of each way of making the request, on a fresh transcript."""
    model = policy()
    transcript = Transcript(max_images=max_images)
    transcript.add_prompt(TASK.prompt)
    rows = []
    for turn in range(1, turns + 1):
        call = ToolCall(id=f"call_{turn}", name="computer", arguments={"action": "click"})
        transcript.add_turn(AssistantTurn(tool_calls=(call,)))
        transcript.add_answer(call, ToolResult(text="clicked", images=(screenshot(kb),)))
        row: dict[str, float] = {}
        if max_images is None:
            # Whole first: it leaves the per-message cache as it found it.
            row["whole"], _ = cpu_ms(lambda: model._request(list(transcript.messages), TOOLS))
            row["encoded"], _ = cpu_ms(lambda: model._request(transcript.messages, TOOLS))
            # The next act would find every message cached: measure a turn's real
            # work by dropping this turn's three messages from the cache first.
            for index in range(len(transcript.messages) - 3, len(transcript.messages)):
                transcript.messages._encoded.pop(index, None)
        began = time.thread_time()
        await model.act(TASK, transcript.messages, TOOLS)
        row["act"] = (time.thread_time() - began) * 1000
        row["bytes"] = len(model._request(transcript.messages, TOOLS))
        rows.append(row)
    await model.aclose()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--screenshot-kb", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    every = [await one_rollout(args.turns, args.screenshot_kb, None) for _ in range(args.repeat)]
    capped = [await one_rollout(args.turns, args.screenshot_kb, 3) for _ in range(args.repeat)]

    def median(runs: list[list[dict[str, float]]], turn: int, key: str) -> float:
        return statistics.median(run[turn][key] for run in runs)

    print(f"# {platform.python_version()} on {platform.machine()}, repeat {args.repeat}")
    print(
        "| turn | request (all images) | build, encoded once | build, whole | act |"
        " act, max_images=3 (request) |"
    )
    print("|---|---|---|---|---|---|")
    shown = sorted({1, 2, 5, 10, 15, 20, 25, args.turns} & set(range(1, args.turns + 1)))
    for turn in shown:
        i = turn - 1
        print(
            f"| {turn} | {median(every, i, 'bytes') / 1e6:.2f} MB"
            f" | {median(every, i, 'encoded'):.2f} ms | {median(every, i, 'whole'):.2f} ms"
            f" | {median(every, i, 'act'):.2f} ms"
            f" | {median(capped, i, 'act'):.2f} ms ({median(capped, i, 'bytes') / 1e6:.2f} MB) |"
        )
    print(json.dumps({"turns": args.turns, "screenshot_kb": args.screenshot_kb}))


if __name__ == "__main__":
    anyio.run(main)
