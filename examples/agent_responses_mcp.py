"""A Codex-style agent for ``fleetroll run --agent-command``: plain ``openai`` (its
Responses API) and ``mcp``.

fleetroll starts it once per rollout with (README, "Bring your own agent"):

- ``OPENAI_BASE_URL``/``OPENAI_API_KEY``: the rollout's gateway, which serves
  OpenAI's Responses API (``/responses``; the ``openai`` client reads both by
  itself) by translating each call to the policy server's chat route;
- ``FLEETROLL_MCP_URL``: the instance's MCP endpoint (through fleetroll's relay);
- ``FLEETROLL_TASK_FILE``: the task (key, prompt, modality, metadata);
- ``FLEETROLL_ANSWER_FILE``: where to write the final answer.

It lists the tools, then loops: ask the model (``responses.create`` with the
tools and ``store=False``, the whole conversation as ``input`` each time), run
the ``function_call`` items it answers, send their ``function_call_output``
items back, until it answers without one; its text is written to the answer
file. ``--stream`` asks for streamed responses (``stream=True``; the events'
``response.completed`` carries the whole response). Run it as ``fleetroll run
TASKS --policy openai --agent-command "python examples/agent_responses_mcp.py"``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from mcp import Client
from openai import AsyncOpenAI

MAX_TURNS = 50
MAX_OUTPUT_TOKENS = 1024
#: Any name: the gateway asks the policy's model.
MODEL = "policy"
INSTRUCTIONS = "You solve the task with the tools you are given, then answer briefly."


def function_tool(tool: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description or "",
        "parameters": tool.input_schema or {"type": "object", "properties": {}},
        "strict": False,
    }


def call_output(call_id: str, result: Any) -> dict[str, Any]:
    """A tool's answer as a ``function_call_output`` item: its text and its images."""
    output: list[dict[str, Any]] = []
    for part in result.content:
        kind = getattr(part, "type", "")
        if kind == "text":
            output.append({"type": "input_text", "text": part.text})
        elif kind == "image":
            url = f"data:{part.mime_type};base64,{part.data}"
            output.append({"type": "input_image", "image_url": url})
    return {"type": "function_call_output", "call_id": call_id, "output": output}


async def ask(model: AsyncOpenAI, items: list[Any], tools: list[Any], stream: bool) -> Any:
    """One response, streamed or not."""
    asked: dict[str, Any] = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": items,
        "tools": tools,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "store": False,
    }
    if not stream:
        return await model.responses.create(**asked)
    final = None
    async for event in await model.responses.create(**asked, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    if final is None:
        raise RuntimeError("the stream ended without a response")
    return final


async def main(stream: bool) -> None:
    with open(os.environ["FLEETROLL_TASK_FILE"]) as f:
        task = json.load(f)
    model = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: the rollout's gateway
    async with Client(os.environ["FLEETROLL_MCP_URL"]) as tools_client:
        tools = [function_tool(t) for t in (await tools_client.list_tools()).tools]
        items: list[Any] = [{"role": "user", "content": task["prompt"]}]
        for _ in range(MAX_TURNS):
            response = await ask(model, items, tools, stream)
            items += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
                    f.write(response.output_text)
                return
            for call in calls:
                result = await tools_client.call_tool(call.name, json.loads(call.arguments or "{}"))
                items.append(call_output(call.call_id, result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="ask for streamed responses")
    asyncio.run(main(parser.parse_args().stream))
