"""A Claude-style agent for ``fleetroll run --agent-command``: plain ``anthropic`` and ``mcp``.

fleetroll starts it once per rollout with (README, "Bring your own agent"):

- ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``: the rollout's gateway, which
  serves Anthropic's Messages API (the ``anthropic`` client reads both by
  itself) by translating each call to the policy server's chat route;
- ``FLEETROLL_MCP_URL``: the instance's MCP endpoint (through fleetroll's relay);
- ``FLEETROLL_TASK_FILE``: the task (key, prompt, modality, metadata);
- ``FLEETROLL_ANSWER_FILE``: where to write the final answer.

It lists the tools, then loops: ask the model (``messages.create`` with the
tools), run the ``tool_use`` blocks it answers, send their ``tool_result``
blocks back, until it stops without one; its text is written to the answer
file. ``--stream`` asks for streamed messages (``messages.stream``). Run it as
``fleetroll run TASKS --policy openai --agent-command "python
examples/agent_anthropic_mcp.py"``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from anthropic import AsyncAnthropic
from mcp import Client

MAX_TURNS = 50
MAX_TOKENS = 1024
#: Any name: the gateway asks the policy's model.
MODEL = "policy"


def anthropic_tool(tool: Any) -> dict[str, Any]:
    return {
        "name": tool.name,
        "description": tool.description or "",
        "input_schema": tool.input_schema or {"type": "object", "properties": {}},
    }


def tool_result(call_id: str, result: Any) -> dict[str, Any]:
    """A tool's answer as a ``tool_result`` block: its text and its images."""
    content: list[dict[str, Any]] = []
    for part in result.content:
        kind = getattr(part, "type", "")
        if kind == "text":
            content.append({"type": "text", "text": part.text})
        elif kind == "image":
            source = {"type": "base64", "media_type": part.mime_type, "data": part.data}
            content.append({"type": "image", "source": source})
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id, "content": content}
    if getattr(result, "is_error", False):
        block["is_error"] = True
    return block


async def ask(model: AsyncAnthropic, messages: list[Any], tools: list[Any], stream: bool) -> Any:
    """One message, streamed or not."""
    if not stream:
        return await model.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, messages=messages, tools=tools
        )
    async with model.messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, messages=messages, tools=tools
    ) as events:
        return await events.get_final_message()


async def main(stream: bool) -> None:
    with open(os.environ["FLEETROLL_TASK_FILE"]) as f:
        task = json.load(f)
    model = AsyncAnthropic()  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY: the rollout's gateway
    async with Client(os.environ["FLEETROLL_MCP_URL"]) as tools_client:
        tools = [anthropic_tool(t) for t in (await tools_client.list_tools()).tools]
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
        for _ in range(MAX_TURNS):
            message = await ask(model, messages, tools, stream)
            content = [block.model_dump(exclude_none=True) for block in message.content]
            messages.append({"role": "assistant", "content": content})
            calls = [block for block in message.content if block.type == "tool_use"]
            if not calls:
                text = "".join(block.text for block in message.content if block.type == "text")
                with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
                    f.write(text)
                return
            results = [
                tool_result(call.id, await tools_client.call_tool(call.name, call.input))
                for call in calls
            ]
            messages.append({"role": "user", "content": results})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="ask for streamed messages")
    asyncio.run(main(parser.parse_args().stream))
