"""What a job returns: its results and how it ended."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fleetroll.results import RolloutResult

__all__ = ["JobReport"]


@dataclass(frozen=True, slots=True)
class JobReport:
    batch_id: str
    results: list[RolloutResult]  # every result of the batch, resumed ones included
    resumed: int
    elapsed_s: float
    interrupted: bool
    backend: str
    journal: Path | None = None
    #: Why the batch was stopped early (pool.stop_after_same_failures), if it was.
    stopped: str | None = None
    #: A run of steps (``batch_id`` is then the run's id): the steps that ran to their end.
    steps: int | None = None
