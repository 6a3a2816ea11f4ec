"""What the service refuses to run for whoever can reach it."""

from __future__ import annotations

from collections.abc import Sequence

from fleetroll.service.errors import ApiError
from fleetroll.tasks import TaskSpec

__all__ = ["refuse_host_commands"]


def refuse_host_commands(
    tasks: Sequence[TaskSpec], *, allowed: bool, loc: Sequence[str | int], indexed: bool = False
) -> None:
    """Refuse ``mcp`` tasks that run commands on this host, unless ``allowed``.

    Such a task (``environment.command``, ``environment.setup``,
    ``verifier.command``) runs its commands unsandboxed as the service's user:
    over HTTP, whoever holds the service token could run anything. The service
    takes them only with ``service.allow_command_tasks = true``.

    ``loc`` is where the tasks are in the request; with ``indexed``, a task's
    index in ``tasks`` is appended to it.

    Raises:
        ApiError: 422 naming the first such task.
    """
    if allowed:
        return
    for n, task in enumerate(tasks):
        env, verifier = task.environment, task.verifier
        if (env is not None and env.command is not None) or (
            verifier is not None and verifier.command is not None
        ):
            where = [*loc, n] if indexed else list(loc)
            raise ApiError(
                422,
                f"task {task.key!r} runs commands on the service's host (an mcp task's"
                " environment.command or verifier.command); this service refuses them"
                " (service.allow_command_tasks = false)",
                loc=where,
                type="task_error",
            )
