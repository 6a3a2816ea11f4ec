"""Evaluation: pass@k per task, per environment and overall, and two evaluations compared.

:func:`evaluate` makes an :class:`EvalReport` of results (K samples per task);
:func:`compare` says which differences between two reports are beyond noise;
:mod:`fleetroll.evaluation.estimators` holds the statistics, in plain Python.
``RolloutPool.run_eval`` runs an evaluation on a pool, ``fleetroll eval`` on
the command line.
"""

from fleetroll.evaluation.compare import Comparison, compare
from fleetroll.evaluation.estimators import pass_at_k
from fleetroll.evaluation.markdown import comparison_markdown, report_markdown
from fleetroll.evaluation.report import (
    DEFAULT_SUCCESS_THRESHOLD,
    EvalReport,
    Summary,
    TaskScore,
    eval_batch,
    evaluate,
)

__all__ = [
    "DEFAULT_SUCCESS_THRESHOLD",
    "Comparison",
    "EvalReport",
    "Summary",
    "TaskScore",
    "compare",
    "comparison_markdown",
    "eval_batch",
    "evaluate",
    "pass_at_k",
    "report_markdown",
]
