"""stamina's retry hooks: to :mod:`logging` at debug, never a line on stdout.

stamina's default hooks log each scheduled retry through structlog's
*default* configuration, which prints to stdout (or, without structlog,
through logging at warning). A Python program that uses fleetroll as a
library would get a line on its stdout per retry; every retry is already
counted in telemetry (``fleet_retry``) and in results. So wherever
fleetroll retries, it first swaps those two default hooks for one that logs
on the ``fleetroll.retries`` logger at debug. Other hooks (Prometheus, or
any a program installed itself) are kept.

:func:`retry_emitter` turns :class:`fleetroll.retrying.Retry` reports into
``fleet_retry`` events: one per retry of every operation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

import stamina.instrumentation
from stamina.instrumentation import RetryDetails, RetryHook

if TYPE_CHECKING:
    from fleetroll.retrying import Report, Retry
    from fleetroll.telemetry.events import Events

__all__ = ["log_retry", "retry_emitter", "route_retries_to_logging"]

#: How much of an error's text goes into ``error_message``.
_MESSAGE_CHARS: Final = 500

_log = logging.getLogger("fleetroll.retries")

#: Modules of stamina's own console hooks (structlog's default config: stdout).
_CONSOLE_HOOK_MODULES: Final = frozenset(
    {"stamina.instrumentation._structlog", "stamina.instrumentation._logging"}
)


def log_retry(details: RetryDetails) -> None:
    """A stamina retry hook: one debug record on ``fleetroll.retries``."""
    _log.debug(
        "retry %d of %s in %.2f s after %s",
        details.retry_num,
        details.name,
        details.wait_for,
        type(details.caused_by).__name__,
    )


def route_retries_to_logging() -> None:
    """Replace stamina's default console hooks with :func:`log_retry`; keep the others.

    Cheap and idempotent: call it before each ``stamina.retry_context``.
    """
    hooks = stamina.instrumentation.get_on_retry_hooks()
    kept: list[RetryHook] = [
        hook for hook in hooks if getattr(hook, "__module__", "") not in _CONSOLE_HOOK_MODULES
    ]
    if log_retry not in kept:
        kept.append(log_retry)
    if tuple(kept) != hooks:
        stamina.instrumentation.set_on_retry_hooks(kept)


def retry_emitter(events: Events) -> Report:
    """A :data:`fleetroll.retrying.Report` that emits ``fleet_retry`` on ``events``.

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
