"""``GET /metrics``: Prometheus text exposition, written by hand (no client library).

Counters accumulate over the service's life; gauges are read when scraped.
Labels carry statuses, failure reasons, environments and tools: never an id,
a URL or a secret. Environments and tools are bounded: the first
``service.metrics_label_values`` of each seen get a label of their own, any
later one is ``other`` (first come rather than top N, so that no series ever
moves between labels and every counter only grows).
A cancelled rollout counts as ``status="cancelled"`` (``reason="cancelled"``), not
as failed.

Per rollout (from its result, on both executors): ``fleetroll_rollouts_total``,
``fleetroll_create_seconds`` (time to a ready instance) and
``fleetroll_instance_seconds_total``, by environment. Per tool call (from the
``fleet_tool_call`` events: :class:`Metrics` is an event sink of the service's
events, into which the Ray executor re-emits its actors' events too):
``fleetroll_tool_call_seconds`` by environment and tool.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping

from fleetroll.environments.admission import AdmissionState
from fleetroll.results import RolloutResult
from fleetroll.telemetry.events import Event

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Provisioning latency buckets, in seconds (a Fleet create takes 1 s to minutes).
PROVISION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
#: Tool call latency buckets, in seconds (a tool answers in milliseconds to minutes).
TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: The label of every environment or tool past the first ``label_values``.
OTHER = "other"


class Histogram:
    """One Prometheus histogram's buckets, count and sum (per label set)."""

    __slots__ = ("bounds", "buckets", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        i = bisect.bisect_left(self.bounds, seconds)
        if i < len(self.buckets):
            self.buckets[i] += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """Its samples; ``labels`` are ``k="v"`` pairs put before ``le``."""
        head = labels + "," if labels else ""
        out, cumulative = [], 0
        for bound, n in zip(self.bounds, self.buckets, strict=True):
            cumulative += n
            out.append(f'{name}_bucket{{{head}le="{bound:g}"}} {cumulative}')
        tail = f"{{{labels}}}" if labels else ""
        return [
            *out,
            f'{name}_bucket{{{head}le="+Inf"}} {self.count}',
            f"{name}_sum{tail} {self.sum:.6f}",
            f"{name}_count{tail} {self.count}",
        ]


class _Bounded:
    """Label values of one kind (environments, tools): the first ``n`` seen, then ``other``."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._known: set[str] = set()

    def __call__(self, value: object) -> str:
        text = str(value) if value is not None else ""
        if text in self._known:
            return text
        if len(self._known) < self._n:
            self._known.add(text)
            return text
        return OTHER


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """What the service has seen: rollouts by outcome and environment, provisioning
    and create latency, instance-seconds, tool call latency.

    An :class:`~fleetroll.telemetry.events.EventSink` too: given the service's
    events, it times every ``fleet_tool_call``.

    Args:
        label_values: environments (and, apart, tools) with a label of their
            own; any later one is ``other`` (``service.metrics_label_values``).
    """

    def __init__(self, label_values: int = 20) -> None:
        self.rollouts: Counter[tuple[str, str, str]] = Counter()
        self._provision = Histogram(PROVISION_BUCKETS)
        self._environment = _Bounded(label_values)
        self._tool = _Bounded(label_values)
        self._create: dict[str, Histogram] = {}
        self._instance_s: dict[str, float] = {}
        self._tools: dict[tuple[str, str], Histogram] = {}

    def observe(self, result: RolloutResult) -> None:
        """Count one finished rollout (batch or session)."""
        reason = result.failure_reason.value if result.failure_reason else ""
        environment = self._environment(result.env_key)
        # A cancelled rollout did not fail: its status is a state of its own.
        self.rollouts[(result.outcome, reason, environment)] += 1
        if result.instance_id is not None:  # it was provisioned: its latency counts
            seconds = result.timings.provision_s
            self._provision.observe(seconds)
            create = self._create.get(environment)
            if create is None:
                create = self._create[environment] = Histogram(PROVISION_BUCKETS)
            create.observe(seconds)
        self._instance_s[environment] = (
            self._instance_s.get(environment, 0.0) + result.cost.instance_s
        )

    def emit(self, event: Event) -> None:
        """Time a ``fleet_tool_call`` (other events are not this sink's)."""
        if event.name != "fleet_tool_call":
            return
        seconds = event.attributes.get("duration_s")
        if not isinstance(seconds, int | float):
            return
        key = (
            self._environment(event.attributes.get("env_key")),
            self._tool(event.attributes.get("tool_name")),
        )
        histogram = self._tools.get(key)
        if histogram is None:
            histogram = self._tools[key] = Histogram(TOOL_BUCKETS)
        histogram.observe(float(seconds))

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
            " cancelled), failure reason and environment.",
            "# TYPE fleetroll_rollouts_total counter",
        ]
        for (status, reason, env), n in sorted(self.rollouts.items()):
            lines.append(
                f'fleetroll_rollouts_total{{status="{status}",reason="{reason}",'
                f'environment="{_escape(env)}"}} {n}'
            )
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
        lines += self._provision.lines("fleetroll_provision_seconds")
        lines += [
            "# HELP fleetroll_create_seconds Time to a ready instance, by environment.",
            "# TYPE fleetroll_create_seconds histogram",
        ]
        for env, histogram in sorted(self._create.items()):
            lines += histogram.lines("fleetroll_create_seconds", f'environment="{_escape(env)}"')
        lines += [
            "# HELP fleetroll_instance_seconds_total Seconds instances were held"
            " (RolloutResult.cost.instance_s), by environment.",
            "# TYPE fleetroll_instance_seconds_total counter",
        ]
        for env, seconds in sorted(self._instance_s.items()):
            lines.append(
                f'fleetroll_instance_seconds_total{{environment="{_escape(env)}"}} {seconds:.6f}'
            )
        lines += [
            "# HELP fleetroll_tool_call_seconds Duration of a tool call, by environment and"
            " tool (fleet_tool_call; telemetry.tool_calls).",
            "# TYPE fleetroll_tool_call_seconds histogram",
        ]
        for (env, tool), histogram in sorted(self._tools.items()):
            labels = f'environment="{_escape(env)}",tool="{_escape(tool)}"'
            lines += histogram.lines("fleetroll_tool_call_seconds", labels)
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
