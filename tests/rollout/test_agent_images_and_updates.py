"""An agent command's model calls through the gateway, on a real tiny model
behind :class:`~fleetroll.testing.model_server.ModelServer`: its images are
resized and recorded with their placeholder spans as the built-in loop's, and
under ``policy.weight_update = "abort"`` its aborted call is resumed on the new
weights, its turn carrying each token's version. Skipped without the ``train``
extra (torch, transformers).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from PIL import Image

from fleetroll.emulator import Emulator
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.rollout.agent_command import CommandAgent
from fleetroll.settings import load_settings
from fleetroll.testing.model_server import ModelServer
from fleetroll.testing.tiny_model import TinyModelSpec, save_tiny_model
from training_helpers import TASKS

pytestmark = pytest.mark.slow

#: One chat completion through the gateway (not streamed), its user message
#: holding the image of argv[1] (a PNG file) when given; the answer's text and
#: ending are the final answer.
ONE_CALL = """
import base64, json, os, sys, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
content = [{"type": "text", "text": "What is on the screen?"}]
if len(sys.argv) > 1:
    with open(sys.argv[1], "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    content.append({"type": "image_url", "image_url": {"url": url}})
body = {"model": "any", "max_tokens": 32, "messages": [{"role": "user", "content": content}]}
request = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(), {
    "Authorization": "Bearer " + key, "Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=120))
choice = answer["choices"][0]
with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
    json.dump({"content": choice["message"]["content"], "finish": choice["finish_reason"],
               "token_ids": choice.get("token_ids")}, f)
"""


#: Two chat completions through the gateway (not streamed), each user message
#: with a screenshot (argv[1], then argv[2]); the second continues the first
#: (its answer sent back as it came), as an agent that keeps its history does.
TWO_CALLS = """
import base64, json, os, sys, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]

def shot(path, text):
    with open(path, "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url}}]}

def call(messages):
    body = {"model": "any", "max_tokens": 8, "messages": messages}
    request = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(), {
        "Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["message"]

messages = [shot(sys.argv[1], "What is on the screen?")]
messages.append(call(messages))
messages.append(shot(sys.argv[2], "And now?"))
last = call(messages)
with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
    f.write(last.get("content") or "")
"""


def png(width: int, height: int) -> bytes:
    image = Image.new("RGB", (width, height), (10, 200, 30))
    for x in range(0, width, 7):
        image.putpixel((x, x % height), (250, 0, 0))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def run_agent(
    server: ModelServer, policy: dict[str, Any], argv: list[str], *, update: Path | None = None
) -> RolloutResult:
    """One ledger task run by the agent ``argv``; with ``update``, the weights are
    updated (``pool.policy_paused()``, the new version 1) a few tokens into its call."""
    task = TASKS["ledger-001"]
    base = {"kind": "openai", "base_url": server.base_url, "model": server.model_name}
    settings = load_settings(policy={**base, "return_token_ids": True, "logprobs": True, **policy})
    async with (
        Emulator() as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
        CommandAgent.from_config(argv, chat_policy_config(settings)) as agent,
    ):
        with anyio.fail_after(240):
            batch = pool.run_batch([task], agent)
            if update is not None:
                while not any(p == "/v1/chat/completions" for p, _ in server.requests):
                    await anyio.sleep(0.01)
                await anyio.sleep(8 * 0.03)  # a few tokens into the generation
                async with pool.policy_paused():
                    await server.update_weights(update)
                    await pool.set_policy_version(1)
            (result,) = await batch.results()
    return result


async def test_an_agent_s_images_keep_token_in_and_are_recorded_with_their_spans(
    tmp_path: Path,
) -> None:
    max_pixels = 28 * 28 * 12
    shots = [tmp_path / "one.png", tmp_path / "two.png"]
    shots[0].write_bytes(png(300, 200))
    shots[1].write_bytes(png(200, 300))
    model = save_tiny_model(tmp_path / "tiny-vl", TinyModelSpec(vision=True))
    async with ModelServer(model, vision=True, image_max_pixels=max_pixels) as server:
        policy = {"image_max_pixels": max_pixels, "trajectory": True, "token_in": True}
        argv = [sys.executable, "-c", TWO_CALLS, *map(str, shots)]
        result = await run_agent(server, policy, argv)
        paths = [p for p, _ in server.requests if p.startswith("/v1/chat")]
        received = list(server.received_images)
        pad = server.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    assert result.status == "completed", result.error
    # Token-in kept: the second call, continuing the first, went as token ids.
    assert paths == ["/v1/chat/completions", "/v1/chat/completions/tokens"]
    first, second = result.turns
    assert [len(t.images or ()) for t in result.turns] == [1, 2]
    for turn in result.turns:
        assert turn.training_data_error is None and turn.images is not None
        prompt = turn.prompt_token_ids or []
        runs = [i for i, t in enumerate(prompt) if t == pad]
        assert sorted(i for im in turn.images for i in range(im.start, im.end)) == runs
        for image in turn.images:
            # Resized by Qwen2-VL's rule before the server saw it.
            assert image.width * image.height <= max_pixels < 300 * 200
            assert image.end - image.start == (image.width // 28) * (image.height // 28)
    # The very PNGs the server received, in order (the first call's, then the second's).
    seen = [image for turn in result.turns for image in turn.images or ()]
    assert [image.png() for image in seen] == [got.png for got in received]
    assert second.prompt_token_ids[: len(first.prompt_token_ids or [])] == first.prompt_token_ids  # type: ignore[index]
    trajectory = result.trajectory
    assert trajectory is not None and not trajectory.drift and trajectory.images == second.images


async def test_an_agent_s_aborted_call_is_resumed_and_its_tokens_carry_their_versions(
    tmp_path: Path,
) -> None:
    model = save_tiny_model(tmp_path / "tiny", seed=0)
    step = save_tiny_model(tmp_path / "step-1", seed=1)  # the same shape, other weights
    server = ModelServer(model, decode_delay_s=0.03)
    async with server:
        policy = {"weight_update": "abort", "temperature": 1.0}
        result = await run_agent(server, policy, [sys.executable, "-c", ONE_CALL], update=step)
        paths = [p for p, _ in server.requests]
        aborted = server.aborted

    assert result.status == "completed", result.error
    (turn,) = result.turns
    ids, versions = turn.completion_token_ids or [], turn.token_versions or []
    assert aborted == 1 and paths.count("/v1/chat/completions/tokens") == 1
    assert len(versions) == len(ids) == len(turn.logprobs or []) > 0
    # Begun on version 0, aborted by the update, resumed on version 1.
    assert versions[0] == 0 and versions[-1] == 1 and sorted(versions) == versions
    assert "aborted after" in (turn.token_versions_note or "")
    # The agent got the joined answer, never the aborted part.
    answer = json.loads(result.final_answer or "{}")
    assert answer["finish"] != "abort"
    assert answer["token_ids"] == ids
