"""What a test's rollout engine reads of its settings, as the pool's executor builds it."""

from __future__ import annotations

from fleetroll.rollout.engine import RolloutConfig
from fleetroll.scoring import JudgeConfig
from fleetroll.settings import Settings


def rollout_config(settings: Settings) -> RolloutConfig:
    """The :class:`RolloutConfig` that ``LocalExecutor`` gives its engine for ``settings``."""
    return RolloutConfig(
        timeouts=settings.timeouts,
        pool=settings.pool,
        policy=settings.policy,
        judge=JudgeConfig.from_section(
            settings.judge, api_key=settings.judge_api_key, budget=settings.retries.judge_budget
        ),
        secrets=settings.secrets(),
    )
