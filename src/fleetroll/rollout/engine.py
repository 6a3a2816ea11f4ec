"""What rollouts share: their configuration, the environment provider, telemetry.

:class:`RolloutEngine` makes rollouts (:mod:`fleetroll.rollout.machine`) and
env-style sessions (:mod:`fleetroll.rollout.env_session`) over one
:class:`fleetroll.environments.provider.Provider`. What they read of the
settings is a :class:`~fleetroll.rollout.config.RolloutConfig`, built where
things are assembled (the pool's executor).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio

from fleetroll.environments.admission import Admission
from fleetroll.environments.provider import Provider
from fleetroll.policies.gate import PolicyGate
from fleetroll.rollout.config import RolloutConfig
from fleetroll.rollout.env_session import EnvSession
from fleetroll.rollout.machine import Rollout, RolloutIds
from fleetroll.scoring import Judge, Scorer
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events, Redactor

__all__ = ["RolloutConfig", "RolloutEngine"]


class RolloutEngine:
    """What rollouts share: their configuration, the instance provider, telemetry, HTTP."""

    def __init__(
        self,
        config: RolloutConfig,
        provider: Provider,
        events: Events,
        admission: Admission | None = None,
        *,
        policy_gate: PolicyGate | None = None,
    ) -> None:
        self.config = config
        self.provider = provider
        self.events = events
        #: Told how each rollout ended (its environment's circuit breaker).
        self.admission = admission
        #: The policy version recorded on turns, and the trainer's pause on policy
        #: calls (a pool's, :mod:`fleetroll.pool.executor`).
        self.policy_gate = policy_gate or PolicyGate(mode=config.policy.weight_update)
        #: Telemetry's redactor, knowing ``config.secrets`` too; results go
        #: through it (an ``Events`` built without secrets knows none).
        self.redactor: Redactor = events.redactor.extended(config.secrets)
        #: The reward components of tasks' ``rewards``: one judge (its HTTP client,
        #: cache and limit) for every rollout; closed by :meth:`open`'s exit.
        self.scorer = Scorer(Judge(config.judge))

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: RolloutConfig,
        events: Events,
        provider: Provider,
        admission: Admission | None = None,
        *,
        policy_gate: PolicyGate | None = None,
    ) -> AsyncIterator[RolloutEngine]:
        """An engine over ``provider``, which it closes on exit."""
        engine = cls(config, provider, events, admission, policy_gate=policy_gate)
        try:
            yield engine
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await provider.aclose()
                finally:
                    with anyio.move_on_after(config.timeouts.release_s):
                        await engine.scorer.aclose()

    def rollout(
        self,
        task: TaskSpec,
        ids: RolloutIds,
        *,
        run_id: str | None = None,
        gate: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
        hold: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
    ) -> Rollout:
        """A rollout, not started. ``gate`` is entered once its instance is ready
        and held until it ends (the pool's limit on active rollouts); ``hold``
        around the whole of :meth:`Rollout.execute` (the limit on instances held)."""
        return Rollout(self, task, ids, run_id=run_id, gate=gate, hold=hold)

    @asynccontextmanager
    async def session(
        self,
        task: TaskSpec,
        ids: RolloutIds,
        *,
        run_id: str | None = None,
        gate: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
    ) -> AsyncIterator[EnvSession]:
        """An env-style session for a controller that drives the model itself.

        Raises:
            ToolsError, ProvisionError: the environment could not be set up;
                the result is still recorded on the returned rollout.
        """
        rollout = self.rollout(task, ids, run_id=run_id, gate=gate)
        async with rollout.lifecycle() as ready:
            if not ready:
                raise rollout.setup_error()
            env = EnvSession(rollout)
            yield env
            await env.close()
