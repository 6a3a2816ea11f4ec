"""Composite rewards: the components of a task's ``rewards`` and their sum.

The task form is :mod:`fleetroll.tasks.rewards`; here are what the components
read and the checks (:mod:`~fleetroll.scoring.checks`), the judge
(:mod:`~fleetroll.scoring.judge`), the weighted sum
(:mod:`~fleetroll.scoring.components`) and the re-scoring of stored results
(:mod:`~fleetroll.scoring.rescore`). A rollout scores through the
:class:`Scorer` of its engine, after its verifier.
"""

from __future__ import annotations

from fleetroll.scoring.checks import ScoreInputs
from fleetroll.scoring.components import Scored, Scorer, combine
from fleetroll.scoring.judge import Judge, JudgeConfig, Judgement

__all__ = ["Judge", "JudgeConfig", "Judgement", "ScoreInputs", "Scored", "Scorer", "combine"]
