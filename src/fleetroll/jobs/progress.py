"""The progress model of a running batch: what it counts in each phase, and
when it is likely done (the CLI's live line shows it)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from fleetroll.pool.batch_pool import RunningBatch
from fleetroll.pool.rollout_pool import Batch
from fleetroll.rollout.machine import Phase

__all__ = ["Progress", "Watch", "eta_s"]

#: An unfinished rollout older than this many times the mean duration of the
#: finished ones is overdue: it may take any time yet (a hung create, a stuck
#: tool), so the ETA becomes a lower bound, or unknown when they dominate.
_OVERDUE_FACTOR = 2.0
#: Until this many rollout durations have passed, the batch is still filling its
#: slots and the completions so far say little about its pace (see :func:`eta_s`).
_RAMP_DURATIONS = 3.0


@dataclass(frozen=True, slots=True)
class Progress:
    """One look at a running batch, for the live line.

    ``acting`` counts rollouts holding an active slot (resetting, connecting,
    acting), at most ``pool.concurrency``; None when the pool cannot tell
    (Ray: the phases live in the actors), and then ``in_flight`` is all there is.
    """

    total: int
    done: int
    failed: int  # cancelled ones apart: they were not let finish
    cancelled: int = 0
    in_flight: int = 0  # started and not finished: every phase below
    queued: int = 0  # not started
    provisioning: int = 0  # creating an instance
    waiting: int = 0  # instance ready, waiting for an active slot
    acting: int | None = None
    finishing: int = 0  # verifying or releasing, slot given back
    concurrency: int = 0
    mean_s: float | None = None  # mean duration of the finished rollouts
    overdue: int = 0  # in flight for over _OVERDUE_FACTOR x mean_s
    age_s: float | None = None  # mean age of the rollouts in flight
    first_done_s: float | None = None  # seconds from the start to the first one finished

    @property
    def finished(self) -> int:
        return self.done + self.failed + self.cancelled


class Watch:
    """Looks at a batch now and then; remembers when each rollout started."""

    def __init__(self, batch: RunningBatch, concurrency: int, started: float = 0.0) -> None:
        self._batch = batch
        self._concurrency = concurrency
        self._started: dict[str, float] = {}
        self._since = started
        self._first_done: float | None = None

    def look(self, now: float) -> Progress:
        batch = self._batch
        if not isinstance(batch, Batch):
            c = batch.counts()
            return Progress(
                total=c.total,
                done=c.done,
                failed=c.failed,
                cancelled=c.cancelled,
                in_flight=c.running,
                queued=c.queued,
                first_done_s=self._first_seen(now, c.finished),
            )
        phases: Counter[Phase] = Counter()
        durations: list[float] = []
        ages: list[float] = []
        outcomes: Counter[str] = Counter()
        for rollout in batch.rollouts:
            result = rollout.result
            if result is not None:
                durations.append(result.timings.total_s)
                outcomes[result.outcome] += 1
                continue
            phases[rollout.phase] += 1
            if rollout.phase is not Phase.PENDING:
                ages.append(now - self._started.setdefault(rollout.ids.rollout_id, now))
        mean = statistics.fmean(durations) if durations else None
        return Progress(
            age_s=statistics.fmean(ages) if ages else None,
            first_done_s=self._first_seen(now, len(durations)),
            total=batch.total,
            done=outcomes["completed"],
            failed=outcomes["failed"],
            cancelled=outcomes["cancelled"],
            in_flight=len(ages),
            queued=phases[Phase.PENDING],
            provisioning=phases[Phase.PROVISIONING],
            waiting=phases[Phase.WAITING],
            acting=phases[Phase.RESETTING] + phases[Phase.CONNECTING] + phases[Phase.ACTING],
            finishing=phases[Phase.VERIFYING] + phases[Phase.RELEASING],
            concurrency=self._concurrency,
            mean_s=mean,
            overdue=0 if mean is None else sum(a > _OVERDUE_FACTOR * mean for a in ages),
        )

    def _first_seen(self, now: float, finished: int) -> float | None:
        if self._first_done is None and finished:
            self._first_done = now - self._since
        return self._first_done


def eta_s(p: Progress, elapsed: float) -> float | None:
    """Seconds until the batch is done, by the pace it keeps; None: no pace yet.

    While the batch fills its slots (before ``_RAMP_DURATIONS`` rollout
    durations have passed) the completions so far are the fastest few and
    the time before any could finish weighs on any rate taken from them, so
    the pace comes from Little's law instead: ``in_flight`` rollouts, each in
    flight for about ``w`` seconds, finish ``in_flight / w`` a second. ``w``
    is the mean duration of those finished, or the mean age of those in
    flight when that is longer (they have not finished yet). After that, the
    pace is the completions' rate since the first one.
    """
    left = p.total - p.finished
    if left <= 0:
        return 0.0
    if p.finished == 0 or elapsed <= 0:
        return None
    w = max(p.mean_s or 0.0, p.age_s or 0.0)
    if p.mean_s is not None and p.in_flight and elapsed < _RAMP_DURATIONS * w:
        return left * w / p.in_flight
    since = elapsed - (p.first_done_s or 0.0)
    rate = p.finished / since if since >= w and since > 0 else p.finished / elapsed
    return left / rate
