"""Knowing, without polling, that the in-process emulator's ledger (or anything
else that calls :meth:`Changes.wake`) has changed: a test waits on a condition
re-read at every change, bounded by the test's own ``fail_after``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from fleetroll.emulator.ledger import Ledger
from fleetroll.telemetry import Event


class Changes:
    """Wakes its waiters at every change of an emulator's ledger, and at every
    event of the :class:`~fleetroll.telemetry.Events` it is a sink of."""

    def __init__(self, ledger: Ledger) -> None:
        self._changed = anyio.Event()
        for name in ("create_started", "create_finished", "instance_started", "instance_ended"):
            setattr(ledger, name, self._waking(getattr(ledger, name)))

    def _waking(self, method: Callable[..., None]) -> Callable[..., None]:
        def changed(*args: Any) -> None:
            method(*args)
            self.wake()

        return changed

    def wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def emit(self, event: Event) -> None:  # an EventSink
        self.wake()

    async def until(self, condition: Callable[[], Awaitable[bool]]) -> None:
        """Return once ``condition()`` holds, read again at each change."""
        while True:
            changed = self._changed  # a change while the condition is read wakes it too
            if await condition():
                return
            await changed.wait()


def creates_sent(ledger: Ledger) -> int:
    """Creates the emulator received (ended or at work)."""
    return sum(ledger.creates_by_outcome.values()) + ledger.snapshot()["creates_in_flight"]
