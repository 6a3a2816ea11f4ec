"""``fleetroll run --branch-at K --width W``: a rollout tree per task.

Each task's tree (:meth:`fleetroll.pool.rollout_pool.RolloutPool.run_tree`)
runs after the previous one, on the embedded emulator unless Fleet is
configured, in this process or on Ray actors. Results (each root, then its
branches) go to ``out`` as JSON Lines once its tree has ended; there is no
journal to resume from: a tree is re-run whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

from fleetroll.jobs.fleet import open_fleet, preflight_fleet
from fleetroll.pool.batch_pool import open_batch_pool
from fleetroll.pool.rollout_pool import Tree
from fleetroll.results import RolloutResult
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec

__all__ = ["run_tree_job", "tree_results"]


async def run_tree_job(
    settings: Settings,
    tasks: Sequence[TaskSpec],
    *,
    branch_at: int,
    width: int,
    out: Path | None,
    profile: str | None,
    preflight: bool,
    ray_address: str | None = None,
    ray_actors: int | None = None,
) -> list[Tree]:
    """One tree per task with the policy of ``settings``; the trees, in task order.

    Raises:
        FleetrollError: a failed pre-flight, an emulator that did not start.
    """
    from fleetroll.pool.assembly import policy_from_settings
    from fleetroll.telemetry import open_telemetry

    trees: list[Tree] = []
    async with (
        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events,
        AsyncExitStack() as stack,
    ):
        fleet = await open_fleet(stack, settings, profile)
        if preflight:
            await preflight_fleet(settings, fleet, tasks)
        pool, _ = await open_batch_pool(
            stack, settings, fleet, events, ray_address=ray_address, ray_actors=ray_actors
        )
        policy = policy_from_settings(settings)
        stack.push_async_callback(policy.aclose)
        if out is not None:  # a fresh file: a tree is re-run whole, never resumed
            await anyio.Path(out).write_text("", encoding="utf-8")
        for task in tasks:
            tree = await pool.run_tree(task, policy, branch_at=branch_at, width=width)
            trees.append(tree)
            if out is not None:
                lines = "".join(r.model_dump_json() + "\n" for r in tree_results([tree]))
                async with await anyio.open_file(out, "a", encoding="utf-8") as f:
                    await f.write(lines)
    return trees


def tree_results(trees: Sequence[Tree]) -> list[RolloutResult]:
    """Every result of ``trees``: each root, then its branches."""
    return [r for tree in trees for r in (tree.root, *tree.branches)]
