"""The collector's policy: set by fleetroll's entry points, never by importing it."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from fleetroll._internal.gc_policy import TUNED_THRESHOLDS, gc_policy

#: Imports fleetroll, opens a pool and runs a batch on the fake provider, then
#: says whether the collector is as Python left it.
_LIBRARY_USE = textwrap.dedent(
    """
    import gc
    before = gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()

    import anyio
    import fleetroll
    from fleetroll.policies import ScriptedPolicy
    from fleetroll.pool.rollout_pool import RolloutPool
    from fleetroll.settings import load_settings
    from fleetroll.tasks import SolutionStep, TaskSpec
    from fleetroll.testing.fake_provider import FakeProvider

    task = TaskSpec(key="t", prompt="Write done.", env_key="fake", modality="tool_use",
                    verifier_func="def verify(env):\\n    return 1.0\\n",
                    solution=(SolutionStep(name="note", arguments={"word": "done"}),))

    async def main():
        settings = load_settings()
        assert settings.pool.gc_policy == "tuned"
        provider = FakeProvider(settings.modalities, timeouts=settings.timeouts)
        async with RolloutPool(settings, provider=provider) as pool:
            results = await pool.run_batch([task], ScriptedPolicy(), samples_per_task=2).results()
            assert [r.reward for r in results] == [1.0, 1.0]
            return gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()

    during = anyio.run(main)
    after = gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()
    print(before == during == after, before, during, after)
    """
)


def test_importing_fleetroll_and_running_a_pool_leave_the_collector_alone() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LIBRARY_USE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True"), done.stdout


def test_the_tuned_policy_freezes_start_up_and_raises_thresholds_for_its_block_only() -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    with gc_policy("tuned"):
        assert gc.get_threshold() == TUNED_THRESHOLDS
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen


def test_the_python_policy_changes_nothing() -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    with gc_policy("python"):
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
