"""Stopping a batch early when its first rollouts all failed the same way
(``pool.stop_after_same_failures``): a wrong key or an unknown environment
fails every rollout, and the rest need not run to say so."""

from __future__ import annotations

import re

from fleetroll.results import FailureReason, RolloutResult

__all__ = ["SameFailures"]


#: Digits and hex ids vary between rollouts that failed the same way.
_VARYING = re.compile(r"\b[0-9a-f]{8,}\b|\d+(?:\.\d+)?")


class SameFailures:
    """Whether the first ``n`` rollouts to finish all failed the same way.

    The same way: unscored (``reward`` null), with the same ``failure_reason``
    and the same error text once numbers and hex ids are set aside. Cancelled
    rollouts never count (a cancel is not the batch's failure). ``n = 0``
    never says so.
    """

    def __init__(self, n: int) -> None:
        self._n = n
        self._seen = 0
        self._first: RolloutResult | None = None
        self._kind: tuple[str | None, str] | None = None
        self._same = True

    @staticmethod
    def _kind_of(result: RolloutResult) -> tuple[str | None, str]:
        reason = result.failure_reason.value if result.failure_reason else None
        return reason, _VARYING.sub("#", result.error or "")[:300]

    def add(self, result: RolloutResult) -> str | None:
        """Count one finished rollout; the reason to stop once the n-th makes it so."""
        if not self._n or self._seen >= self._n or result.failure_reason is FailureReason.CANCELLED:
            return None
        self._seen += 1
        kind = self._kind_of(result)
        if result.status != "failed" or result.reward is not None:
            self._same = False  # a scored rollout (max_steps, stale) is data, not a breakage
        elif self._first is None:
            self._first, self._kind = result, kind
        elif kind != self._kind:
            self._same = False
        if self._seen < self._n or not self._same or self._first is None:
            return None
        first = self._first
        reason = first.failure_reason.value if first.failure_reason else "failed"
        return (
            f"the first {self._n} rollouts to finish all failed with {reason}: {first.error}; "
            "the rest were cancelled (--resume runs them; "
            "pool.stop_after_same_failures = 0 runs a batch to its end regardless)"
        )
