"""Staleness: how far a rollout may fall behind the trainer's policy.

An asynchronous RL trainer bumps the policy version after each weight sync
(:attr:`fleetroll.pool.rollout_pool.RolloutPool.policy_version`). A rollout whose first
policy call used a version more than ``pool.max_staleness`` behind the
current one when it ends is *stale*: it ends as ``stale`` (no reward), or,
with ``pool.staleness_action = "restart"``, runs again from scratch on a
fresh instance (:meth:`fleetroll.rollout.machine.Rollout.run`), at most
``pool.max_stale_restarts`` times.
"""

from __future__ import annotations

from fleetroll.environments.provider import Instance
from fleetroll.results import SCORED_REASONS, FailureReason
from fleetroll.rollout.progress import Progress
from fleetroll.telemetry.events import Events

__all__ = ["check", "report_restart"]


def check(progress: Progress, limit: int | None, now: int, *, may_restart: bool) -> bool:
    """Flag a rollout whose first policy call is more than ``limit`` versions behind ``now``.

    Only a rollout the verifier would score can be stale. Returns whether to
    restart it instead (``may_restart``); otherwise a stale rollout's failure
    becomes ``stale`` (overriding the reason it had ended with).
    """
    p = progress
    first = p.first_policy_version
    if limit is None or first is None:
        return False
    if p.reason is not None and p.reason not in SCORED_REASONS:
        return False
    if now - first <= limit:
        return False
    if may_restart:
        return True
    ended = f"; it had ended as {p.reason.value}" if p.reason is not None else ""
    p.fail(
        FailureReason.STALE,
        f"the rollout's first policy call used policy version {first}, {now - first} versions"
        f" behind version {now} (pool.max_staleness = {limit}){ended}",
        force=True,
    )
    return False


def report_restart(
    events: Events,
    instance: Instance | None,
    *,
    restarts: int,
    first_policy_version: int | None,
    policy_version: int,
) -> None:
    """Emit ``fleet_rollout_restarted``: a stale attempt was dropped for a fresh one."""
    events.emit(
        "fleet_rollout_restarted",
        level="warn",
        instance_id=instance.instance_id if instance else None,
        restarts=restarts,
        first_policy_version=first_policy_version,
        policy_version=policy_version,
    )
