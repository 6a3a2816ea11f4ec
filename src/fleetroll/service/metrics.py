"""``GET /metrics``: Prometheus text exposition, written by hand (no client library).

Counters accumulate over the service's life; gauges are read when scraped.
Labels carry only statuses and failure reasons: never an id, a URL or a key.
A cancelled rollout counts as ``status="cancelled"`` (``reason="cancelled"``), not
as failed.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping

from fleetroll.environments.admission import AdmissionState
from fleetroll.results import RolloutResult

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Provisioning latency buckets, in seconds (a Fleet create takes 1 s to minutes).
PROVISION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


class Metrics:
    """What the service has seen: rollouts by outcome, provisioning latency."""

    def __init__(self) -> None:
        self.rollouts: Counter[tuple[str, str]] = Counter()
        self._buckets = [0] * len(PROVISION_BUCKETS)
        self._provision_count = 0
        self._provision_sum = 0.0

    def observe(self, result: RolloutResult) -> None:
        """Count one finished rollout (batch or session)."""
        reason = result.failure_reason.value if result.failure_reason else ""
        # A cancelled rollout did not fail: its status is a state of its own.
        self.rollouts[(result.outcome, reason)] += 1
        if result.instance_id is not None:  # it was provisioned: its latency counts
            seconds = result.timings.provision_s
            self._provision_count += 1
            self._provision_sum += seconds
            i = bisect.bisect_left(PROVISION_BUCKETS, seconds)
            if i < len(self._buckets):
                self._buckets[i] += 1

    def render(
        self,
        *,
        in_flight: int,
        sessions_open: int,
        batches: Mapping[str, int],
        admission: AdmissionState | None = None,
    ) -> str:
        lines = [
            "# HELP fleetroll_rollouts_total Rollouts ended, by status (completed, failed,"
            " cancelled) and failure reason.",
            "# TYPE fleetroll_rollouts_total counter",
        ]
        for (status, reason), n in sorted(self.rollouts.items()):
            lines.append(f'fleetroll_rollouts_total{{status="{status}",reason="{reason}"}} {n}')
        lines += [
            "# HELP fleetroll_rollouts_in_flight Rollouts of running batches not ended yet,"
            " plus open sessions.",
            "# TYPE fleetroll_rollouts_in_flight gauge",
            f"fleetroll_rollouts_in_flight {in_flight + sessions_open}",
            "# HELP fleetroll_sessions_open Env-style sessions open now.",
            "# TYPE fleetroll_sessions_open gauge",
            f"fleetroll_sessions_open {sessions_open}",
            "# HELP fleetroll_batches Batches the service holds, by status.",
            "# TYPE fleetroll_batches gauge",
        ]
        for status in ("running", "finished", "cancelled"):
            lines.append(f'fleetroll_batches{{status="{status}"}} {batches.get(status, 0)}')
        lines += [
            "# HELP fleetroll_provision_seconds Time to provision an instance"
            " (RolloutResult.timings.provision_s).",
            "# TYPE fleetroll_provision_seconds histogram",
        ]
        cumulative = 0
        for bound, n in zip(PROVISION_BUCKETS, self._buckets, strict=True):
            cumulative += n
            lines.append(f'fleetroll_provision_seconds_bucket{{le="{bound:g}"}} {cumulative}')
        lines += [
            f'fleetroll_provision_seconds_bucket{{le="+Inf"}} {self._provision_count}',
            f"fleetroll_provision_seconds_sum {self._provision_sum:.6f}",
            f"fleetroll_provision_seconds_count {self._provision_count}",
        ]
        if admission is not None:
            lines += _admission_gauges(admission)
        return "\n".join(lines) + "\n"


def _admission_gauges(state: AdmissionState) -> list[str]:
    """The admission controller's state (``fleetroll.environments.admission``) as gauges."""
    gauges = [
        (
            "fleetroll_admission_limit",
            "Instances allowed at once (admission.max_instances or Fleet's account"
            " limit, the lower); -1: none.",
            -1 if state.limit is None else state.limit,
        ),
        (
            "fleetroll_admission_in_use",
            "Instances provisioned and not released, starting ones included.",
            state.in_use,
        ),
        ("fleetroll_admission_starting", "Instances being created.", state.starting),
        ("fleetroll_admission_queued", "Rollouts waiting for an instance place.", state.queued),
        (
            "fleetroll_admission_open_breakers",
            "Environment versions quarantined by their circuit breaker.",
            state.open_breakers,
        ),
        (
            "fleetroll_create_rate",
            "Creates a second allowed now (learnt from Fleet's answers when"
            " provisioning.adaptive_creates; provisioning.creates_per_second at most).",
            f"{state.creates_per_second:g}",
        ),
        (
            "fleetroll_create_in_flight_limit",
            "Create requests allowed at once now (learnt; provisioning.max_concurrent_creates"
            " at most).",
            state.creates_in_flight_limit,
        ),
        ("fleetroll_creates_in_flight", "Create requests in flight.", state.creates_in_flight),
    ]
    lines: list[str] = []
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
    return lines
