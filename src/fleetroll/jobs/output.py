"""Where a job's notices and progress go: the caller's (the CLI's console), or nowhere.

The engine says what it does in lines (a batch starts, a Ctrl-C is handled,
an early stop) and hands each running batch to be watched; how they are
shown is its caller's business.
"""

from __future__ import annotations

from typing import Protocol

from fleetroll.pool.batch_pool import RunningBatch

__all__ = ["JobOutput", "Quiet"]


class JobOutput(Protocol):
    """What a job says and shows while it runs."""

    def say(self, line: str) -> None:
        """One notice (``fleetroll: …``), as it happens."""
        ...

    async def watch(self, batch: RunningBatch, started: float) -> None:
        """Show ``batch``'s progress until it has finished (``started``: when its
        drive began, ``time.monotonic()``). Cancelled once the batch is driven to its end."""
        ...


class Quiet:
    """Says nothing, shows nothing (a job run from code: its report says it all)."""

    def say(self, line: str) -> None:
        pass

    async def watch(self, batch: RunningBatch, started: float) -> None:
        await batch.finished.wait()
