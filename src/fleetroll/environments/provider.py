"""The environment-provider seam: where a rollout's environment lives.

A :class:`Provider` makes an :class:`Instance` for a task, resets it, says
where its MCP tools are and opens a session on them, runs the task's
verifier against it, and releases it. The rollout's state machine
(:mod:`fleetroll.rollout.machine`) only talks to this protocol; Fleet is one
implementation (:class:`fleetroll.environments.fleet.provider.FleetProvider`, the only
module of the core that imports the ``fleet`` SDK).

Contract for implementations:

* every method runs under its own deadline from the settings;
* :meth:`Provider.release` and :meth:`Provider.sweep` never raise, and are
  shielded from cancellation and bounded in time;
* :meth:`Provider.verify` never raises for a verifier's problems: they come
  back as a :class:`Verdict` without a reward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fleetroll.results import VerifierOutcome

if TYPE_CHECKING:
    from fleetroll.tasks import TaskSpec
    from fleetroll.tools.routing import Route
    from fleetroll.tools.session import ToolSession

__all__ = ["Instance", "Provider", "Verdict"]


@dataclass(frozen=True, slots=True)
class Instance:
    """An environment made for one rollout.

    Attributes:
        instance_id: the provider's id for it (in results and telemetry).
        attempts: create attempts it took.
        provision_s: seconds from the first attempt to ready.
        created_mono: ``time.monotonic()`` when it became ready.
        handle: the provider's own object; nothing else touches it.
        reset_required: whether the instance is in the task's start state
            only once :meth:`Provider.reset` succeeded (a shared server that
            keeps the last rollout's state): then a failed reset ends the
            rollout as ``reset_failed``, never scored. False (a Fleet
            instance, a server started for this rollout): it is fresh anyway,
            and a failed reset is only logged.
        placeholders: what this instance replaces in a task's ``solution``
            arguments (an ``mcp`` instance's ``{workdir}``...; none for Fleet):
            :meth:`fleetroll.tasks.TaskSpec.with_placeholders`.
        uses: the rollouts it has served, this one counted (1: made for it;
            more: reset and handed on, :mod:`fleetroll.environments.fleet.warm`).
    """

    instance_id: str
    attempts: int
    provision_s: float
    created_mono: float
    handle: object
    reset_required: bool = False
    placeholders: Mapping[str, str] = field(default_factory=dict)
    uses: int = 1


@dataclass(frozen=True, slots=True)
class Verdict:
    """A reward, or why there is none."""

    reward: float | None
    outcome: VerifierOutcome
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.reward is not None


class Provider(Protocol):
    """Makes, drives and releases the environments of rollouts."""

    async def preflight(self, tasks: Sequence[TaskSpec]) -> list[str]:
        """What would stop ``tasks`` from running here, checked before any create.

        One line per problem, for people (an unknown environment or version
        with what exists, a control plane that does not answer, a refused key);
        empty when the batch may run. Never raises for those problems, and
        never puts a secret in a line. Runs under ``timeouts.preflight_s``.
        """
        ...

    async def provision(self, task: TaskSpec, *, run_id: str | None = None) -> Instance:
        """A ready instance for ``task``, transient failures retried.

        Raises:
            ProvisionError: permanent failure, or the attempts or budget ran out.
        """
        ...

    async def reset(self, instance: Instance, task: TaskSpec) -> None:
        """Bring the instance back to ``task``'s start state, at the task's ``seed``
        and ``timestamp`` where the platform takes them (may raise; whether a
        failure is fatal is the instance's :attr:`Instance.reset_required`)."""
        ...

    def route(self, instance: Instance, task: TaskSpec) -> Route:
        """Where the rollout's tool calls go, and which tools it may see."""
        ...

    def open_tools(
        self, instance: Instance, route: Route
    ) -> AbstractAsyncContextManager[ToolSession]:
        """An MCP session on the route's endpoint, for the rollout's life.

        Raises:
            OperationTimeout: no connection within the connect deadline.
            ToolsError: a connection failure that retrying cannot fix.
        """
        ...

    async def verify(self, instance: Instance, task: TaskSpec, final_answer: str | None) -> Verdict:
        """Run the task's verifier against the instance; never raises for its problems."""
        ...

    async def is_alive(self, instance: Instance) -> bool:
        """Whether the instance still runs (presumed alive when it cannot be told)."""
        ...

    async def release(self, instance: Instance, *, reuse: bool = False) -> bool:
        """Give the instance back; whether that was confirmed. Never raises.

        ``reuse``: the rollout that held it ended without an infrastructure
        failure, so it may serve another rollout once reset (a provider that
        does not reuse instances releases it all the same).
        """
        ...

    async def sweep(self, run_id: str) -> int:
        """Release every instance still running under ``run_id``; never raises."""
        ...

    async def aclose(self) -> None:
        """Close what the provider holds (HTTP clients)."""
        ...
