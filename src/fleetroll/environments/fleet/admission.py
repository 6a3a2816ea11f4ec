"""Fleet's answers to creates, read as the admission controller's signals.

The controller (:mod:`fleetroll.environments.admission`) knows no provider:
:class:`~fleetroll.environments.fleet.provider.FleetProvider` hands it
:func:`read_create_error` with each create slot, which reads what a failed
create says of Fleet's load (a 429, a 503, a time-out, their ``Retry-After``),
and tells it Fleet's account limit (``account()``, a 403
``instance_limit_exceeded``) through ``learn_account`` and ``limit_reached``.

The controller's names are importable from here too, as they were when it
lived here.
"""

from __future__ import annotations

from fleet._async import exceptions as fleet_errors

from fleetroll.environments.admission import (
    INFRASTRUCTURE_FAILURES,
    Admission,
    AdmissionController,
    AdmissionState,
    CreateAnswer,
    CreateLimits,
    CreateRate,
    CreateSlots,
    Ticket,
    TokenBucket,
)
from fleetroll.environments.fleet.control import classify

__all__ = [
    "INFRASTRUCTURE_FAILURES",
    "Admission",
    "AdmissionController",
    "AdmissionState",
    "CreateAnswer",
    "CreateLimits",
    "CreateRate",
    "CreateSlots",
    "Ticket",
    "TokenBucket",
    "read_create_error",
]


def read_create_error(exc: Exception, elapsed_s: float) -> CreateAnswer:
    """What a create that raised ``exc`` after ``elapsed_s`` says of Fleet's load
    (the create gate's :data:`~fleetroll.environments.admission.creates.ReadFailure`):
    a time-out or a 504, a 429 or a 503 (with its ``Retry-After``) is pressure;
    anything else (a 400, a 403, a 500) says nothing of it."""
    verdict = classify(exc)
    status = verdict.status_code
    if isinstance(exc, TimeoutError | fleet_errors.FleetTimeoutError) or status == 504:
        return CreateAnswer(elapsed_s, "timeout")
    if status == 429:
        return CreateAnswer(elapsed_s, "throttled", verdict.retry_after_s)
    if status == 503:
        return CreateAnswer(elapsed_s, "unavailable", verdict.retry_after_s)
    return CreateAnswer(elapsed_s, neutral=True)
