"""A rollout's phases, the transitions allowed between them, and the view of a
rollout others may read.

The state machine that walks these phases is :class:`fleetroll.rollout.Rollout`;
import these names from :mod:`fleetroll.rollout` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from fleetroll.progress import RolloutIds
from fleetroll.results import RolloutResult

__all__ = ["NEXT", "Phase", "RolloutView"]


class Phase(StrEnum):
    PENDING = "pending"
    PROVISIONING = "provisioning"
    WAITING = "waiting"  # instance ready, waiting for an active slot
    RESETTING = "resetting"
    CONNECTING = "connecting"
    ACTING = "acting"
    VERIFYING = "verifying"
    RELEASING = "releasing"
    DONE = "done"


#: The transitions a rollout may take; anything else is a bug, caught at once.
#: VERIFYING follows any phase after the instance is ready (a rollout that
#: timed out or was abandoned is still scored); RELEASING follows any phase.
NEXT: Final[dict[Phase, frozenset[Phase]]] = {
    Phase.PENDING: frozenset({Phase.PROVISIONING, Phase.RELEASING, Phase.DONE}),
    Phase.PROVISIONING: frozenset({Phase.WAITING, Phase.RESETTING, Phase.RELEASING}),
    Phase.WAITING: frozenset({Phase.RESETTING, Phase.RELEASING}),
    Phase.RESETTING: frozenset({Phase.CONNECTING, Phase.VERIFYING, Phase.RELEASING}),
    Phase.CONNECTING: frozenset({Phase.ACTING, Phase.VERIFYING, Phase.RELEASING}),
    Phase.ACTING: frozenset({Phase.VERIFYING, Phase.RELEASING}),
    Phase.VERIFYING: frozenset({Phase.RELEASING}),
    # PROVISIONING again: a stale rollout restarted (pool.staleness_action).
    Phase.RELEASING: frozenset({Phase.DONE, Phase.PROVISIONING}),
    Phase.DONE: frozenset(),
}


@dataclass(frozen=True, slots=True)
class RolloutView:
    """A rollout as others may see it, running or ended: copies, redacted.

    The service and the MCP tools read rollouts only through this, never the
    live object's state.
    """

    ids: RolloutIds
    task_key: str
    phase: Phase
    steps: int
    #: The transcript so far, as a result would hold it (redacted, images elided);
    #: empty in a view asked for without messages (:meth:`Rollout.view`).
    messages: tuple[dict[str, Any], ...]
    #: Set once the rollout has ended.
    result: RolloutResult | None
