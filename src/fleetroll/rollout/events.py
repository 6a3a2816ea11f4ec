"""A rollout's live events: a bounded, resumable log of what it is doing.

Each :class:`~fleetroll.rollout.machine.Rollout` keeps one :class:`RolloutEventLog`
(``rollout.live``). It records, in order:

* ``phase``: every change of phase (from the rollout's observers);
* ``turn``: each policy turn, with its latency and a preview of its text;
* ``tool_call``: each tool call, with its duration and previews of its
  arguments and answer;
* ``end``: the result's status, failure reason, reward and error (always
  the last event).

Every event has a cursor (``seq``, from 1); a reader resumes with
``read(after=seq)``. The log holds at most ``pool.events_max`` events (the
oldest go first; a reader that fell behind is told how many it missed) and
previews are cut to ``pool.events_preview_chars`` after redaction, so its
memory is bounded; it is forgotten with its rollout (and so with its batch).
Previews pass through the same redactor as results.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from fleetroll._internal.utf8 import utf8_safe
from fleetroll.policies import AssistantTurn, ToolCall
from fleetroll.results import RolloutResult
from fleetroll.tools.session import ToolResult

__all__ = ["EventPage", "RolloutEvent", "RolloutEventLog", "ended_page", "ndjson_lines"]

#: Longer than any secret the redactor knows by value (API keys and tokens from
#: the settings); credentials it finds by shape are masked even when cut short.
_SECRET_SPAN = 1024


@dataclass(frozen=True, slots=True)
class RolloutEvent:
    """One thing a rollout did. ``t_s``: seconds since the rollout was created."""

    seq: int
    kind: str
    t_s: float
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "t_s": round(self.t_s, 6), **self.data}


@dataclass(frozen=True, slots=True)
class EventPage:
    """What :meth:`RolloutEventLog.read` answers.

    ``missed``: events after the cursor that the log no longer holds (it is
    bounded); ``ended``: the ``end`` event is among those the log holds;
    ``from_result``: the log is gone and the page was built from the result
    alone (:func:`ended_page`), so its cursor says nothing of the log's.
    """

    events: tuple[RolloutEvent, ...]
    missed: int
    ended: bool
    from_result: bool = False


class RolloutEventLog:
    """The bounded event log of one rollout (see the module docstring)."""

    def __init__(self, *, cap: int, preview_chars: int, redact: Callable[[str], str]) -> None:
        # Made at the first event: a batch's waiting rollouts have none yet.
        self._events: deque[RolloutEvent] | tuple[()] = ()
        self._cap = cap
        self._preview_chars = preview_chars
        self._redact = redact
        self._seq = 0
        self._started = time.monotonic()
        self._phase: str | None = None
        self._changed: anyio.Event | None = None  # made by the first waiter
        self.ended = False

    @property
    def last(self) -> int:
        """The cursor of the newest event (0: none yet)."""
        return self._seq

    def read(self, after: int = 0) -> EventPage:
        """The events after cursor ``after`` that the log still holds."""
        events = tuple(e for e in self._events if e.seq > after)
        first = events[0].seq if events else self._seq + 1
        return EventPage(events, missed=max(0, first - after - 1), ended=self.ended)

    async def wait(self, after: int) -> None:
        """Return once the log holds an event after cursor ``after`` (or has ended)."""
        while self._seq <= after and not self.ended:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    # -- recording (the rollout's own task) ---------------------------------

    def observe(self, rollout: Any) -> None:
        """A rollout observer: records a ``phase`` event when its phase changed."""
        phase = str(rollout.phase)
        if phase != self._phase:
            self._phase = phase
            self._add("phase", {"phase": phase})

    def turn(self, turn: AssistantTurn, *, latency_s: float, policy_version: int) -> None:
        self._add(
            "turn",
            {
                "latency_s": round(latency_s, 6),
                "policy_version": policy_version,
                "tool_calls": [utf8_safe(c.name) for c in turn.tool_calls],
                "preview": self._preview(turn.content or ""),
            },
        )

    def tool_call(self, call: ToolCall, result: ToolResult, *, duration_s: float) -> None:
        self._add(
            "tool_call",
            {
                "name": utf8_safe(call.name),
                "duration_s": round(duration_s, 6),
                "is_error": result.is_error,
                "arguments": self._preview(json.dumps(call.arguments, default=str)),
                "preview": self._preview(result.text),
            },
        )

    def end(self, result: RolloutResult) -> None:
        if self.ended:
            return
        self._add("end", _end_data(result, self._preview))
        self.ended = True
        self._wake()

    async def page(self, after: int, wait_s: float) -> EventPage:
        """The events after cursor ``after``, waiting up to ``wait_s`` for one."""
        with anyio.move_on_after(wait_s):
            await self.wait(after)
        return self.read(after)

    def _preview(self, text: str) -> str:
        # Redact, then cut: cutting first could split a secret and hide it from the
        # redactor. Only the head is redacted (a tool's answer may be a large page,
        # and redaction runs on the loop): any secret that starts inside the
        # preview ends inside the head, and the patterns mask a value cut short.
        # A lone surrogate (a file name that is not UTF-8) is written as its escape,
        # as the journal writes it: the events' NDJSON must encode.
        clean = utf8_safe(self._redact(text[: self._preview_chars + _SECRET_SPAN]))
        if len(clean) <= self._preview_chars:
            return clean
        return clean[: self._preview_chars] + "…"

    def _add(self, kind: str, data: Mapping[str, Any]) -> None:
        if self.ended:
            return
        self._seq += 1
        if not self._events:
            self._events = deque(maxlen=self._cap)
        assert isinstance(self._events, deque)
        self._events.append(RolloutEvent(self._seq, kind, time.monotonic() - self._started, data))
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None


def ended_page(after: int, result: RolloutResult) -> EventPage:
    """The end of a rollout whose log is gone (it ran on a Ray actor that let it go).

    Its ``end`` event, from the result alone, after cursor ``after``; the
    events in between (if any) are lost, which ``missed`` cannot say.
    """
    end = RolloutEvent(after + 1, "end", result.timings.total_s, _end_data(result, str))
    return EventPage((end,), missed=0, ended=True, from_result=True)


def _end_data(result: RolloutResult, preview: Callable[[str], str]) -> dict[str, Any]:
    # The result's error is redacted already; the preview only cuts it.
    return {
        "status": result.status,
        "failure_reason": result.failure_reason.value if result.failure_reason else None,
        "reward": result.reward,
        "error": preview(result.error) if result.error else None,
    }


async def ndjson_lines(
    read: Callable[[int, float], Awaitable[EventPage]],
    after: int,
    *,
    heartbeat_s: float,
    stopping: Callable[[], bool],
) -> AsyncIterator[bytes]:
    """NDJSON lines of the events after cursor ``after``, as the results stream's.

    ``{"type":"event","cursor":N,"event":{...}}`` per event; a ``gap`` line
    (``missed``: how many) when the log let events after the cursor go; a
    heartbeat while nothing happens for ``heartbeat_s``; the stream ends after
    the ``end`` event. ``stopping()`` (the server is shutting down) ends it
    without the end, so the client knows to reconnect.

    ``read(after, wait_s)`` answers the events after a cursor, waiting up to
    ``wait_s`` for one (:meth:`RolloutEventLog.page`, or a batch's ``events``).
    """
    cursor = after
    while True:
        page = await read(cursor, heartbeat_s)
        lines = []
        if page.missed:
            lines.append(_line({"type": "gap", "cursor": cursor, "missed": page.missed}))
        for event in page.events:
            lines.append(_line({"type": "event", "cursor": event.seq, "event": event.to_json()}))
            cursor = event.seq
        if not lines and not page.ended:
            lines.append(_line({"type": "heartbeat", "cursor": cursor}))
        if lines:
            yield "".join(lines).encode()
        if page.ended or stopping():
            return


def _line(message: Mapping[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False) + "\n"
