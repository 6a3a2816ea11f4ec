"""What rollouts read of the settings: :class:`RolloutConfig`.

Built where things are assembled (the pool's executor) and held by the
:class:`~fleetroll.rollout.engine.RolloutEngine` as ``engine.config``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetroll.scoring import JudgeConfig
from fleetroll.settings import PolicySettings, PoolSettings, TimeoutSettings

__all__ = ["RolloutConfig"]


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """What rollouts read of the settings: three sections, the judge, the secrets."""

    #: Deadlines: the rollout's, its policy calls', its resets', releases.
    timeouts: TimeoutSettings
    #: Steps, transcripts, tool failures, staleness, live events.
    pool: PoolSettings
    #: What a rollout reads of ``[policy]``: images kept, context limit, trajectory.
    policy: PolicySettings
    #: The judge of tasks' ``rewards``.
    judge: JudgeConfig
    #: Every secret of the settings (``Settings.secrets()``): redacted from results.
    secrets: tuple[str, ...] = ()
