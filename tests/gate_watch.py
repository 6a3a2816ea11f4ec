"""Knowing, without polling, that a rollout's policy call has reached a paused gate.

``anyio.wait_all_tasks_blocked`` cannot tell: with a uvicorn server in the
loop (the emulator, the service) its asyncio version may never return. The
server's main loop sleeps 0.1 s between ticks and ``wait_all_tasks_blocked``
sleeps 0.1 s whenever it finds a task awake; once both timers fire in the same
loop iteration it finds the server's task awake at every look, and the two
stay in step until the test's ``fail_after`` (seen on a loaded machine).
"""

from __future__ import annotations

import anyio
import pytest

from fleetroll.policies.gate import PolicyGate


def paused_arrival(gate: PolicyGate, monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """An Event set when a policy call reaches ``gate`` while it is paused.

    The real :meth:`PolicyGate.admit` still decides, entered with no
    checkpoint after the Event is set: when a waiter on the Event runs, the
    rollout has either parked in the gate or, had the gate let it through,
    already called the policy (nothing awaits between the gate and ``act``).
    """
    arrived = anyio.Event()
    admit = gate.admit

    async def watched() -> tuple[int, float]:
        if gate.paused:
            arrived.set()
        return await admit()

    monkeypatch.setattr(gate, "admit", watched)
    return arrived
