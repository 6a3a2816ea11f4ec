"""Weight updates in the middle of generations (``policy.weight_update``), on a
real tiny model behind :class:`~fleetroll.testing.model_server.ModelServer`,
rollouts on the emulator: every kept token's recorded version is the weights
that produced it (each token's logprob recomputed under that version's
weights), no rollout lost or run twice, no sampled token thrown away.
Skipped without the ``train`` extra (torch, transformers).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fleetroll.emulator import Emulator  # noqa: E402
from fleetroll.policies import OpenAIChatPolicy  # noqa: E402
from fleetroll.pool.assembly import chat_policy_config  # noqa: E402
from fleetroll.pool.rollout_pool import RolloutPool  # noqa: E402
from fleetroll.results import RolloutResult  # noqa: E402
from fleetroll.settings import load_settings  # noqa: E402
from fleetroll.telemetry import Events, MemorySink  # noqa: E402
from fleetroll.testing.model_server import ForcedRequest, ModelServer  # noqa: E402
from fleetroll.testing.tiny_model import load_tiny_model, save_tiny_model  # noqa: E402
from fleetroll.training.trajectory import training_rows  # noqa: E402
from fleetroll.training.weight_sync import SGLangDiskSync, sync_weights  # noqa: E402
from training_helpers import TASKS  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="module")
def perturbed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a fake optimizer step: every weight moved a little."""
    model, tokenizer = load_tiny_model(model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    path = tmp_path_factory.mktemp("step") / "step-1"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def recomputed(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """Each completion token's raw logprob under ``model``: one forward pass."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)
    return [float(raw[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def starts(ids: list[int], prefix: list[int]) -> bool:
    return bool(prefix) and ids[: len(prefix)] == prefix


async def run_with_an_update(
    model_dir: Path, perturbed: Path, mode: str, trigger: str
) -> tuple[list[RolloutResult], ModelServer, int]:
    """Three rollouts; once the server is a few tokens into the first
    generation, the weights are updated under ``mode``: by ``sync_weights``, or
    (``trigger="pool"``) as a trainer that pushes its own weights does, inside
    ``pool.policy_paused()`` then ``set_policy_version``."""
    tasks = [t for t in TASKS.values() if t.env_key == "ledger"][:3]
    server = ModelServer(model_dir, in_flight_updates=mode == "in_flight", decode_delay_s=0.03)
    async with server, Emulator() as emu:
        settings = load_settings(
            provisioning={"creates_per_second": 1000, "max_concurrent_creates": 16},
            policy={
                "kind": "openai",
                "base_url": server.base_url,
                "model": server.model_name,
                "max_tokens": MAX_TOKENS,
                "return_token_ids": True,
                "logprobs": True,
                "temperature": 1.0,
                "trajectory": True,
                "weight_update": mode,
            },
        )
        pool = RolloutPool(
            settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([MemorySink()])
        )
        async with pool, OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy:
            with anyio.fail_after(180):
                batch = pool.run_batch(tasks, policy)
                while not any(p.endswith("/chat/completions") for p, _ in server.requests):
                    await anyio.sleep(0.01)
                await anyio.sleep(8 * 0.03)  # a few tokens into the first generation
                if trigger == "sync_weights":
                    sync = SGLangDiskSync(server.base_url)
                    assert await sync_weights(pool, sync, perturbed) == 1
                else:
                    async with pool.policy_paused():
                        await server.update_weights(perturbed)
                        await pool.set_policy_version(1)
                results = await batch.results()
        assert emu.ledger.running == 0
        created = emu.ledger.created
    assert server.version == 1
    return results, server, created


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("mode", "trigger"),
    [
        ("abort", "sync_weights"),
        ("abort", "pool"),
        ("in_flight", "sync_weights"),
        ("in_flight", "pool"),
        ("pause", "sync_weights"),
    ],
)
async def test_every_kept_token_carries_the_version_of_the_weights_that_produced_it(
    model_dir: Path, perturbed: Path, mode: str, trigger: str
) -> None:
    models = {0: load_tiny_model(model_dir)[0], 1: load_tiny_model(perturbed)[0]}
    results, server, created = await run_with_an_update(model_dir, perturbed, mode, trigger)

    # No rollout lost or run twice: one result and one instance per task, each
    # turn one first request (an aborted one resumes on the token route).
    assert len(results) == len({r.task_key for r in results}) == 3 == created
    turns = [turn for r in results for turn in r.turns]
    first_requests = [b for p, b in server.requests if p == "/v1/chat/completions"]
    assert len(first_requests) == len(turns)

    straddling = 0
    for turn in turns:
        prompt, ids = turn.prompt_token_ids or [], turn.completion_token_ids or []
        versions, logprobs = turn.token_versions, turn.logprobs
        assert prompt and ids and logprobs and versions is not None, turn
        assert len(versions) == len(ids) == len(logprobs)
        assert None not in versions  # the test server reports every token's version
        for version in set(versions):
            expected = recomputed(models[version], prompt, ids)  # type: ignore[index]
            for got, want, v in zip(logprobs, expected, versions, strict=True):
                if v == version:
                    assert got == pytest.approx(want, abs=1e-4)
        straddling += len(set(versions)) > 1
        if mode == "pause":  # today's behaviour: a call keeps the weights it started on
            assert versions == [turn.policy_version] * len(ids)
    if mode == "pause":
        assert straddling == 0 and server.aborted == 0
    else:
        assert straddling >= 1  # the update did land in the middle of a generation

    if mode == "abort":
        # No sampled token thrown away: every token an aborted generation made
        # went back to the server as part of a resumed prompt, and is in its turn.
        resumed = [b for p, b in server.requests if p == "/v1/chat/completions/tokens"]
        assert server.aborted >= 1 and len(resumed) == server.aborted
        kept = 0
        for body in resumed:
            turn = next(
                t
                for t in turns
                if body["tokens"][: len(t.prompt_token_ids or [])] == t.prompt_token_ids
            )
            prompt = turn.prompt_token_ids or []
            tail = body["tokens"][len(prompt) :]
            assert (turn.completion_token_ids or [])[: len(tail)] == tail
            assert (turn.token_versions or [])[: len(tail)] == [0] * len(tail)
            kept += len(tail)
        assert kept == server.aborted_tokens > 0
        assert any("aborted after" in (t.token_versions_note or "") for t in turns)

    # Trajectories and rows carry the versions per token.
    for result in results:
        assert result.trajectory is not None
        generated = [
            v
            for v, m in zip(
                result.trajectory.token_versions, result.trajectory.loss_mask, strict=True
            )
            if m
        ]
        assert generated == [v for t in result.turns for v in t.token_versions or []]
    rows = training_rows([results])
    for row in rows:
        assert len(row["token_versions"]) == len(row["input_ids"])


async def test_a_client_that_goes_away_aborts_its_generation(model_dir: Path) -> None:
    """vLLM's abort on disconnect: the test server stops generating for a
    client that closed its connection."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 200,
        "temperature": 1.0,
    }
    async with ModelServer(model_dir, decode_delay_s=0.02) as server:
        async with httpx.AsyncClient(timeout=60) as client:
            with anyio.move_on_after(0.5):
                await client.post(f"{server.base_url}/chat/completions", json=body)
        with anyio.fail_after(30):
            while not server.aborted:
                await anyio.sleep(0.05)
        assert 0 < server.aborted_tokens < 200


async def test_an_aborted_completion_resumes_on_v1_completions_its_cut_tool_call_parsed_whole(
    model_dir: Path,
) -> None:
    """``token_in = "completions"`` with ``weight_update = "abort"``: the aborted
    part's ids go back as the resumed ``/v1/completions`` prompt, and a tool
    call the abort cut in two is parsed from the joined text."""
    call = '<tool_call>\n{"name": "list_accounts", "arguments": {"kind": "checking"}}\n</tool_call>'
    first: list[int] = []

    def forced(request: ForcedRequest) -> str:
        if not first:  # the first generation: aborted a few tokens in
            first.extend(request.prompt_ids)
            threading.Timer(0.3, server.abort_all).start()
            return call
        done = server.tokenizer.decode(list(request.prompt_ids[len(first) :]))
        assert call.startswith(done)
        return call[len(done) :]

    server = ModelServer(model_dir, token_route=False, decode_delay_s=0.1, forced=forced)
    async with (
        server,
        OpenAIChatPolicy(
            base_url=server.base_url,
            model=server.model_name,
            token_in="completions",
            tokenizer=str(model_dir),
            max_tokens=MAX_TOKENS * 4,
            weight_update="abort",
        ) as policy,
    ):
        with anyio.fail_after(120):
            turn = await policy.act(TASKS["ledger-010"], [{"role": "user", "content": "hi"}], [])

    sent = [body for path, body in server.requests if path == "/v1/completions"]
    (_, aborted), (_, resumed) = server.generations
    assert aborted.finish_reason == "abort" and aborted.token_ids
    assert len(sent) == 2 and sent[1]["prompt"] == [*first, *aborted.token_ids]
    assert turn.data is not None
    assert turn.data.prompt_token_ids == tuple(first)
    assert turn.data.completion_token_ids == aborted.token_ids + resumed.token_ids
    assert turn.data.token_versions == (0,) * len(turn.data.completion_token_ids)
    assert turn.data.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("list_accounts", {"kind": "checking"})
    ]
