"""A rollout's phases, the transitions allowed between them, and the view of a
rollout others may read.

The state machine that walks these phases is :class:`fleetroll.rollout.machine.Rollout`;
import these names from :mod:`fleetroll.rollout.machine` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from fleetroll._internal.utf8 import utf8_safe_value
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.progress import Progress, RolloutIds
from fleetroll.rollout.stages import RolloutContext

__all__ = ["NEXT", "Phase", "RolloutView", "crash_reason", "view_of"]


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


def crash_reason(phase: Phase) -> FailureReason:
    """The failure reason of an unexpected error (a bug) raised in ``phase``."""
    if phase in (Phase.PROVISIONING, Phase.RESETTING, Phase.CONNECTING):
        return FailureReason.INIT_ERROR
    if phase is Phase.VERIFYING:
        return FailureReason.VERIFIER_ERROR
    return FailureReason.TOOLS_ERROR


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


def view_of(
    ids: RolloutIds,
    task_key: str,
    phase: Phase,
    progress: Progress,
    result: RolloutResult | None,
    engine: RolloutContext,
    *,
    messages: bool = True,
) -> RolloutView:
    """The view of a rollout (see :meth:`fleetroll.rollout.machine.Rollout.view`).

    Once it has a result, the view copies the result's (already redacted)
    transcript and step count; before that, it exports the live transcript.
    """
    transcript: tuple[dict[str, Any], ...] = ()
    if messages and result is not None:
        transcript = tuple(result.transcript)
    elif messages:
        keep_images = engine.config.pool.transcript_images
        exported = progress.transcript.export(engine.redactor, keep_images=keep_images)
        # A lone surrogate (a model's text naming a file that is not UTF-8) escaped as
        # the journal escapes it: a reader's JSON must encode (the result, once built,
        # is result_error without a transcript: results.writable_result).
        transcript = tuple(utf8_safe_value(m) for m in exported)
    steps = progress.steps if result is None else result.steps
    return RolloutView(ids, task_key, phase, steps, transcript, result)
