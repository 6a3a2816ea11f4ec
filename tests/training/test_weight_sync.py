"""Weight sync, the narrow cases: what goes on the wire and what each answer means
(``httpx.MockTransport`` servers), a user's callable, and the pool's pause and
version around a push (the executor double). Real servers and the emulator:
test_weight_sync_servers.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from fleetroll.errors import WeightSyncError
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import load_settings
from fleetroll.settings.sections import Budget
from fleetroll.testing.fake_executor import FakeExecutor
from fleetroll.training.weight_sync import (
    CallableSync,
    SGLangDiskSync,
    VLLMReloadSync,
    WeightSync,
    sync_weights,
)

FAST = Budget(attempts=3, backoff_initial_s=0.01, backoff_max_s=0.02)
SECRET = "sk-weights-secret-4242"


def answering(
    handler: Callable[[httpx.Request], httpx.Response], seen: list[httpx.Request]
) -> httpx.MockTransport:
    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    return httpx.MockTransport(record)


# ---------------------------------------------------------------- unit: the wire


async def test_sglang_sync_posts_the_path_and_version_to_every_server_root_and_checks_it() -> None:
    seen: list[httpx.Request] = []
    versions: dict[str, str] = {"a": "0", "b": "0"}

    def server(request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": versions[host]})
        body = json.loads(request.content)
        versions[host] = body["weight_version"]
        return httpx.Response(200, json={"success": True, "message": "ok"})

    sync = SGLangDiskSync(
        ["http://a.test/v1", "http://b.test/v1/"],
        api_key=SECRET,
        budget=FAST,
        transport=answering(server, seen),
    )
    await sync.push("weights/step-1", version=7)
    posts = [r for r in seen if r.method == "POST"]
    assert sorted(str(r.url) for r in posts) == [
        "http://a.test/update_weights_from_disk",
        "http://b.test/update_weights_from_disk",
    ]
    for post in posts:
        assert json.loads(post.content) == {
            "model_path": str(Path("weights/step-1").absolute()),
            "weight_version": "7",
        }
        assert post.headers["authorization"] == f"Bearer {SECRET}"
    assert versions == {"a": "7", "b": "7"}


async def test_vllm_sync_calls_reload_weights_with_the_path() -> None:
    seen: list[httpx.Request] = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_weight_version":
            return httpx.Response(404, json={"detail": "Not Found"})  # vLLM has none
        return httpx.Response(200, json={"results": [None]})

    sync = VLLMReloadSync("http://v.test:8000/v1", budget=FAST, transport=answering(server, seen))
    await sync.push(Path("/ckpt/step-2"), version=2)
    reload, reset = [r for r in seen if r.method == "POST"]
    assert str(reload.url) == "http://v.test:8000/collective_rpc"
    body = json.loads(reload.content)
    assert body == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-2"}}
    assert "authorization" not in reload.headers
    # The prefixes vLLM cached were computed with the old weights.
    assert str(reset.url) == "http://v.test:8000/reset_prefix_cache"


async def test_a_server_that_answers_500_then_succeeds_is_retried() -> None:
    seen: list[httpx.Request] = []
    failures = iter([500, 503])

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_weight_version":
            return httpx.Response(404)
        status = next(failures, 200)
        return httpx.Response(status, json={"results": [None]} if status == 200 else {})

    sync = VLLMReloadSync("http://v.test", budget=FAST, transport=answering(server, seen))
    await sync.push("/ckpt", version=1)
    posts = [r.url.path for r in seen if r.method == "POST"]
    assert posts == ["/collective_rpc"] * 3 + ["/reset_prefix_cache"]


async def test_a_refusal_names_the_server_and_says_why_without_credentials() -> None:
    seen: list[httpx.Request] = []
    good_version = ["0"]

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.host == "good.test":
            if request.url.path == "/get_weight_version":
                return httpx.Response(200, json={"weight_version": good_version[0]})
            good_version[0] = json.loads(request.content)["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": "0"})
        message = "Failed to update weights: no such directory"
        return httpx.Response(200, json={"success": False, "message": message})

    sync = SGLangDiskSync(
        ["http://good.test/v1", f"http://user:{SECRET}@bad.test/v1?key={SECRET}"],
        api_key=SECRET,
        budget=FAST,
        transport=answering(server, seen),
    )
    with pytest.raises(WeightSyncError) as caught:
        await sync.push("/nowhere", version=1)
    error = caught.value
    assert list(error.failed) == ["http://bad.test"]
    assert error.failed["http://bad.test"] == (
        "refused the weights (HTTP 200): Failed to update weights: no such directory"
    )
    assert error.synced == ["http://good.test"]
    assert SECRET not in str(error) and SECRET not in repr(sync)
    assert "serve different weights" in str(error)
    # A refusal is not retried: one POST to the refusing server.
    assert len([r for r in seen if r.method == "POST" and r.url.host == "bad.test"]) == 1


async def test_a_server_that_still_reports_its_old_version_fails_the_sync() -> None:
    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": "3"})
        return httpx.Response(200, json={"results": [None]})

    sync = VLLMReloadSync("http://stuck.test", budget=FAST, transport=answering(server, []))
    with pytest.raises(WeightSyncError, match="still reports weight version '3'"):
        await sync.push("/ckpt", version=4)


async def test_a_vllm_without_dev_mode_fails_with_its_404() -> None:
    def server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    sync = VLLMReloadSync("http://plain.test/v1", budget=FAST, transport=answering(server, []))
    with pytest.raises(WeightSyncError) as caught:
        await sync.push("/ckpt", version=1)
    assert caught.value.failed == {"http://plain.test": "refused the weights (HTTP 404): Not Found"}


def test_a_sync_needs_a_server() -> None:
    with pytest.raises(ValueError, match="at least one policy server"):
        SGLangDiskSync([])


def test_from_settings_pushes_to_every_policy_server() -> None:
    settings = load_settings(
        policy={"base_urls": ["http://a:1/v1", "http://b:2/v1"]},
        timeouts={"weight_sync_s": 12.0},
        retries={"weight_sync_attempts": 5},
    )
    sync = VLLMReloadSync.from_settings(settings.policy, settings.timeouts, settings.retries)
    assert sync.servers == ["http://a:1", "http://b:2"]
    assert sync.timeout_s == 12.0 and sync.budget.attempts == 5


# ---------------------------------------------------------------- unit: a callable


async def test_a_callable_sync_calls_a_plain_function_and_a_coroutine_function() -> None:
    calls: list[tuple[str, Any, int]] = []

    def plain(source: Any, version: int) -> None:
        calls.append(("plain", source, version))

    async def coroutine(source: Any, version: int) -> None:
        await anyio.sleep(0)
        calls.append(("async", source, version))

    await CallableSync(plain).push("/w", version=1)
    await CallableSync(coroutine).push("/w", version=2)
    assert calls == [("plain", "/w", 1), ("async", "/w", 2)]


async def test_a_callable_that_fails_transiently_is_retried_and_one_that_refuses_is_not() -> None:
    tries: list[int] = []

    def flaky(source: Any, version: int) -> None:
        tries.append(version)
        if len(tries) == 1:
            raise TimeoutError

    await CallableSync(flaky, budget=FAST).push("/w", version=1)
    assert tries == [1, 1]

    def refusing(source: Any, version: int) -> None:
        tries.append(version)
        raise RuntimeError("the trainer's server said no")

    with pytest.raises(WeightSyncError, match="RuntimeError: the trainer's server said no"):
        await CallableSync(refusing, budget=FAST).push("/w", version=2)
    assert tries == [1, 1, 2]


# ---------------------------------------------------------------- unit: the pool's side


class Watching:
    """A :class:`WeightSync` that pushes through ``inner`` and notes the pool's gate."""

    def __init__(self, pool: RolloutPool, inner: WeightSync) -> None:
        self.pool, self.inner = pool, inner
        self.seen: list[tuple[bool, int]] = []

    async def push(self, source: Any, *, version: int) -> None:
        self.seen.append((self.pool.policy_gate.paused, self.pool.policy_version))
        await self.inner.push(source, version=version)


async def test_sync_weights_pushes_while_paused_then_sets_the_next_version() -> None:
    pushed: list[tuple[Any, int]] = []
    async with RolloutPool(load_settings(), executor=FakeExecutor()) as pool:
        sync = Watching(pool, CallableSync(lambda s, v: pushed.append((s, v))))
        assert isinstance(sync, WeightSync)
        assert await sync_weights(pool, sync, "/w1") == 1
        assert await sync_weights(pool, sync, "/w5", version=5) == 5
        assert (pool.policy_version, pool.policy_gate.paused) == (5, False)
    assert pushed == [("/w1", 1), ("/w5", 5)]
    assert sync.seen == [(True, 0), (True, 1)]  # paused, the old version still on


async def test_a_failed_push_keeps_the_version_and_ends_the_pause() -> None:
    def refusing(source: Any, version: int) -> None:
        raise RuntimeError("no")

    async with RolloutPool(load_settings(), executor=FakeExecutor()) as pool:
        pool.policy_version = 3
        with pytest.raises(WeightSyncError):
            await sync_weights(pool, CallableSync(refusing, budget=FAST), "/w")
        assert (pool.policy_version, pool.policy_gate.paused) == (3, False)
        with pytest.raises(ValueError, match="the new policy version 3 is not after the pool's"):
            await sync_weights(pool, CallableSync(refusing), "/w", version=3)
