"""Emitting events: one small API, base attributes from context variables.

Code that knows a rollout binds its base attributes once
(``with events.bind(rollout_id=..., task_key=...)``); every event emitted
inside carries them. Emitting is synchronous and cheap, so it needs no
shielding: a cancelled rollout still gets its ``fleet_rollout_completed``.
A failing sink is logged and skipped; it never breaks a rollout.

Every event name fleetroll emits is in :data:`EVENT_NAMES`, and
:meth:`Events.emit` refuses any other: a misspelt name fails the first test
that reaches it instead of silently starting a new series in the store.
The events, their attributes and when each is emitted: ``docs/telemetry.md``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, Protocol

from fleetroll._internal.utf8 import utf8_safe

__all__ = [
    "BASE_ATTRIBUTES",
    "EVENT_NAMES",
    "Event",
    "EventSink",
    "Events",
    "MemorySink",
    "Redactor",
]

Level = Literal["debug", "info", "warn", "error"]

#: Attributes every rollout event carries (``instance_id`` once known).
BASE_ATTRIBUTES = (
    "batch_id",
    "rollout_id",
    "task_key",
    "sample_index",
    "env_key",
    "env_version",
    "modality",
    "instance_id",
)

#: Every event name fleetroll emits (documented in docs/telemetry.md).
EVENT_NAMES: Final[frozenset[str]] = frozenset(
    {
        "fleet_job_started",
        "fleet_batch_started",
        "fleet_batch_completed",
        "fleet_rollout_started",
        "fleet_rollout_completed",
        "fleet_rollout_restarted",
        "fleet_make_retry",
        "fleet_retry",
        "fleet_make_failed",
        "fleet_create_abandoned",
        "fleet_create_rate",
        "fleet_provisioning_completed",
        "fleet_env_quarantined",
        "fleet_env_recovered",
        "fleet_env_created",
        "fleet_env_reset_failed",
        "fleet_tool_call",
        "fleet_tool_call_failed",
        "fleet_mcp_tool_error",
        "fleet_verifier_failed",
        "fleet_instance_released",
        "fleet_instance_recycled",
        "fleet_instance_release_failed",
        "fleet_env_close_failed",
        "fleet_worker_lost",
        "fleet_trace_upload_failed",
        "fleet_trace_dropped",
    }
)

_base: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "fleetroll_event_base", default=MappingProxyType({})
)
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Event:
    name: str
    level: Level
    attributes: Mapping[str, Any]
    timestamp: float = field(default_factory=time.time)


class EventSink(Protocol):
    def emit(self, event: Event) -> None:
        """Record one event. Must not block the event loop."""
        ...


class MemorySink:
    """Keeps events in a list: for tests, and for in-process inspection."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def named(self, name: str) -> list[Event]:
        return [e for e in self.events if e.name == name]


class Redactor:
    """Removes secrets from text and attribute values before they leave the process.

    Three nets, widest last: the known secrets (API keys and tokens from the
    settings) wherever they appear; credentials in well-known shapes
    (``Bearer``/``Basic`` headers, ``api_key=...``/``"token": "..."`` pairs,
    Logfire write tokens); and whole values of attributes whose *name* says
    they hold a credential (``authorization``, ``*api_key``, ``*token``,
    ``*secret``, ``*password``).
    """

    MASK = "[REDACTED]"
    _MASK_AFTER_GROUP_1 = r"\1[REDACTED]"
    # Each pattern keeps group 1 (what names the credential) and masks the rest.
    _PATTERNS = (
        # A whole Authorization header value, whatever its scheme.
        re.compile(
            r"(?i)\b((?:proxy-)?authorization\\?[\"']?\s*[:=]\s*\\?[\"']?)(?!\[REDACTED\])[^\r\n'\"\\]+"
        ),
        re.compile(r"(?i)\b(bearer\s+)[^\s'\",;]+"),
        re.compile(r"(?i)\b(basic\s+)[A-Za-z0-9+/]{8,}={0,2}"),
        # key=value, key: value, "key": "value"
        re.compile(
            r"(?i)\b((?:x-)?(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|refresh[_-]?token"
            r"|token|secret|password|passwd)\\?[\"']?\s*[:=]\s*\\?[\"']?)"
            r"(?!\[REDACTED\])[^\s'\",;&}\\]+"
        ),
        re.compile(r"()\bpylf_v\d+_[A-Za-z0-9_-]+"),  # Logfire write tokens
    )
    # Cheap first pass, on the lower-cased text (a case-insensitive alternation is
    # five times slower): most strings (ids, env keys) contain none of these words.
    _HINT = re.compile(r"bearer|basic|authori|key|token|secret|passw|pylf_")
    _SENSITIVE_NAME = re.compile(
        r"(?i)^(?:(?:proxy[_-])?authorization|cookie|.*api[_-]?key|.*token|.*secret|.*password)$"
    )

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def extended(self, secrets: Iterable[str | None]) -> Redactor:
        """A redactor that also knows ``secrets``."""
        return Redactor([*self._secrets, *secrets])

    # Where a text may be cut without cutting any match of _PATTERNS, for
    # in_pieces: their only parts that cross whitespace are whitespace runs
    # after a keyword, a quote, a backslash, ':' or '=', and an Authorization
    # value (which stops at a newline, a quote or a backslash). So: a newline
    # after punctuation; a quote ending no prefix (after none of those) before a
    # comma; and, in a text that names no Authorization, any whitespace after
    # none of them. Each cut is where its group 1 ends.
    _CUT = re.compile(r'([.,;!?)\]}>])\n|([^\s:=\\"\']")(?=,)')
    _CUT_AT_WHITESPACE = re.compile(
        r"(?i)([^\s:=\\\"'])(?<!key)(?<!token)(?<!secret)(?<!password)(?<!passwd)"
        r"(?<!bearer)(?<!basic)(?=\s)"
    )
    _PIECE = 256 * 1024

    def __call__(self, text: str) -> str:
        text = self._known(text)
        if self._HINT.search(text.lower()):
            text = self._patterns(text)
        return text

    def _known(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, self.MASK)
        return text

    def _patterns(self, text: str) -> str:
        for pattern in self._PATTERNS:
            text = pattern.sub(self._MASK_AFTER_GROUP_1, text)
        return text

    def in_pieces(self, text: str) -> str:
        """The same as ``self(text)``, its patterns run on pieces of about 256 KiB.

        For a worker thread: one regex over MBs holds the GIL for seconds (the
        event loop with it), a piece for milliseconds. The pieces are cut where
        no match of a pattern can span (``_CUT``); the known secrets are
        replaced in the whole text first (one C call each).
        """
        text = self._known(text)
        lowered = text.lower()
        if not self._HINT.search(lowered):
            return text
        cuts = [self._CUT]
        if "authori" not in lowered:
            cuts.append(self._CUT_AT_WHITESPACE)
        pieces, start, at = [], 0, self._PIECE
        while at < len(text):
            # One window at a time, each looked at once: linear even with no cut.
            window = at + self._PIECE
            found = [m for cut in cuts if (m := cut.search(text, at, window))]
            if not found:
                at = window
                continue
            end = min(m.end(1) if m.group(1) else m.end(2) for m in found)
            pieces.append(self._patterns(text[start:end]))
            start, at = end, end + self._PIECE
        pieces.append(self._patterns(text[start:]))
        return "".join(pieces)

    def value(self, value: Any) -> Any:
        """``value`` with every string inside it redacted (mappings and sequences too),
        a lone surrogate written as its escape (:func:`~fleetroll._internal.utf8.utf8_safe`):
        UTF-8 cannot encode it, so the store would lose the event (and its batch of
        rows) and Logfire its export."""
        if isinstance(value, str):
            return utf8_safe(self(value))
        if isinstance(value, Mapping):
            return self.attributes(value)
        if isinstance(value, list | tuple | set | frozenset):
            return [self.value(v) for v in value]
        return value

    def attributes(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        """A redacted copy; a credential-named key keeps only the mask (or None).

        Strings as :meth:`value` makes them (a lone surrogate escaped)."""
        out: dict[str, Any] = {}
        for key, value in attributes.items():
            if isinstance(value, str):
                out[key] = self.MASK if _sensitive_name(str(key)) else utf8_safe(self(value))
            elif value is None or isinstance(value, int | float):
                out[key] = value
            else:
                out[key] = self.MASK if _sensitive_name(str(key)) else self.value(value)
        return out


@functools.lru_cache(maxsize=1024)
def _sensitive_name(key: str) -> bool:
    return Redactor._SENSITIVE_NAME.match(key) is not None


class Events:
    """The one way fleetroll emits telemetry events."""

    def __init__(
        self,
        sinks: Sequence[EventSink] = (),
        redactor: Redactor | None = None,
        *,
        off: Iterable[str] = (),
    ) -> None:
        """``off``: event names not recorded (see :meth:`enabled`), e.g. ``fleet_tool_call``
        when ``telemetry.tool_calls`` is false."""
        self._sinks = list(sinks)
        self._redact = redactor or Redactor()
        self._off = frozenset(off)
        unknown = sorted(self._off - EVENT_NAMES)
        if unknown:
            raise ValueError(f"unknown telemetry events to turn off: {', '.join(unknown)}")

    def enabled(self, name: str) -> bool:
        """Whether ``name`` is recorded: the caller of a frequent event skips building it."""
        return name not in self._off

    @property
    def sinks(self) -> tuple[EventSink, ...]:
        """Where every event goes, in order."""
        return tuple(self._sinks)

    @property
    def redactor(self) -> Redactor:
        """What every event goes through; use it for anything else leaving the process."""
        return self._redact

    @staticmethod
    def bound() -> dict[str, Any]:
        """The base attributes bound in this context (what every event here carries)."""
        return dict(_base.get())

    @staticmethod
    @contextmanager
    def bind(**attributes: Any) -> Iterator[None]:
        """Add base attributes to every event emitted in this context."""
        token = _base.set({**_base.get(), **attributes})
        try:
            yield
        finally:
            _base.reset(token)

    def emit(self, name: str, *, level: Level = "info", **attributes: Any) -> Event:
        """Send one event, with the bound base attributes, redacted, to every sink.

        Raises:
            ValueError: ``name`` is not in :data:`EVENT_NAMES` (a typo, or a
                new event not registered and documented yet).
        """
        if name not in EVENT_NAMES:
            raise ValueError(
                f"unknown telemetry event {name!r}: add it to EVENT_NAMES in "
                "fleetroll/telemetry/events.py and document it in docs/telemetry.md"
            )
        attrs = self._redact.attributes({**_base.get(), **attributes})
        event = Event(name, level, attrs)
        if name in self._off:
            return event
        for sink in self._sinks:
            try:
                sink.emit(event)
            except Exception:  # a broken sink must not break a rollout
                _log.exception("telemetry sink %r failed on %s", sink, name)
        return event
