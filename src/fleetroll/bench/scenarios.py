"""Benchmark scenarios: what runs, against which latencies and faults.

A scenario fixes the emulator's fault profile (its injected latencies make the
ideal makespan computable), the policy's think time, the tasks (read-only
``ledger`` calls, so every rollout does the same work and the verifier's
answer is 1.0), fleetroll's settings, and which baselines run beside it.

Scenarios live here rather than in files so that ``fleetroll bench`` works
from a plain install; ``fleetroll bench --list`` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from fleetroll.settings import Settings, load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import SolutionStep, TaskSpec

__all__ = [
    "BASELINES",
    "CHAOS_TIMEOUTS",
    "SCENARIOS",
    "Scenario",
    "bench_tasks",
    "fleetroll_settings",
]

#: The baselines ``fleetroll bench`` knows (see :mod:`fleetroll.bench.baselines`);
#: ``cpu-floor`` (:mod:`fleetroll.bench.cpu_floor`) runs only when asked for.
BASELINES = ("fresh-session", "naive-gather", "cpu-floor")
_DEFAULT_BASELINES = ("fresh-session", "naive-gather")

#: Tight deadlines for the chaos run (as in ``tests/pool/test_pool.py``): a hung
#: create, reset or tool call costs seconds, not the shipped minutes.
CHAOS_TIMEOUTS: Mapping[str, float] = MappingProxyType(
    {
        "provision_create_s": 3.0,
        "provision_total_s": 30.0,
        "reset_s": 1.0,
        "mcp_connect_s": 5.0,
        "list_tools_s": 3.0,
        "call_tool_s": 2.0,
        "policy_s": 10.0,
        "verifier_s": 10.0,
        "release_s": 5.0,
        "rollout_s": 30.0,
    }
)

_VERIFIER = "def verify(env, final_answer=None):\n    return 1.0\n"
_ACCOUNTS = ("Checking", "Savings", "Petty Cash", "Credit Card", "Sales", "Rent", "Software")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One benchmark scenario. Numbers are defaults; the command line overrides them.

    Attributes:
        kind: ``batch`` (rollouts through each system), ``tool-call`` (the
            per-call micro-benchmark; ``rollouts`` is then the number of calls)
            or ``policy-turn`` (CPU per policy turn against turn index, no
            emulator; ``rollouts`` fresh rollouts of ``steps`` turns, each
            answered with a screenshot of ``screenshot_kb`` KB), or
            ``weight-update`` (the batch under each ``policy.weight_update``
            mode on the tiny model's test server, weights pushed every
            ``update_every_s``: :mod:`fleetroll.bench.weight_updates`).
        profile: the emulator's faults and latencies.
        profile_name: a profile of the settings (``[emulator.profiles.NAME]``)
            used instead of ``profile``.
        timeouts, provisioning: overrides of fleetroll's settings; the
            baselines use the same deadlines where they have any.
        max_creates: concurrent creates; None means "the concurrency", so the
            create limiter is not what a scenario measures.
        wall_limit_s: every run (fleetroll's too) is stopped after this long.
        discovery_wait_s: the ``fresh-session`` baseline's fixed wait before
            tool discovery (the reference waited 8 s).
        samples_per_task: rollouts per task (a GRPO group), when it divides
            the number of rollouts.
        telemetry: fleetroll runs with the telemetry ``fleetroll run`` sets up
            (the local store, in a temporary folder, and the console sink, its
            lines dropped); off, with no sink at all.
        telemetry_off_too: also run fleetroll with no sink at all, as the
            system ``fleetroll-telemetry-off``, right after each telemetry-on run.
        tool_calls: with telemetry, one ``fleet_tool_call`` record per tool call
            (``telemetry.tool_calls``).
        tool_calls_off_too: also run fleetroll with telemetry but no per-call
            records, as the system ``fleetroll-tool-calls-off``, in the same rounds:
            what those records cost.
        repeat: rounds of every system at each concurrency; each round starts
            with the next system (a rotation), so a machine whose speed drifts
            within minutes charges no system more than another, and the report
            gives each system's medians over the rounds.
    """

    name: str
    description: str
    kind: Literal["batch", "tool-call", "policy-turn", "weight-update"] = "batch"
    rollouts: int = 8
    concurrency: tuple[int, ...] = (8,)
    steps: int = 5
    think_s: float = 0.0
    profile: FaultProfile = field(default_factory=FaultProfile)
    profile_name: str | None = None
    timeouts: Mapping[str, float] = field(default_factory=dict)
    provisioning: Mapping[str, Any] = field(default_factory=dict)
    max_creates: int | None = None
    creates_per_second: float = 100_000.0
    wall_limit_s: float = 600.0
    baselines: tuple[str, ...] = _DEFAULT_BASELINES
    discovery_wait_s: float = 8.0
    samples_per_task: int = 8
    screenshot_kb: int = 100
    telemetry: bool = True
    telemetry_off_too: bool = False
    tool_calls: bool = True
    tool_calls_off_too: bool = False
    repeat: int = 1
    #: ``weight-update``: seconds between two weight pushes, and each turn's ``max_tokens``.
    update_every_s: float = 1.0
    max_tokens: int = 32

    def with_profile(self, settings: Settings, name: str | None) -> Scenario:
        """This scenario with its named profile resolved (``name`` wins over its own).

        Raises:
            ConfigError: no profile has that name.
        """
        chosen = name or self.profile_name
        if chosen is None:
            return self
        return replace(self, profile=settings.emulator.fault_profile(chosen), profile_name=chosen)

    @property
    def faulty(self) -> bool:
        """Whether the profile injects failures (then there is no ideal makespan)."""
        p = self.profile
        return any(
            (
                p.p_create_5xx,
                p.p_create_429,
                p.p_create_hang,
                p.p_tool_hang,
                p.p_tool_error,
                p.p_reset_hang,
                p.p_instance_death,
                p.p_verifier_error,
                p.instance_limit is not None,
            )
        )


def _latencies(create_s: float, tool_s: float) -> FaultProfile:
    return FaultProfile(create_latency=Latency(min_s=create_s), tool_latency=Latency(min_s=tool_s))


SCENARIOS: Mapping[str, Scenario] = MappingProxyType(
    {
        s.name: s
        for s in (
            Scenario(
                name="smoke",
                description="8 rollouts of 2 steps, near-zero latencies: checks the tooling",
                rollouts=8,
                concurrency=(8,),
                steps=2,
                profile=_latencies(0.05, 0.01),
                wall_limit_s=60.0,
                discovery_wait_s=0.2,
            ),
            Scenario(
                name="realistic",
                description=(
                    "create 5 s, think 4 s per turn, tool call 200 ms, 5 steps "
                    "(the issue's target: 1,000 concurrent rollouts)"
                ),
                rollouts=1000,
                concurrency=(100, 250, 500, 1000),
                steps=5,
                think_s=4.0,
                profile=_latencies(5.0, 0.2),
                wall_limit_s=900.0,
            ),
            Scenario(
                name="tool-heavy",
                description="20 steps, think 200 ms, tool call 100 ms, create 2 s",
                rollouts=500,
                concurrency=(100, 250, 500),
                steps=20,
                think_s=0.2,
                profile=_latencies(2.0, 0.1),
                wall_limit_s=900.0,
            ),
            Scenario(
                name="scale",
                description="10,000 rollouts in one batch, 2 steps, 1,000 at once: peak RSS",
                rollouts=10_000,
                concurrency=(1000,),
                steps=2,
                think_s=0.5,
                profile=_latencies(0.5, 0.05),
                wall_limit_s=3600.0,
                baselines=(),
            ),
            Scenario(
                name="chaos",
                description=(
                    "the shipped chaos profile (5xx/429 on create, slow MCP start, tool, "
                    "create and reset hangs, instance deaths), tight deadlines"
                ),
                rollouts=500,
                # Concurrency >= rollouts: no rollout waits for a slot, so
                # "past its deadline" is measured exactly (see RESULTS.md).
                concurrency=(500,),
                steps=5,
                think_s=0.2,
                profile_name="chaos",
                timeouts=CHAOS_TIMEOUTS,
                provisioning={"backoff_initial_s": 0.05, "backoff_max_s": 0.5},
                wall_limit_s=240.0,
            ),
            Scenario(
                name="create-queue",
                description=(
                    "Fleet's create queue (one create per 2 s), 8 tasks x 12 samples at "
                    "C=16, instance reuse on (create-queue-fresh: off)"
                ),
                rollouts=96,
                concurrency=(16,),
                steps=5,
                samples_per_task=12,
                profile_name="create-queue",
                provisioning={"reuse": True},
                baselines=(),
            ),
            Scenario(
                name="create-queue-fresh",
                description="create-queue with instance reuse off: one create per rollout",
                rollouts=96,
                concurrency=(16,),
                steps=5,
                samples_per_task=12,
                profile_name="create-queue",
                provisioning={"reuse": False},
                baselines=(),
            ),
            Scenario(
                name="tool-call",
                description=(
                    "N sequential calls on one instance: fleetroll's ToolSession vs a bare "
                    "mcp Client session, interleaved (target <= 1.2x)"
                ),
                kind="tool-call",
                rollouts=500,
                concurrency=(1,),
                baselines=(),
                wall_limit_s=300.0,
            ),
            Scenario(
                name="policy-turn",
                description=(
                    "CPU per policy turn against turn index: a 30-turn computer_use rollout "
                    "with 100 KB screenshots (building a request must not grow)"
                ),
                kind="policy-turn",
                rollouts=5,
                concurrency=(1,),
                steps=30,
                baselines=(),
                screenshot_kb=100,
            ),
            Scenario(
                name="weight-updates",
                description=(
                    "the tiny model's test server, weights pushed every 0.5 s: generation "
                    "throughput and server idle share under pause, abort and in_flight"
                ),
                kind="weight-update",
                rollouts=16,
                concurrency=(4,),
                steps=1,
                samples_per_task=4,
                baselines=(),
                wall_limit_s=300.0,
                update_every_s=0.5,
                max_tokens=48,
            ),
        )
    }
)


def bench_tasks(rollouts: int, steps: int, samples: int = 8) -> tuple[list[TaskSpec], int]:
    """Tasks for ``rollouts`` rollouts of ``steps`` read-only calls each.

    Returns the tasks and the samples per task: ``samples`` when it divides
    ``rollouts`` (GRPO-style groups), else 1 (one task per rollout).
    """
    if rollouts < 1 or steps < 1:
        raise ValueError("a scenario needs at least one rollout and one step")
    per_task = samples if samples > 1 and rollouts % samples == 0 else 1
    tasks = []
    for i in range(rollouts // per_task):
        solution = tuple(
            SolutionStep(name="list_accounts")
            if (i + j) % 3 == 0
            else SolutionStep(
                name="get_balance", arguments={"account": _ACCOUNTS[(i + j) % len(_ACCOUNTS)]}
            )
            for j in range(steps)
        )
        tasks.append(
            TaskSpec(
                key=f"bench-{steps}-{i:05d}",
                prompt="Look up the books: read the balances you are asked for.",
                env_key="ledger",
                env_version="v1",
                data_key="seed",
                data_version="v1",
                modality="tool_use",
                verifier_func=_VERIFIER,
                max_steps=steps + 5,
                solution=solution,
            )
        )
    return tasks, per_task


def fleetroll_settings(
    scenario: Scenario, concurrency: int, config_file: str | None = None
) -> Settings:
    """fleetroll's settings for one run of ``scenario`` at ``concurrency``.

    Creates get the run's concurrency and a fixed rate that never binds, unless
    the scenario says otherwise.

    Raises:
        ConfigError: the configuration (file or overrides) is invalid.
    """
    provisioning: dict[str, Any] = {
        "max_concurrent_creates": scenario.max_creates or concurrency,
        "creates_per_second": scenario.creates_per_second,
        # The ideal is drawn at these fixed rates: the learnt rate's ramp from its
        # start would be measured as overhead (a scenario may turn it on).
        "adaptive_creates": False,
        **scenario.provisioning,
    }
    return load_settings(
        config_file,
        pool={"concurrency": concurrency, "max_steps": scenario.steps + 5},
        provisioning=provisioning,
        timeouts=dict(scenario.timeouts),
    )
