"""What a benchmark run records: the JSON written by ``fleetroll bench``."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleetroll.results import Timings

__all__ = [
    "BUSY_CORES",
    "PHASES",
    "Machine",
    "Percentiles",
    "RunRecord",
    "Sample",
    "ScenarioReport",
    "SystemSummary",
    "ToolCallRecord",
    "ToolCallStats",
    "load_average",
    "summarize",
]

#: Per-phase timings reported, by their :class:`~fleetroll.results.Timings` field.
PHASES = ("provision_s", "reset_s", "policy_s", "tools_s", "verify_s", "total_s")
#: CPU used by other processes during a run, in cores on average, above which
#: its numbers are marked provisional (someone else was using the machine).
BUSY_CORES = 0.15


@dataclass(frozen=True, slots=True)
class Sample:
    """One rollout's outcome as the harness sees it, whatever system ran it."""

    reward: float | None
    failure: str | None
    timings: Timings = field(default_factory=Timings)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Percentiles(_Model):
    """p50 / p95 / p99 of one phase, in seconds, over the rollouts that had it."""

    p50: float | None
    p95: float | None
    p99: float | None


class RunRecord(_Model):
    """One system's run of one scenario at one concurrency."""

    scenario: str
    system: str
    concurrency: int | None = Field(description="None: no limit (naive-gather)")
    requested: int
    returned: int = Field(description="results handed back to the caller")
    scored: int = Field(description="results with a reward")
    failures: dict[str, int]
    finished_on_its_own: bool
    makespan_s: float
    ideal_s: float | None
    overhead: float | None
    rollouts_per_s: float = Field(description="scored rollouts per second of makespan")
    phases: dict[str, Percentiles]
    loop_lag_p99_ms: float | None
    loop_lag_max_ms: float | None
    peak_rss_mb: float
    peak_rss_of_run: bool = Field(description="False: the process's peak, not this run's")
    cpu_s: float
    cpu_ms_per_rollout: float
    cpu_utilisation: float = Field(description="fleetroll-process CPU seconds / makespan")
    emulator_cpu_s: float | None
    emulator_cpu_utilisation: float | None
    leaked: int = Field(description="instances still running after the run, before cleanup")
    leaked_after_cleanup: int | None = Field(
        None, description="still running after the harness cancelled what the run left behind"
    )
    past_deadline: int = Field(description="rollouts over their deadline budget + 5 s")
    deadline_budget_s: float
    load_average_before: float | None
    other_cpu_utilisation: float | None = Field(
        description="CPU of every other process on the machine during the run, in cores"
    )
    provisional: bool = Field(description="the machine was busy with others during the run")
    ledger: dict[str, Any]
    notes: list[str] = Field(default_factory=list)
    round: int = Field(1, description="which round of `--repeat` (1 without it)")


class SystemSummary(_Model):
    """One system at one concurrency over every round of ``--repeat``: medians.

    ``cpu_vs_floor`` is the median of each round's own ratio (this system's CPU
    per rollout over ``cpu-floor``'s in the same round), so that the machine's
    drift between rounds cancels rather than adds.
    """

    system: str
    concurrency: int | None
    rounds: int
    scored: int = Field(description="the fewest scored in a round")
    requested: int
    cpu_ms_per_rollout: float
    cpu_vs_floor: float | None = Field(description="None: no cpu-floor run to pair with")
    overhead: float | None = Field(description="makespan / ideal")
    loop_lag_p99_ms: float | None
    peak_rss_mb: float = Field(description="the largest of the rounds")
    leaked: int = Field(description="summed over the rounds")


class ToolCallStats(_Model):
    """Per-call wall and CPU time of one client, in milliseconds."""

    client: str
    calls: int
    wall_mean_ms: float
    wall_p50_ms: float
    wall_p95_ms: float
    cpu_mean_ms: float


class ToolCallRecord(_Model):
    """The per-call micro-benchmark: fleetroll's ToolSession vs a bare mcp session."""

    calls: int
    tool: str
    clients: list[ToolCallStats]
    ratio_mean: float = Field(description="fleetroll / bare, mean wall time per call")
    ratio_p50: float = Field(description="fleetroll / bare, median wall time per call")
    load_average_before: float | None
    other_cpu_utilisation: float | None
    provisional: bool


class PolicyTurnRow(_Model):
    """One turn index of the policy-path benchmark: medians over the repeats, CPU ms."""

    turn: int
    request_mb: float = Field(description="the request body with every screenshot")
    encoded_ms: float = Field(description="building it, each message encoded once (rollouts)")
    whole_ms: float = Field(description="building it, the whole transcript encoded again")
    act_ms: float = Field(description="a whole OpenAIChatPolicy.act, encoded once")
    capped_act_ms: float = Field(description="the same with policy.max_images = 3")
    capped_request_mb: float


class PolicyTurnRecord(_Model):
    """CPU per policy turn against turn index (does building a request grow?)."""

    turns: int
    screenshot_kb: int
    repeat: int
    rows: list[PolicyTurnRow]


class WeightUpdateRow(_Model):
    """One ``policy.weight_update`` mode of the weight-update benchmark."""

    mode: str
    rollouts: int
    wall_s: float
    generated_tokens: int
    tokens_per_s: float = Field(description="generated tokens per second of wall time")
    idle_share: float = Field(description="1 - the server's generating time / wall time")
    updates: int = Field(description="weight updates pushed during the batch")
    update_s: float = Field(description="mean seconds of one sync_weights")
    aborted: int = Field(description="generations aborted on the server")
    kept_tokens: int = Field(description="tokens the aborted generations had made (resumed)")
    straddling_turns: int = Field(description="turns whose tokens span two versions")
    stale: int = Field(description="rollouts dropped as stale")


class WeightUpdateRecord(_Model):
    """Generation throughput and server idle share under each weight-update mode."""

    rollouts: int
    concurrency: int
    max_tokens: int
    update_every_s: float
    rows: list[WeightUpdateRow]


class Machine(_Model):
    nproc: int
    cpu_model: str
    python: str
    platform: str

    @classmethod
    def here(cls) -> Machine:
        model = "unknown"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return cls(
            nproc=os.cpu_count() or 0,
            cpu_model=model,
            python=platform.python_version(),
            platform=platform.platform(),
        )


class ScenarioReport(_Model):
    """Everything one ``fleetroll bench`` invocation measured for one scenario."""

    scenario: str
    description: str
    command: str
    started_at: str
    machine: Machine
    parameters: dict[str, Any]
    runs: list[RunRecord] = Field(default_factory=list)
    summary: list[SystemSummary] = Field(default_factory=list)
    tool_calls: ToolCallRecord | None = None
    policy_turns: PolicyTurnRecord | None = None
    weight_updates: WeightUpdateRecord | None = None


def load_average() -> float | None:
    """The 1-minute load average, or None where it is not available."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(runs: list[RunRecord], *, floor: str = "cpu-floor") -> list[SystemSummary]:
    """Each system's medians over its rounds, at each concurrency, in the order the
    systems first ran; a round's CPU ratio pairs it with ``floor``'s run of that round."""
    floors = {
        (r.concurrency, r.round): r.cpu_ms_per_rollout
        for r in runs
        if r.system == floor and r.cpu_ms_per_rollout > 0
    }
    groups: dict[tuple[str, int | None], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault((run.system, run.concurrency), []).append(run)
    summary = []
    for (system, concurrency), mine in groups.items():
        ratios = [
            r.cpu_ms_per_rollout / floors[(concurrency, r.round)]
            for r in mine
            if (concurrency, r.round) in floors
        ]
        summary.append(
            SystemSummary(
                system=system,
                concurrency=concurrency,
                rounds=len(mine),
                scored=min(r.scored for r in mine),
                requested=mine[0].requested,
                cpu_ms_per_rollout=statistics.median(r.cpu_ms_per_rollout for r in mine),
                cpu_vs_floor=statistics.median(ratios) if ratios else None,
                overhead=_median([r.overhead for r in mine]),
                loop_lag_p99_ms=_median([r.loop_lag_p99_ms for r in mine]),
                peak_rss_mb=max(r.peak_rss_mb for r in mine),
                leaked=sum(r.leaked for r in mine),
            )
        )
    return summary
