"""Images in trajectories: Qwen2-VL's resize rule, placeholder spans, and a
computer-use batch against a vision-language-shaped test server.

The slow test runs the emulator's desktop tasks (screenshots) with token-in
against :class:`~fleetroll.testing.model_server.ModelServer` in ``vision``
mode, which expands every image into ``<|image_pad|>`` tokens as a Qwen2-VL
processor does; each turn's image spans must match the server's prompt ids and
its images the pixels the server received.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from fleetroll.policies.images import image_spans, prepare_image, smart_resize


def png(width: int, height: int) -> bytes:
    image = Image.new("RGB", (width, height), (10, 200, 30))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_smart_resize_is_qwen2_vls_rule() -> None:
    reference = pytest.importorskip(
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
    ).smart_resize
    sizes = random.Random(0).sample(range(8, 4000), 60)
    for height, width in zip(sizes[::2], sizes[1::2], strict=True):
        for max_pixels in (28 * 28 * 16, 28 * 28 * 1280):
            got = smart_resize(height, width, max_pixels=max_pixels)
            assert got == reference(height, width, max_pixels=max_pixels), (height, width)


def test_a_prepared_image_is_resized_to_whole_28_pixel_blocks_within_max_pixels() -> None:
    image = prepare_image(png(1280, 800), max_pixels=28 * 28 * 64)
    assert image.width % 28 == 0 and image.height % 28 == 0
    assert image.width * image.height <= 28 * 28 * 64
    assert image.placeholders == (image.width // 28) * (image.height // 28)
    with Image.open(io.BytesIO(image.png)) as decoded:
        assert decoded.size == (image.width, image.height)
    # Prepared again, it stays as it is: the server's resize is then the identity.
    again = prepare_image(image.png, max_pixels=28 * 28 * 64)
    assert (again.width, again.height, again.png) == (image.width, image.height, image.png)
    with pytest.raises(ValueError, match="not an image"):
        prepare_image(b"not a png", max_pixels=28 * 28 * 64)


def test_image_spans_are_the_placeholder_runs_in_order_or_none() -> None:
    pad = 9
    ids = [1, 2, 8, pad, pad, pad, 7, 3, 8, pad, pad, 7, 4]
    assert image_spans(ids, [3, 2]) == [(3, 6), (9, 11)]
    assert image_spans(ids, [2, 3]) is None
    assert image_spans(ids, []) == []


# -- a computer-use batch against a vision-language-shaped server -------------------------


def solution_text(task: Any, body: dict[str, Any]) -> str:
    """The task's next step as a hermes tool call, by the turn number; "done"
    after two (three turns, two of them token-in, keep the test quick)."""
    steps = (task.solution or ())[:2]
    turn = sum(1 for m in body["messages"] if m.get("role") == "assistant")
    if turn >= len(steps):
        return "done"
    step = steps[turn]
    call = {"name": step.name, "arguments": dict(step.arguments)}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_computer_use_batch_keeps_token_in_and_each_image_with_its_exact_span(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import anyio

    from fleetroll.emulator import Emulator
    from fleetroll.policies import OpenAIChatPolicy
    from fleetroll.pool.assembly import chat_policy_config, fleet_provider, rollout_config
    from fleetroll.rollout.engine import RolloutEngine
    from fleetroll.rollout.machine import RolloutIds
    from fleetroll.settings import load_settings
    from fleetroll.telemetry import Events, MemorySink
    from fleetroll.testing.model_server import ForcedRequest, ModelServer
    from fleetroll.testing.tiny_model import TinyModelSpec, save_tiny_model
    from fleetroll.training.trajectory import training_rows
    from training_helpers import TASKS

    tasks = [t for t in TASKS.values() if t.modality == "computer_use"][:2]
    by_prompt = {t.prompt: t for t in tasks}

    def forced(request: ForcedRequest) -> str:
        body = request.body
        prompt = next(m["content"] for m in body["messages"] if m.get("role") == "user")
        return solution_text(by_prompt[prompt], body)

    max_pixels = 28 * 28 * 12
    path = save_tiny_model(tmp_path / "tiny-vl", TinyModelSpec(vision=True))
    results = []
    async with (
        Emulator() as emu,
        ModelServer(path, vision=True, image_max_pixels=max_pixels, forced=forced) as server,
    ):
        policy = {
            "kind": "openai",
            "base_url": server.base_url,
            "model": server.model_name,
            "trajectory": True,
            "token_in": True,
            "logprobs": True,
            "image_max_pixels": max_pixels,
        }
        settings = load_settings(policy=policy)
        events = Events([MemorySink()])
        provider = fleet_provider(settings, events, api_key=emu.api_key, base_url=emu.base_url)
        async with (
            RolloutEngine.open(rollout_config(settings), events, provider) as eng,
            OpenAIChatPolicy.from_config(chat_policy_config(settings)) as model,
        ):
            for i, task in enumerate(tasks):
                ids = RolloutIds(batch_id="b", rollout_id=f"r{i}", sample_index=i)
                with anyio.fail_after(300):
                    results.append(await eng.rollout(task, ids).run(model))
        requests = [(p, b) for p, b in server.requests if p.startswith("/v1/chat")]
        received = list(server.received_images)
        pad = server.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    assert all(r.status == "completed" and len(r.turns) == 3 for r in results), [
        r.error for r in results
    ]
    # Token-in stayed on: every call after a rollout's first went as token ids.
    paths = [p for p, _ in requests]
    assert paths.count("/v1/chat/completions/tokens") == len(requests) - len(results)
    seen = []
    for result in results:
        for turn in result.turns:
            assert turn.images and turn.training_data_error is None
            prompt = turn.prompt_token_ids or []
            runs = [i for i, t in enumerate(prompt) if t == pad]
            assert sorted(i for im in turn.images for i in range(im.start, im.end)) == runs
            for image in turn.images:
                assert set(prompt[image.start : image.end]) == {pad}
                assert prompt[image.start - 1] != pad and prompt[image.end] != pad
                assert image.end - image.start == (image.width // 28) * (image.height // 28)
                assert image.width * image.height <= max_pixels
            seen += turn.images
        trajectory = result.trajectory
        assert trajectory is not None and not trajectory.drift and trajectory.images
        assert trajectory.images == result.turns[-1].images
        for image in trajectory.images:
            assert set(trajectory.input_ids[image.start : image.end]) == {pad}
        (row,) = training_rows([[result]])
        assert row["images"] == [image.model_dump() for image in trajectory.images]
    # The images recorded are, pixel for pixel, those the server received (after
    # its own resize, which left them as they were).
    assert len(seen) == len(received)
    for image, got in zip(seen, received, strict=True):
        assert (image.width, image.height) == (got.width, got.height)
        with (
            Image.open(io.BytesIO(image.png())) as a,
            Image.open(io.BytesIO(got.png)) as b,
        ):
            assert a.tobytes() == b.tobytes()
    await journaled_as_files(tmp_path / "out" / "results.jsonl", results, received)


async def journaled_as_files(path: Path, results: list[Any], received: list[Any]) -> None:
    """``results`` through a journal with ``policy.image_store = "files"``: one
    file per distinct image, the lines without the bytes, and the images read
    back (rows, results) byte-equal to what the server received."""
    import anyio

    from fleetroll.pool.journal import Journal, images_folder, inline_images, read_journal
    from fleetroll.training.trajectory import row_images, training_rows

    async with anyio.create_task_group() as tg, Journal(path, tg, images="files") as journal:
        for result in results:
            journal.append(result)
    distinct = {got.sha256 for got in received}
    files = sorted(images_folder(path).iterdir())
    assert [f.name for f in files] == sorted(f"{sha}.png" for sha in distinct)
    read = read_journal(path)
    by_sha = {got.sha256: got.png for got in received}
    for result in read:
        for turn in result.turns:
            assert turn.images and all(image.data is None for image in turn.images)
            assert [image.png(path.parent) for image in turn.images] == [
                by_sha[image.sha256] for image in turn.images
            ]
        (row,) = training_rows([[result]])
        trajectory = result.trajectory
        assert trajectory is not None and trajectory.images
        assert row_images(row, journal=path) == [by_sha[i.sha256] for i in trajectory.images]
    assert [inline_images(r, path.parent) for r in read] == results


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_fleetroll_run_with_image_store_files_journals_each_distinct_image_once(
    tmp_path: Path,
) -> None:
    """``fleetroll run --out`` with ``policy.image_store = "files"`` (the job's
    journal takes the setting): the images beside the journal, the report's
    results with their bytes, the two the same once read back."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import anyio

    from fleetroll.jobs.job import run_job
    from fleetroll.policies import OpenAIChatPolicy
    from fleetroll.pool.assembly import chat_policy_config
    from fleetroll.pool.journal import images_folder, inline_images, read_journal
    from fleetroll.settings import load_settings
    from fleetroll.testing.model_server import ForcedRequest, ModelServer
    from fleetroll.testing.tiny_model import TinyModelSpec, save_tiny_model
    from training_helpers import TASKS

    tasks = [t for t in TASKS.values() if t.modality == "computer_use"][:2]
    by_prompt = {t.prompt: t for t in tasks}

    def forced(request: ForcedRequest) -> str:
        body = request.body
        prompt = next(m["content"] for m in body["messages"] if m.get("role") == "user")
        return solution_text(by_prompt[prompt], body)

    max_pixels = 28 * 28 * 12
    path = save_tiny_model(tmp_path / "tiny-vl", TinyModelSpec(vision=True))
    out = tmp_path / "run" / "results.jsonl"
    async with ModelServer(path, vision=True, image_max_pixels=max_pixels, forced=forced) as server:
        policy = {
            "kind": "openai",
            "base_url": server.base_url,
            "model": server.model_name,
            "trajectory": True,
            "token_in": True,
            "image_max_pixels": max_pixels,
            "image_store": "files",
        }
        settings = load_settings(policy=policy)
        async with OpenAIChatPolicy.from_config(chat_policy_config(settings)) as model:
            with anyio.fail_after(300):
                report = await run_job(settings, tasks, model, out=out)
        received = {image.sha256: image.png for image in server.received_images}

    assert all(r.status == "completed" and r.turns for r in report.results)
    assert sorted(f.name for f in images_folder(out).iterdir()) == sorted(
        f"{sha}.png" for sha in received
    )
    journaled = read_journal(out)
    for result in journaled:
        for turn in result.turns:
            assert turn.images and all(i.data is None and i.path for i in turn.images)
            assert all(i.png(out.parent) == received[i.sha256] for i in turn.images)
    by_id = {r.rollout_id: r for r in report.results}
    assert [inline_images(r, out.parent) for r in journaled] == [
        by_id[r.rollout_id] for r in journaled
    ]
