"""An agent of its own for ``fleetroll run --agent-command``: plain ``openai`` and ``mcp``.

fleetroll starts it once per rollout with (README, "Bring your own agent"):

- ``OPENAI_BASE_URL``/``OPENAI_API_KEY``: the rollout's gateway (the
  ``openai`` client reads both by itself);
- ``FLEETROLL_MCP_URL``: the instance's MCP endpoint (through fleetroll's relay);
- ``FLEETROLL_TASK_FILE``: the task (key, prompt, modality, metadata);
- ``FLEETROLL_ANSWER_FILE``: where to write the final answer.

It lists the tools, then loops: ask the model, run the tool calls it makes,
until it answers without one; that answer is written to the answer file.
``--stream`` asks for streamed completions. Run it by hand with those
variables set, or as ``fleetroll run TASKS --policy openai --agent-command
"python examples/agent_openai_mcp.py"``.
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


def openai_tool(tool: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.input_schema or {"type": "object", "properties": {}},
        },
    }


def tool_messages(call_id: str, result: Any) -> list[dict[str, Any]]:
    """A tool's answer as chat messages: its text, then its images in a user message."""
    texts = [part.text for part in result.content if getattr(part, "type", "") == "text"]
    images = [
        {"type": "image_url", "image_url": {"url": f"data:{part.mime_type};base64,{part.data}"}}
        for part in result.content
        if getattr(part, "type", "") == "image"
    ]
    messages: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": call_id, "content": "\n".join(texts)}
    ]
    if images:
        messages.append({"role": "user", "content": images})
    return messages


async def ask(model: AsyncOpenAI, name: str, messages: list[Any], tools: list[Any], stream: bool):
    """One completion as (content, tool_calls), streamed or not."""
    if not stream:
        answer = await model.chat.completions.create(model=name, messages=messages, tools=tools)
        message = answer.choices[0].message
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []
        ]
        return message.content, calls
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    chunks = await model.chat.completions.create(
        model=name, messages=messages, tools=tools, stream=True
    )
    async for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
    return ("".join(content) or None), [calls[i] for i in sorted(calls)]


async def main(stream: bool) -> None:
    with open(os.environ["FLEETROLL_TASK_FILE"]) as f:
        task = json.load(f)
    model = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: the rollout's gateway
    name = (await model.models.list()).data[0].id
    async with Client(os.environ["FLEETROLL_MCP_URL"]) as tools_client:
        tools = [openai_tool(t) for t in (await tools_client.list_tools()).tools]
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
        for _ in range(MAX_TURNS):
            content, calls = await ask(model, name, messages, tools, stream)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls
                ]
            messages.append(message)
            if not calls:
                with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
                    f.write(content or "")
                return
            for call in calls:
                arguments = json.loads(call["arguments"] or "{}")
                result = await tools_client.call_tool(call["name"], arguments)
                messages += tool_messages(call["id"], result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="ask for streamed completions")
    asyncio.run(main(parser.parse_args().stream))
