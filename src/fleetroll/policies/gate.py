"""The trainer's hold on policy calls: which weights answer, and a pause.

An asynchronous RL trainer updates the policy's weights while rollouts run.
It tells fleetroll two things through one :class:`PolicyGate` per engine:

- the **policy version** (an int it bumps after each weight sync), recorded
  on every turn a rollout takes, so each token can be traced to the weights
  that produced it;
- a **pause** (:meth:`PolicyGate.paused`) while the weights are swapped: new
  policy calls wait until the last pause ends, while tool calls,
  provisioning and verification go on.

Example::

    async with pool.policy_paused():
        await trainer.sync_weights()
        pool.policy_version += 1

What a pause does depends on ``policy.weight_update`` (:attr:`PolicyGate.mode`):
``"pause"`` holds new calls, ``"abort"`` holds them too (the pool then aborts
the running ones on the servers, and each resumes once the pause ends:
:func:`current_gate` is how a policy waits for that), ``"in_flight"`` holds
nothing (it only marks that an update happened, so a call that spans one and
whose server reports no per-token versions is not credited to one version).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from typing import Literal

import anyio

__all__ = ["PolicyGate", "WeightUpdateMode", "current_gate", "gate_of_rollout"]

WeightUpdateMode = Literal["pause", "abort", "in_flight"]
_MODES = ("pause", "abort", "in_flight")

#: The gate of the rollout this task runs (set by the rollout around its policy calls).
_CURRENT: ContextVar[PolicyGate | None] = ContextVar("fleetroll_policy_gate", default=None)


def current_gate() -> PolicyGate | None:
    """The gate of the rollout whose policy call this is (None outside a rollout):
    an aborted call waits on it for the update to end before it resumes."""
    return _CURRENT.get()


@contextmanager
def gate_of_rollout(gate: PolicyGate) -> Iterator[None]:
    """Make ``gate`` the :func:`current_gate` for the block."""
    token = _CURRENT.set(gate)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class PolicyGate:
    """The current policy version and whether policy calls may start.

    Pauses nest: policy calls go on when the last one ends.

    Args:
        version: the version recorded on turns until the trainer sets another.
        mode: ``policy.weight_update``: what a pause does (see the module).
    """

    def __init__(self, version: int = 0, mode: WeightUpdateMode = "pause") -> None:
        if mode not in _MODES:
            raise ValueError(f"policy.weight_update is one of {', '.join(_MODES)}, not {mode!r}")
        self.mode: WeightUpdateMode = mode
        #: Weight updates begun so far (pauses entered, in any mode): a call that
        #: sees it change did not run on one version only.
        self.updates = 0
        self._version = version
        self._pauses = 0
        self._open = anyio.Event()
        self._open.set()
        self._changed = anyio.Event()
        #: Bumped at every change :meth:`changed` wakes on.
        self.generation = 0
        #: Policy calls :meth:`admit` let start so far.
        self.admitted = 0

    def __repr__(self) -> str:
        return f"PolicyGate(version={self._version}, paused={self.paused})"

    @property
    def version(self) -> int:
        """The version recorded on turns that start from now on."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"a policy version is an int, not {type(value).__name__}")
        self._version = value
        self._tell()

    @property
    def paused(self) -> bool:
        """Whether new policy calls wait."""
        return self._pauses > 0

    @asynccontextmanager
    async def paused_calls(self) -> AsyncIterator[None]:
        """Hold new policy calls for the duration of the block.

        Calls already running finish; calls that would start wait in
        :meth:`admit` until the last pause ends, even if the block raises or
        is cancelled. In ``in_flight`` mode nothing is held: the block only
        counts as an update (:attr:`updates`).
        """
        self.updates += 1
        if self.mode == "in_flight":
            self._tell()
            try:
                yield
            finally:
                self.updates += 1
                self._tell()
            return
        self._pauses += 1
        if self._pauses == 1:
            self._open = anyio.Event()
            self._tell()
        try:
            yield
        finally:
            self._pauses -= 1
            if self._pauses == 0:
                self._open.set()
                self._tell()

    async def changed(self) -> None:
        """Wait until the version changes or a pause begins or ends (a mirror's cue)."""
        await self._changed.wait()

    def _tell(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def admit(self) -> tuple[int, float]:
        """Wait until policy calls may start (when not :attr:`paused`, it returns
        without awaiting anything: callers rely on that).

        Returns:
            The policy version to record on the call, and the seconds spent
            waiting for a pause to end (not charged to the rollout's deadline).
        """
        if not self._pauses:
            self.admitted += 1
            return self._version, 0.0
        began = anyio.current_time()
        while self._pauses:
            await self._open.wait()
        self.admitted += 1
        return self._version, anyio.current_time() - began
