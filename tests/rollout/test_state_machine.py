"""The rollout state machine on the provider double: every path, in milliseconds.

These run the real :class:`fleetroll.rollout.machine.Rollout` (deadlines, failure
reasons, release on every path, exactly one started and one completed event)
against :class:`fleetroll.testing.fake_provider.FakeProvider`, an in-memory MCP server behind the
:class:`fleetroll.environments.provider.Provider` protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from fleetroll.errors import ProvisionError
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import rollout_config
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import Phase, RolloutIds
from fleetroll.rollout.transcript import Transcript
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events, MemorySink
from fleetroll.testing.fake_provider import FakeProvider

TASK = TaskSpec(
    key="note-done",
    prompt="Write done.",
    env_key="fake",
    modality="tool_use",
    verifier_func="def verify(env):\n    return 1.0\n",
    solution=(SolutionStep(name="note", arguments={"word": "done"}),),
)
HANGING = TASK.model_copy(
    update={"key": "hangs", "solution": (SolutionStep(name="hang", arguments={}),)}
)


@asynccontextmanager
async def engine(
    sink: MemorySink, provider_options: dict[str, Any] | None = None, **overrides: Any
) -> AsyncIterator[tuple[RolloutEngine, FakeProvider]]:
    settings = load_settings(**overrides)
    provider = FakeProvider(
        settings.modalities, timeouts=settings.timeouts, **(provider_options or {})
    )
    async with RolloutEngine.open(rollout_config(settings), Events([sink]), provider) as eng:
        yield eng, provider


async def run(task: TaskSpec, **options: Any) -> tuple[RolloutResult, FakeProvider, MemorySink]:
    sink = MemorySink()
    async with engine(sink, **options) as (eng, provider):
        with anyio.fail_after(10):
            result = await eng.rollout(task, RolloutIds("b", "r")).run(ScriptedPolicy())
    started = [e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started")]
    completed = [e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed")]
    assert started == completed == ["r"]
    assert provider.running == 0
    return result, provider, sink


async def test_a_solved_rollout_completes_with_the_verifiers_reward() -> None:
    result, provider, _ = await run(TASK)

    assert (result.status, result.failure_reason, result.reward) == ("completed", None, 1.0)
    assert result.steps == 1 and result.tool_errors == result.tool_failures == 0
    assert provider.resets == 1 and provider.released == [result.instance_id]


async def test_a_provisioning_failure_is_init_error_with_no_reward_and_nothing_to_release() -> None:
    failure = ProvisionError("no capacity", transient=True)
    result, provider, _ = await run(TASK, provider_options={"provision_error": failure})

    assert result.failure_reason is FailureReason.INIT_ERROR and result.reward is None
    assert "no capacity" in (result.error or "") and provider.released == []


async def test_a_hung_tool_call_is_a_tool_failure_and_the_instance_is_released() -> None:
    result, provider, sink = await run(HANGING, timeouts={"call_tool_s": 0.05})

    assert result.failure_reason is FailureReason.TOOL_FAILURE and result.reward is None
    assert result.tool_failures == 1 and provider.released == [result.instance_id]
    assert sink.named("fleet_tool_call_failed")


async def test_a_verifier_that_cannot_run_is_verifier_error_never_a_zero() -> None:
    result, _, _ = await run(TASK, provider_options={"verify_error": "no runtime"})

    assert result.failure_reason is FailureReason.VERIFIER_ERROR and result.reward is None
    assert result.verifier is not None and result.verifier.error == "no runtime"


async def test_a_rollout_past_its_deadline_in_a_hung_tool_call_is_platform_timeout() -> None:
    result, provider, _ = await run(
        HANGING, timeouts={"rollout_s": 0.5}, pool={"on_tool_failure": "continue"}
    )

    # The platform's time ran out, not the policy's: no reward (the verifier would say 0.0).
    assert result.failure_reason is FailureReason.PLATFORM_TIMEOUT
    assert result.reward is None and "the tool call hang" in (result.error or "")
    assert provider.released == [result.instance_id]


async def test_cancelling_a_rollout_releases_its_instance_and_records_cancelled() -> None:
    sink = MemorySink()
    async with engine(sink) as (eng, provider):
        rollout = eng.rollout(HANGING, RolloutIds("b", "r"))
        with anyio.move_on_after(0.1):
            await rollout.run(ScriptedPolicy())
    assert rollout.result is not None
    assert rollout.result.failure_reason is FailureReason.CANCELLED
    assert rollout.result.reward is None and provider.running == 0


@pytest.mark.parametrize("concurrency", [1, 8])
async def test_concurrent_rollouts_each_get_their_own_instance(concurrency: int) -> None:
    sink = MemorySink()
    async with engine(sink) as (eng, provider):
        results: list[RolloutResult] = []

        async def one(n: int) -> None:
            results.append(await eng.rollout(TASK, RolloutIds("b", f"r{n}")).run(ScriptedPolicy()))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for n in range(concurrency):
                    tg.start_soon(one, n)
    assert [r.reward for r in results] == [1.0] * concurrency
    assert len({r.instance_id for r in results}) == concurrency == len(provider.released)


async def test_every_phase_change_reaches_the_observers_in_order() -> None:
    sink = MemorySink()
    seen: list[str] = []
    async with engine(sink) as (eng, _):
        rollout = eng.rollout(TASK, RolloutIds("b", "r"))
        rollout.observers.append(lambda r: seen.append(r.phase.value))
        await rollout.run(ScriptedPolicy())
    phases = [p for n, p in enumerate(seen) if n == 0 or seen[n - 1] != p]
    assert phases == [
        "provisioning",
        "resetting",
        "connecting",
        "acting",
        "verifying",
        "releasing",
        "done",
    ]


async def test_a_transition_outside_the_table_is_refused() -> None:
    async with engine(MemorySink()) as (eng, _):
        rollout = eng.rollout(TASK, RolloutIds("b", "r"))
        with pytest.raises(RuntimeError, match="cannot go from pending to acting"):
            rollout._enter(Phase.ACTING)


async def test_waiting_for_a_phase_wakes_on_the_change_itself() -> None:
    async with engine(MemorySink()) as (eng, _):
        rollout = eng.rollout(HANGING, RolloutIds("b", "r"))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rollout.run, ScriptedPolicy())
                await rollout.wait_until(lambda r: r.phase is Phase.ACTING)
                tg.cancel_scope.cancel()
    assert rollout.result is not None and rollout.result.failure_reason is FailureReason.CANCELLED


async def test_what_others_see_of_a_running_rollout_is_redacted_like_its_result() -> None:
    secret = "fleet-secret-key-0123456789abcdef"
    task = TASK.model_copy(
        update={
            "solution": (
                SolutionStep(name="note", arguments={"word": secret}),
                SolutionStep(name="hang", arguments={}),
            )
        }
    )
    async with engine(MemorySink(), fleet_api_key=secret) as (eng, _):
        rollout = eng.rollout(task, RolloutIds("b", "r"))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rollout.run, ScriptedPolicy())
                await rollout.wait_until(lambda r: len(r.messages) >= 4)  # in the hang
                view = rollout.view()
                live = str(rollout.messages)
                tg.cancel_scope.cancel()
    assert view.phase is Phase.ACTING and view.steps == 2 and view.result is None
    assert secret in live  # the policy saw it as the tool said it
    assert secret not in str(view.messages) and "noted" in str(view.messages)
    assert rollout.view().result is not None
    assert secret not in str(rollout.view().messages)
    # Once ended, the rollout keeps only its result's (redacted) transcript.
    assert "noted" in str(rollout.messages) and secret not in str(rollout.messages)


def count_exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, every export of a transcript (by how many messages it held)."""
    calls: list[int] = []
    real = Transcript.export

    def export(self: Transcript, redact: Callable[[str], str], *, keep_images: bool) -> Any:
        calls.append(len(self))
        return real(self, redact, keep_images=keep_images)

    monkeypatch.setattr(Transcript, "export", export)
    return calls


async def test_a_view_without_messages_of_a_long_rollout_exports_no_transcript(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    notes = tuple(SolutionStep(name="note", arguments={"word": f"w{n}"}) for n in range(50))
    task = TASK.model_copy(
        update={"solution": (*notes, SolutionStep(name="hang", arguments={})), "max_steps": 100}
    )
    exports = count_exports(monkeypatch)
    async with engine(MemorySink()) as (eng, _):
        rollout = eng.rollout(task, RolloutIds("b", "r"))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rollout.run, ScriptedPolicy())
                await rollout.wait_until(lambda r: len(r.messages) >= 102)  # in the hang
                brief = [rollout.view(messages=False) for _ in range(20)]
                exported_by_brief = len(exports)
                full = rollout.view()
                tg.cancel_scope.cancel()
    assert exported_by_brief == 0 and exports[0] == 102  # then the view with messages, the result
    assert brief[-1].messages == () and len(full.messages) == 102
    assert brief[-1].phase is full.phase is Phase.ACTING and brief[-1].steps == full.steps == 51


@pytest.mark.parametrize("phase", [Phase.PROVISIONING, Phase.RELEASING])
async def test_a_rollout_that_broke_after_it_left_pending_still_gets_its_one_result(
    phase: Phase,
) -> None:
    """The pool's last resort for a run() that raised: never_started must not raise itself."""
    async with engine(MemorySink()) as (eng, _):
        rollout = eng.rollout(TASK, RolloutIds("b", "r"))
        rollout._enter(Phase.PROVISIONING)  # where a bug in run() could have left it
        if phase is Phase.RELEASING:
            rollout._enter(Phase.RELEASING)
        result = rollout.never_started(FailureReason.INIT_ERROR, "fleetroll bug")

    assert rollout.phase is Phase.DONE and rollout.result is result
    assert (result.failure_reason, result.reward) == (FailureReason.INIT_ERROR, None)
