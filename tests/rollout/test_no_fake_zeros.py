"""Issue 13's acceptance check: on the emulator's faulty profiles, with the
scripted policy (whose solutions are correct), no rollout is scored 0.0.

Every result is either the solution's reward, 1.0, or an infrastructure
failure with a ``failure_reason`` and ``reward: null``; a fault never turns
into a fabricated zero a trainer would learn from. Issue 27's: neither does
a rollout deadline (``timeouts.rollout_s``) shorter than the platform's hangs.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from test_rollout_deadlines import assert_timings_add_up

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASKS = [
    t
    for f in sorted((config_dir() / "tasks").glob("*.jsonl"))
    for t in load_tasks(f, modalities=SETTINGS.modalities)
]

#: Small deadlines, so that the profile's hangs end in seconds: a hang passes
#: its deadline (and is a failure) instead of holding the test for an hour.
TIMEOUTS = {
    "provision_create_s": 3.0,
    "provision_total_s": 30.0,
    "reset_s": 1.0,
    "mcp_connect_s": 10.0,
    "list_tools_s": 5.0,
    "call_tool_s": 1.0,
    "verifier_s": 20.0,
    "release_s": 5.0,
    "rollout_s": 60.0,
}
#: The profile's hangs, shortened (whatever the shipped config says), yet
#: each longer than the deadline it must trip.
HANGS = {"create_hang_s": 6.0, "tool_hang_s": 6.0, "reset_hang_s": 3.0}
PROVISIONING = {"creates_per_second": 1000, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}


async def run_every_task(profile: FaultProfile, timeouts: dict[str, float]) -> list[RolloutResult]:
    """One rollout of every shipped task on the emulator with ``profile``, the scripted policy."""
    settings = load_settings(timeouts=timeouts, provisioning=PROVISIONING)
    results: list[RolloutResult] = []
    async with Emulator(profile) as emu:
        async with RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool:
            with anyio.fail_after(240):
                async for result in pool.run_batch(TASKS, ScriptedPolicy()):
                    results.append(result)
        assert emu.ledger.running == 0
    assert len(results) == len(TASKS)
    return results


def fake_zeros(results: list[RolloutResult]) -> list[tuple[Any, ...]]:
    """The results that are neither the solution's 1.0 nor an unscored failure."""
    return [
        (r.task_key, r.status, r.failure_reason, r.reward, r.error)
        for r in results
        if not (r.reward == 1.0 or (r.failure_reason is not None and r.reward is None))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("profile_name", ["realistic", "chaos"])
async def test_faults_never_give_a_zero_reward_to_a_correct_solution(profile_name: str) -> None:
    profile = SETTINGS.emulator.fault_profile(profile_name).model_copy(update=HANGS)
    results = await run_every_task(profile, TIMEOUTS)
    assert fake_zeros(results) == []


#: The rollout's deadline passes first: every wait's own deadline is longer, and
#: every injected hang (and warm-up) longer still. A rollout the platform does
#: not hold up ends well inside it.
SHORT_ROLLOUT = {
    **TIMEOUTS,
    "reset_s": 20.0,
    "mcp_connect_s": 20.0,
    "list_tools_s": 20.0,
    "call_tool_s": 20.0,
    "rollout_s": 10.0,
}
LONG_HANGS = {**HANGS, "tool_hang_s": 30.0, "reset_hang_s": 30.0}
#: Per profile, the platform delays injected over its own faults.
DELAYS: dict[str, dict[str, Any]] = {
    # An MCP service still starting when the rollout's deadline passes.
    "clean": {"mcp_warmup_s": 30.0},
    "realistic": {**LONG_HANGS, "p_tool_hang": 0.1, "p_reset_hang": 0.1},
    "chaos": {**LONG_HANGS, "p_tool_hang": 0.1, "p_reset_hang": 0.1},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("profile_name", list(DELAYS))
async def test_a_rollout_deadline_shorter_than_the_platform_hangs_gives_no_fake_zero(
    profile_name: str,
) -> None:
    profile = SETTINGS.emulator.fault_profile(profile_name).model_copy(update=DELAYS[profile_name])
    results = await run_every_task(profile, SHORT_ROLLOUT)
    # The solutions are right: a 0.0 could only be a deadline charged to the policy.
    assert fake_zeros(results) == []
    # The deadline did pass in waits on the platform (the test is not vacuous).
    assert any(r.failure_reason is FailureReason.PLATFORM_TIMEOUT for r in results)
    for r in results:
        assert_timings_add_up(r.timings)
