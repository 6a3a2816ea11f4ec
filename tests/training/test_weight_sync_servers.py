"""Weight sync onto real model servers: two vLLM-shaped
servers (:class:`~fleetroll.testing.model_server.ModelServer`) of the tiny model, which
load the directory pushed; each test recomputes with the saved weights what
the servers must answer, and the last runs rollouts on the emulator around a
sync. Skipped without the ``train`` extra (torch, transformers).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fleetroll.client import FleetrollClient  # noqa: E402
from fleetroll.emulator import Emulator  # noqa: E402
from fleetroll.emulator.process import EmulatorProcess  # noqa: E402
from fleetroll.errors import WeightSyncError  # noqa: E402
from fleetroll.policies import OpenAIChatPolicy  # noqa: E402
from fleetroll.pool.assembly import chat_policy_config  # noqa: E402
from fleetroll.pool.rollout_pool import RolloutPool  # noqa: E402
from fleetroll.service import Service, create_app, serve_app  # noqa: E402
from fleetroll.settings import load_settings  # noqa: E402
from fleetroll.settings.sections import Budget  # noqa: E402
from fleetroll.telemetry import Events, MemorySink  # noqa: E402
from fleetroll.testing.model_server import ModelServer  # noqa: E402
from fleetroll.testing.tiny_model import load_tiny_model, save_tiny_model  # noqa: E402
from fleetroll.training.weight_sync import (  # noqa: E402
    SGLangDiskSync,
    VLLMReloadSync,
    sync_weights,
)
from gate_watch import paused_arrival  # noqa: E402
from training_helpers import TASKS  # noqa: E402

#: Integration tests (real servers, the emulator over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

FAST = Budget(attempts=3, backoff_initial_s=0.01, backoff_max_s=0.02)
SECRET = "sk-weights-secret-4242"

MESSAGES = [{"role": "user", "content": "What is the balance of account acme-001?"}]


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
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)
    return [float(raw[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


async def greedy(client: httpx.AsyncClient, server: ModelServer) -> dict[str, Any]:
    body = {
        "model": server.model_name,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    answer = await client.post(f"{server.base_url}/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return {
        "version": answer.headers["x-weight-version"],
        "prompt": answer.json()["prompt_token_ids"],
        "ids": choice["token_ids"],
        "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
    }


@asynccontextmanager
async def two_servers(model_dir: Path, **options: Any) -> AsyncIterator[list[ModelServer]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(ModelServer(model_dir, **options)) for _ in "ab"]


@pytest.mark.parametrize("kind", [SGLangDiskSync, VLLMReloadSync])
async def test_both_servers_take_the_saved_weights_and_answer_their_exact_logprobs(
    model_dir: Path, perturbed: Path, kind: type[SGLangDiskSync | VLLMReloadSync]
) -> None:
    new_model, _ = load_tiny_model(perturbed)
    async with two_servers(model_dir) as servers, httpx.AsyncClient(timeout=60) as client:
        before = [await greedy(client, s) for s in servers]
        with anyio.fail_after(120):
            await kind([s.base_url for s in servers], budget=FAST).push(perturbed, version=1)
        after = [await greedy(client, s) for s in servers]
        reported = [(await client.get(f"{s.root_url}/get_weight_version")).json() for s in servers]
        routes = [[path for path, _ in s.requests if not path.startswith("/v1/")] for s in servers]
    expected_version = "1"  # SGLang's is the one sent; the test server counts vLLM's reloads
    if kind is VLLMReloadSync:
        assert routes == [["/collective_rpc", "/reset_prefix_cache"]] * 2
    else:
        assert routes == [["/update_weights_from_disk"]] * 2
    assert reported == [{"weight_version": expected_version}] * 2
    for old, new in zip(before, after, strict=True):
        assert (old["version"], new["version"]) == ("0", "1")
        assert new["logprobs"] != old["logprobs"]
        assert new["logprobs"] == pytest.approx(
            recomputed(new_model, new["prompt"], new["ids"]), abs=1e-5
        )


async def test_a_real_server_that_500s_then_succeeds_is_retried(
    model_dir: Path, perturbed: Path
) -> None:
    failures = [0]

    class FirstPost500(httpx.AsyncBaseTransport):
        """The first POST answers 500 before reaching the server; the rest go through."""

        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and not failures[0]:
                failures[0] += 1
                return httpx.Response(500, json={"detail": "engine busy"})
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    async with ModelServer(model_dir) as server:
        sync = SGLangDiskSync(server.base_url, budget=FAST, transport=FirstPost500())
        with anyio.fail_after(120):
            await sync.push(perturbed, version=1)
        updates = [p for p, _ in server.requests if p == "/update_weights_from_disk"]
        assert (failures[0], len(updates), server.weight_version) == (1, 1, "1")


@pytest.mark.parametrize("kind", [SGLangDiskSync, VLLMReloadSync])
async def test_a_server_that_cannot_load_the_weights_fails_the_sync_naming_it(
    model_dir: Path, tmp_path: Path, kind: type[SGLangDiskSync | VLLMReloadSync]
) -> None:
    missing = tmp_path / "not-saved"
    async with ModelServer(model_dir) as server:
        sync = kind(server.base_url, api_key=SECRET, budget=FAST)
        with anyio.fail_after(120), pytest.raises(WeightSyncError) as caught:
            await sync.push(missing, version=1)
        assert server.version == 0
    ((shown, why),) = caught.value.failed.items()
    assert shown == server.root_url
    assert why.startswith("refused the weights (HTTP ")
    assert str(caught.value).startswith(f"the weight sync failed on {server.root_url}: refused")
    assert SECRET not in str(caught.value)


async def test_rollouts_after_a_sync_carry_the_new_version_and_the_new_weights(
    model_dir: Path, perturbed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_model, _ = load_tiny_model(model_dir)
    new_model, _ = load_tiny_model(perturbed)
    tasks = [t for t in TASKS.values() if t.env_key == "ledger"][:2]

    def policy_calls(servers: list[ModelServer]) -> int:
        return sum(1 for s in servers for p, _ in s.requests if p.endswith("/chat/completions"))

    async with two_servers(model_dir, default_max_tokens=8) as servers, Emulator() as emu:
        settings = load_settings(
            provisioning={"creates_per_second": 1000, "max_concurrent_creates": 16},
            policy={
                "kind": "openai",
                "base_urls": [s.base_url for s in servers],
                "model": servers[0].model_name,
                "max_tokens": 8,
                "return_token_ids": True,
                "logprobs": True,
                "temperature": 1.0,
            },
        )
        events = Events([MemorySink()])
        pool = RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events)
        async with pool, OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy:
            with anyio.fail_after(120):
                before = await pool.run_batch(tasks, policy).results()
            held = paused_arrival(pool.policy_gate, monkeypatch)
            sync = VLLMReloadSync.from_settings(
                settings.policy, settings.timeouts, settings.retries
            )
            during: list[tuple[bool, int]] = []

            class WaitingForACall:
                """Pushes once a rollout's first policy call waits at the paused gate."""

                async def push(self, source: Any, *, version: int) -> None:
                    await held.wait()
                    calls = policy_calls(servers)
                    await sync.push(source, version=version)
                    during.append((pool.policy_gate.paused, policy_calls(servers) - calls))

            with anyio.fail_after(120):
                batch = pool.run_batch(tasks, policy)
                assert await sync_weights(pool, WaitingForACall(), perturbed) == 1
                after = await batch.results()
        assert emu.ledger.running == 0
    assert during == [(True, 0)]  # no policy call reached a server during the push
    assert [s.version for s in servers] == [1, 1]
    for results, version, model in ((before, 0, old_model), (after, 1, new_model)):
        turns = [turn for r in results for turn in r.turns]
        assert turns and len(results) == len(tasks)
        for turn in turns:
            assert turn.policy_version == version
            assert turn.prompt_token_ids and turn.completion_token_ids and turn.logprobs
            assert turn.logprobs == pytest.approx(
                recomputed(model, turn.prompt_token_ids, turn.completion_token_ids), abs=1e-4
            )


@pytest.mark.timeout(400)
@pytest.mark.parametrize("executor", ["local", "ray"])
async def test_after_a_sync_every_executors_policy_calls_carry_the_new_version_and_weights(
    model_dir: Path, perturbed: Path, executor: str, request: pytest.FixtureRequest
) -> None:
    new_model, _ = load_tiny_model(perturbed)
    tasks = [t for t in TASKS.values() if t.env_key == "ledger"][:3]
    async with (
        two_servers(model_dir, default_max_tokens=8) as servers,
        EmulatorProcess() as emu,
        AsyncExitStack() as stack,
    ):
        settings = load_settings(
            policy={
                "kind": "openai",
                "base_urls": [s.base_url for s in servers],
                "model": servers[0].model_name,
                "max_tokens": 8,
                "return_token_ids": True,
                "logprobs": True,
            },
        )
        if executor == "ray":
            pytest.importorskip("ray")
            request.getfixturevalue("local_ray")
            from fleetroll.pool.ray.executor import ray_pool

            opened = ray_pool(settings, api_key=emu.api_key, base_url=emu.base_url, num_actors=2)
        else:
            opened = RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url)
        pool = await stack.enter_async_context(opened)
        policy = OpenAIChatPolicy.from_config(chat_policy_config(settings))
        await stack.enter_async_context(policy)
        sync = SGLangDiskSync.from_settings(settings.policy, settings.timeouts, settings.retries)
        with anyio.fail_after(300):
            assert await sync_weights(pool, sync, perturbed) == 1
            results = await pool.run_batch(tasks, policy).results()
    assert [s.weight_version for s in servers] == ["1", "1"]
    turns = [turn for r in results for turn in r.turns]
    assert len(results) == len(tasks) and len(turns) >= len(tasks)
    for turn in turns:
        assert turn.policy_version == 1
        assert turn.prompt_token_ids and turn.completion_token_ids and turn.logprobs
        assert turn.logprobs == pytest.approx(
            recomputed(new_model, turn.prompt_token_ids, turn.completion_token_ids), abs=1e-4
        )


async def test_a_trainer_of_the_service_syncs_through_its_client(
    model_dir: Path, perturbed: Path
) -> None:
    new_model, _ = load_tiny_model(perturbed)
    tasks = [t for t in TASKS.values() if t.env_key == "ledger"][:2]
    async with two_servers(model_dir, default_max_tokens=8) as servers, Emulator() as emu:
        settings = load_settings(
            policy={
                "kind": "openai",
                "base_urls": [s.base_url for s in servers],
                "model": servers[0].model_name,
                "max_tokens": 8,
                "return_token_ids": True,
                "logprobs": True,
            },
        )
        async with RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool:
            service = Service(pool, settings)
            async with (
                serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop) as url,
                FleetrollClient(url) as client,
            ):
                sync = VLLMReloadSync.from_settings(
                    settings.policy, settings.timeouts, settings.retries
                )
                with anyio.fail_after(120):
                    await client.set_policy_version(4)
                    assert await sync_weights(client, sync, perturbed) == 5
                    assert await client.policy_version() == 5
                    results = await client.run_batch(tasks).results()
    assert [s.version for s in servers] == [1, 1]
    turns = [turn for r in results for turn in r.turns]
    assert turns and all(turn.policy_version == 5 for turn in turns)
    for turn in turns:
        assert turn.prompt_token_ids and turn.completion_token_ids and turn.logprobs
        assert turn.logprobs == pytest.approx(
            recomputed(new_model, turn.prompt_token_ids, turn.completion_token_ids), abs=1e-4
        )
