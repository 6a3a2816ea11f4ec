"""A circuit breaker per environment version.

When the share of infrastructure failures of an environment version's last
``breaker.window`` rollouts reaches ``breaker.failure_share``, its breaker
opens: new rollouts of it wait (or end at once as ``env_unavailable``) while
one probe rollout at a time, ``breaker.probe_interval_s`` apart, tests its
recovery; the probe's success closes it. The admission controller
(:mod:`fleetroll.environments.admission.controller`) asks :class:`Breakers`
before it admits an instance, and tells it how each rollout ended.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetroll.errors import EnvUnavailableError
from fleetroll.results import FailureReason
from fleetroll.settings import BreakerSettings
from fleetroll.telemetry.events import Events

__all__ = ["INFRASTRUCTURE_FAILURES", "Breakers"]

#: Failures that say the environment, not the agent, went wrong (the breaker's input).
INFRASTRUCTURE_FAILURES = frozenset(
    {
        FailureReason.INIT_ERROR,
        FailureReason.TOOLS_ERROR,
        FailureReason.INSTANCE_LOST,
        FailureReason.VERIFIER_ERROR,
        FailureReason.RESET_FAILED,
    }
)
#: Ends that say nothing of the environment's health: not counted in the window.
_NO_VERDICT = frozenset(
    {FailureReason.CANCELLED, FailureReason.SUPERSEDED, FailureReason.ENV_UNAVAILABLE}
)


@dataclass(slots=True)
class _Breaker:
    outcomes: deque[bool]  # True: an infrastructure failure
    open: bool = False
    next_probe: float = 0.0
    probing: bool = False


class Breakers:
    """The breakers of one pool's environment versions (see the module's docstring).

    Args:
        settings: ``admission.breaker``.
        events: where ``fleet_env_quarantined`` and ``fleet_env_recovered`` go.
        clock: monotonic seconds (the probes' times).
    """

    def __init__(
        self,
        settings: BreakerSettings,
        events: Events,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._events = events
        self._clock = clock
        self._breakers: dict[str, _Breaker] = {}

    def wait_s(self, env: str) -> float | None:
        """How long a new rollout of ``env`` waits: 0 if it may go now (its
        breaker is closed, or open and its probe is due), seconds until its next
        probe, or None until a change (a probe is out).

        Raises:
            EnvUnavailableError: its breaker is open and ``breaker.on_open`` is ``"fail"``.
        """
        breaker = self._breakers.get(env)
        if breaker is None or not breaker.open:
            return 0.0
        due = breaker.next_probe - self._clock()
        if not breaker.probing and due <= 0:
            return 0.0
        if self._settings.on_open == "fail":
            raise EnvUnavailableError(
                f"environment {env} is quarantined: too many infrastructure "
                "failures (admission.breaker); a probe rollout tests its recovery",
                env=env,
            )
        return None if breaker.probing else due

    def is_open(self, env: str) -> bool:
        """``env``'s breaker is open (a rollout :meth:`wait_s` lets go is its probe)."""
        breaker = self._breakers.get(env)
        return breaker is not None and breaker.open

    def probing(self, env: str) -> None:
        """``env``'s probe was admitted: no other until its release."""
        self._breakers[env].probing = True

    def probe_released(self, env: str) -> None:
        """``env``'s probe's instance was released: the next probe, if this one's
        rollout did not close the breaker, after ``breaker.probe_interval_s``."""
        breaker = self._breakers.get(env)
        if breaker is not None and breaker.open:
            breaker.probing = False
            breaker.next_probe = self._clock() + self._settings.probe_interval_s

    def record(self, env: str, reason: FailureReason | None) -> bool:
        """One rollout of ``env`` ended with ``reason`` (None: completed); True if
        that closed its breaker (its waiting rollouts may go)."""
        b = self._settings
        if not b.enabled or reason in _NO_VERDICT:
            return False
        failed = reason in INFRASTRUCTURE_FAILURES
        breaker = self._breakers.get(env)
        if breaker is None:
            breaker = self._breakers[env] = _Breaker(deque(maxlen=b.window))
        breaker.outcomes.append(failed)
        if breaker.open:
            # A success (the probe's, typically) says it serves again; a
            # failure changes nothing (the probe's release set the next one).
            if failed:
                return False
            breaker.open = breaker.probing = False
            self._events.emit("fleet_env_recovered", **self._attributes(env, breaker))
            breaker.outcomes.clear()
            return True
        if len(breaker.outcomes) >= b.min_rollouts and self._share(breaker) >= b.failure_share:
            breaker.open = True
            breaker.probing = False
            breaker.next_probe = self._clock() + b.probe_interval_s
            self._events.emit(
                "fleet_env_quarantined", level="warn", **self._attributes(env, breaker)
            )
        return False

    @staticmethod
    def _share(breaker: _Breaker) -> float:
        n = len(breaker.outcomes)
        return sum(breaker.outcomes) / n if n else 0.0

    def _attributes(self, env: str, breaker: _Breaker) -> dict[str, Any]:
        key, _, version = env.partition(":")
        return {
            "env_key": key,
            "env_version": version or None,
            "failure_share": round(self._share(breaker), 4),
            "window": len(breaker.outcomes),
        }

    def quarantined(self) -> list[str]:
        """Environment versions whose breaker is open."""
        return sorted(env for env, b in self._breakers.items() if b.open)
