"""Driving a job's batches: one at a time, each result journaled and kept, its
progress watched, the job stopped early when its first rollouts all failed the
same way or its journal cannot be written; and the signals that interrupt it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from types import TracebackType

import anyio
from anyio.abc import TaskGroup

from fleetroll._internal.exit_stack import exit_transparently
from fleetroll.jobs.output import JobOutput
from fleetroll.jobs.same_failures import SameFailures
from fleetroll.pool.batch_pool import RunningBatch
from fleetroll.pool.journal import Journal
from fleetroll.results import RolloutResult

__all__ = ["Background", "Current", "Drive", "watch_signals"]


class Current:
    """The batch running now, for the signal watcher (a run of steps has many)."""

    batch: RunningBatch | None = None


class Drive:
    """Runs batches of a job one at a time: journals and keeps their results,
    has their progress watched, and stops the job early when its first rollouts
    all failed the same way (``stop_after_same_failures`` of them)."""

    def __init__(
        self,
        journal: Journal | None,
        results: list[RolloutResult],
        output: JobOutput,
        stop_after_same_failures: int,
        journal_failed: anyio.Event | None = None,
    ) -> None:
        self.journal = journal
        self.journal_failed = journal_failed
        self.results = results
        self.output = output
        self.same = SameFailures(stop_after_same_failures)
        self.stopped: str | None = None

    async def batch(
        self,
        batch: RunningBatch,
        *,
        step: int | None = None,
        before: Sequence[RolloutResult] = (),
    ) -> list[RolloutResult]:
        """Drive ``batch`` to its end; its results, ``before`` (a resume's) first."""
        ended = list(before)
        async with Background() as foreground:
            foreground.start_soon(self.output.watch, batch, time.monotonic())
            if self.journal is not None and self.journal_failed is not None:
                foreground.start_soon(self._stop_when_the_journal_fails, batch)
            async for result in batch:
                if step is not None:
                    result = result.model_copy(update={"step": step})
                if self.journal:
                    result = self.journal.append(result)  # as journaled (result_error)
                self.results.append(result)
                ended.append(result)
                if self.stopped is None and (stopped := self.same.add(result)) is not None:
                    self.stopped = stopped
                    self.output.say(f"fleetroll: stopping the batch early: {stopped}")
                    batch.cancel()  # the rest still deliver their (cancelled) results
        return ended

    async def _stop_when_the_journal_fails(self, batch: RunningBatch) -> None:
        """A failed journal write stops the batch: what it runs now could not be kept."""
        assert self.journal is not None and self.journal_failed is not None
        await self.journal_failed.wait()
        if self.stopped is None:
            self.stopped = f"the journal {self.journal.path} cannot be written"
        self.output.say(
            f"fleetroll: writing the journal {self.journal.path} failed"
            f" ({_strerror(self.journal.error)}): stopping the batch"
        )
        batch.cancel()


def _strerror(error: OSError | None) -> str:
    return "" if error is None else error.strerror or str(error)


async def watch_signals(
    signals: AsyncIterator[int],
    current: Current,
    interrupted: anyio.Event,
    output: JobOutput,
    release_s: float,
) -> None:
    """First SIGINT/SIGTERM: cancel the batch. Later ones: say what is left to do
    (``release_s``: the bound on each release, ``timeouts.release_s``).

    Never a ``KeyboardInterrupt``: that would stop a rollout's release or the
    journal's last write half-way.
    """
    async for _ in signals:
        if not interrupted.is_set():
            interrupted.set()
            output.say(
                "fleetroll: interrupted: cancelling unfinished rollouts and releasing "
                "their instances (their results are journaled as cancelled)"
            )
            if current.batch is not None:
                await current.batch.aclose()
        else:
            output.say(
                "fleetroll: already stopping: instances still held are being released "
                f"(each within {release_s:g} s) and every result "
                "delivered is being journaled"
            )


class Background:
    """A task group whose tasks live as long as its block, cancelled when it ends.

    An exception of the block itself leaves as it was raised, not in a group.
    """

    async def __aenter__(self) -> TaskGroup:
        self._stack = AsyncExitStack()
        tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(tg.cancel_scope.cancel)
        return tg

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await exit_transparently(self._stack, exc_type, exc, tb)
