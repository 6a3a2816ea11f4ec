"""Retries in telemetry.

:func:`retry_emitter` turns :class:`fleetroll._internal.retrying.Retry` reports into
``fleet_retry`` events: one per retry of every operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from fleetroll._internal.retrying import Report, Retry
    from fleetroll.telemetry.events import Events

__all__ = ["retry_emitter"]

#: How much of an error's text goes into ``error_message``.
_MESSAGE_CHARS: Final = 500


def retry_emitter(events: Events) -> Report:
    """A :data:`fleetroll._internal.retrying.Report` that emits ``fleet_retry`` on ``events``.

    The event carries the base attributes bound where the retry happens (a
    rollout's ids) and is redacted like every event.
    """

    def report(retry: Retry) -> None:
        events.emit(
            "fleet_retry",
            level="debug",
            operation=retry.operation,
            attempt=retry.attempt,
            error_type=type(retry.cause).__name__,
            error_message=str(retry.cause)[:_MESSAGE_CHARS],
            status_code=retry.decision.status_code,
            retry_delay_s=round(retry.delay_s, 3),
        )

    return report
