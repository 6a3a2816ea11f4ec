"""Admission, for any provider: which instance may be created, and when.

* :mod:`~fleetroll.environments.admission.creates`: the create gate (how many
  create requests at once and how many a second, learnt from the provider's
  answers);
* :mod:`~fleetroll.environments.admission.breakers`: a circuit breaker per
  environment version;
* :mod:`~fleetroll.environments.admission.controller`: the pool's admission
  controller (the create gate, instance caps, the provider's account limit,
  the breakers) and :class:`Admission`, what pools, providers and rollouts
  ask of it.

Nothing here knows a provider or imports an SDK: a provider reads its own
answers into the controller's signals (Fleet's:
:mod:`fleetroll.environments.fleet.admission`).
"""

from fleetroll.environments.admission.breakers import INFRASTRUCTURE_FAILURES, Breakers
from fleetroll.environments.admission.controller import (
    Admission,
    AdmissionController,
    AdmissionState,
    Ticket,
)
from fleetroll.environments.admission.creates import (
    CreateAnswer,
    CreateLimits,
    CreateRate,
    CreateSlots,
    ReadFailure,
    TokenBucket,
    answered,
)

__all__ = [
    "INFRASTRUCTURE_FAILURES",
    "Admission",
    "AdmissionController",
    "AdmissionState",
    "Breakers",
    "CreateAnswer",
    "CreateLimits",
    "CreateRate",
    "CreateSlots",
    "ReadFailure",
    "Ticket",
    "TokenBucket",
    "answered",
]
