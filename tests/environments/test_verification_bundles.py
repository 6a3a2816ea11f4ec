"""The verifier bundle check: asked once per content, with the SDK's upload as fallback.

A fake of the SDK's ``AsyncEnv`` (the edge where requests leave) counts what
the real :class:`fleetroll.environments.fleet.verification.Verifier` and the SDK's verifier code
ask of the control plane.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
from fleet.models import VerifiersCheckResponse, VerifiersExecuteResponse

import fleetroll._internal.retrying as retrying
from fleetroll.environments.fleet.verification import Verifier
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

SETTINGS = load_settings()
TASK = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)[0]


class FakeEnv:
    """A control plane that keeps uploaded bundles by sha256 and can forget them."""

    instance_id = "inst-1"

    def __init__(self) -> None:
        self.bundles: set[str] = set()
        self.checks = 0
        self.executes: list[bool] = []  # whether each execute carried the bundle

    async def check_bundle_exists(self, sha: str) -> VerifiersCheckResponse:
        self.checks += 1
        return VerifiersCheckResponse(success=sha in self.bundles)

    async def execute_verifier_remote(self, **kwargs: Any) -> VerifiersExecuteResponse:
        sha, uploaded = kwargs["bundle_sha"], bool(kwargs["bundle_data"])
        await anyio.lowlevel.checkpoint()  # let concurrent verifications interleave
        self.executes.append(uploaded)
        if uploaded:
            self.bundles.add(sha)
        elif sha not in self.bundles:
            raise RuntimeError(f"bundle not found: {sha}")
        return VerifiersExecuteResponse(success=True, result=0.75, execution_time_ms=1)


def make_verifier() -> Verifier:
    return Verifier(timeout_s=10, max_source_bytes=100_000, budget=retrying.Budget(1, 0.0, 0.0))


async def test_the_bundle_check_is_asked_once_per_verifier_content() -> None:
    env, verifier = FakeEnv(), make_verifier()
    with anyio.fail_after(10):
        verdicts = [await verifier.verify(TASK, env, None) for _ in range(3)]
    assert [v.reward for v in verdicts] == [0.75] * 3
    assert env.checks == 1
    assert env.executes == [True, False, False]


async def test_a_bundle_the_control_plane_forgot_is_uploaded_again() -> None:
    env, verifier = FakeEnv(), make_verifier()
    with anyio.fail_after(10):
        first = await verifier.verify(TASK, env, None)
        env.bundles.clear()
        second = await verifier.verify(TASK, env, None)
    assert first.reward == second.reward == 0.75
    assert env.checks == 1
    assert env.executes == [True, False, True]


async def test_a_failed_execution_leaves_the_bundle_checked_next_time() -> None:
    env, verifier = FakeEnv(), make_verifier()

    async def refuse(**kwargs: Any) -> VerifiersExecuteResponse:
        raise ConnectionError("the control plane is down")

    real = env.execute_verifier_remote
    env.execute_verifier_remote = refuse  # type: ignore[method-assign]
    with anyio.fail_after(10):
        failed = await verifier.verify(TASK, env, None)
        env.execute_verifier_remote = real  # type: ignore[method-assign]
        scored = await verifier.verify(TASK, env, None)
    assert failed.reward is None and scored.reward == 0.75
    assert env.checks == 2


async def test_concurrent_first_verifications_check_and_upload_the_bundle_once() -> None:
    env, verifier = FakeEnv(), make_verifier()
    rewards: list[float | None] = []

    async def one() -> None:
        rewards.append((await verifier.verify(TASK, env, None)).reward)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(one)
    assert rewards == [0.75] * 5
    assert env.checks == 1
    assert env.executes == [True, False, False, False, False]
