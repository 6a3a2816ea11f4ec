"""The SQLite functions and aggregates that SQL translated by :mod:`.dialect` calls.

:func:`install` registers them on a connection: timestamps as the store's ISO
8601 text (``fr_ts``, ``fr_date_trunc``, ``fr_date_bin``...), ``extract``,
``regexp``, percentiles, variance/stddev and ``array_agg``. Moved out of
``dialect.py`` to keep modules short; ``fleetroll.telemetry.dialect`` re-exports
:func:`install` and the ``fr_*`` functions as before.

None of them may hurt the process that runs the query (the service answers
``/healthz`` and runs rollouts beside it):

- ``~`` (SQLite's ``REGEXP``) runs RE2, which matches in time linear in the
  text and releases the GIL while it matches; Python's ``re`` backtracks, and
  one backtracking pattern held the GIL, and so the whole service, for as
  long as it liked. RE2's syntax is the one Logfire's engine (Rust's
  ``regex``) takes: no backreferences, no lookaround.
- the aggregates computed here (percentiles, ``array_agg``) count the bytes
  they hold against one budget per query (``service.query_max_bytes``) and
  fail with a clear message past it, rather than growing without bound.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sqlite3
from array import array
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Final, cast

import re2  # type: ignore[import-untyped]
from re2 import _re2

__all__ = [
    "UNIT_SECONDS",
    "canonical_unit",
    "fr_date_bin",
    "fr_date_trunc",
    "fr_epoch",
    "fr_extract",
    "fr_plus_interval",
    "fr_ts",
    "fr_ts_add",
    "fr_ts_diff",
    "fr_ts_minus",
    "fr_ts_plus",
    "install",
    "percentile",
]

#: Seconds in each unit of fixed length an interval may name.
UNIT_SECONDS: Final = {
    "microsecond": 1e-6,
    "us": 1e-6,
    "millisecond": 1e-3,
    "ms": 1e-3,
    "second": 1.0,
    "sec": 1.0,
    "s": 1.0,
    "minute": 60.0,
    "min": 60.0,
    "m": 60.0,
    "hour": 3600.0,
    "hr": 3600.0,
    "h": 3600.0,
    "day": 86400.0,
    "d": 86400.0,
    "week": 604800.0,
    "w": 604800.0,
}


def canonical_unit(word: str) -> str:
    """A unit word as :data:`UNIT_SECONDS` spells it: lower case, plural ``s`` dropped."""
    word = word.lower()
    if word not in UNIT_SECONDS and word.endswith("s"):
        word = word[:-1]
    return word


_FORMAT: Final = "%Y-%m-%dT%H:%M:%S.%fZ"
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


@functools.lru_cache(maxsize=8192)
def _parse_ts(value: str) -> datetime:
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    when = datetime.fromisoformat(text)
    if when.tzinfo is None:
        return when.replace(tzinfo=UTC)
    return when.astimezone(UTC)


def _to_dt(value: object) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return _EPOCH + timedelta(seconds=value)
    try:
        return _parse_ts(str(value))
    except ValueError:
        raise ValueError(f"{value!r} is not a timestamp") from None


def _iso(when: datetime) -> str:
    return when.strftime(_FORMAT)


def fr_ts(value: object) -> str | None:
    when = _to_dt(value)
    return None if when is None else _iso(when)


def fr_ts_add(value: object, seconds: float | None) -> str | None:
    when = _to_dt(value)
    if when is None or seconds is None:
        return None
    return _iso(when + timedelta(seconds=seconds))


def fr_ts_diff(a: object, b: object) -> float | None:
    left, right = _to_dt(a), _to_dt(b)
    if left is None or right is None:
        return None
    return (left - right).total_seconds()


def fr_plus_interval(value: object, seconds: float | None) -> object:
    """``value + interval`` where the SQL does not say what ``value`` is (a CTE's
    column, ``->>``, a literal): a number is an interval (seconds, the sum is
    too), anything else must be a timestamp (the sum is the store's text).

    Raises:
        ValueError: ``value`` is text that is no timestamp.
    """
    if value is None or seconds is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value + seconds
    return fr_ts_add(value, seconds)


def fr_ts_plus(value: object, other: object) -> str | None:
    """``timestamp + other`` where the SQL does not say what ``other`` is: a number is seconds.

    Raises:
        ValueError: ``other`` is no number (two timestamps do not add up).
    """
    if value is None or other is None:
        return None
    if isinstance(other, int | float) and not isinstance(other, bool):
        return fr_ts_add(value, other)
    raise ValueError(
        f"a timestamp plus {other!r}: add an interval ('1 hour') or a number of seconds"
    )


def fr_ts_minus(value: object, other: object) -> str | float | None:
    """``timestamp - other`` where the SQL does not say what ``other`` is: a number is
    seconds (a timestamp earlier), anything else a timestamp (the seconds between).

    Raises:
        ValueError: ``other`` is text that is no timestamp.
    """
    if value is None or other is None:
        return None
    if isinstance(other, int | float) and not isinstance(other, bool):
        return fr_ts_add(value, -other)
    return fr_ts_diff(value, other)


def fr_epoch(value: object) -> float | None:
    when = _to_dt(value)
    return None if when is None else (when - _EPOCH).total_seconds()


#: Where the store's text is cut, and what follows, for date_trunc to a unit.
_TRUNC_TEXT: Final = {
    "second": (19, ".000000Z"),
    "minute": (16, ":00.000000Z"),
    "hour": (13, ":00:00.000000Z"),
    "day": (10, "T00:00:00.000000Z"),
}


def _is_store_text(value: object) -> bool:
    return isinstance(value, str) and len(value) == 27 and value[10] == "T" and value[26] == "Z"


def fr_date_trunc(unit: str, value: object) -> str | None:
    cut = _TRUNC_TEXT.get(canonical_unit(unit)) if _is_store_text(value) else None
    if cut is not None:  # the store's own text: cut it, no parsing (a query may do this per row)
        return f"{str(value)[: cut[0]]}{cut[1]}"
    when = _to_dt(value)
    if when is None:
        return None
    name = canonical_unit(unit)
    if name in ("microsecond", "us"):
        return _iso(when)
    if name in ("millisecond", "ms"):
        return _iso(when.replace(microsecond=when.microsecond // 1000 * 1000))
    if name in ("second", "sec", "s"):
        when = when.replace(microsecond=0)
    elif name in ("minute", "min", "m"):
        when = when.replace(second=0, microsecond=0)
    elif name in ("hour", "hr", "h"):
        when = when.replace(minute=0, second=0, microsecond=0)
    elif name in ("day", "d"):
        when = when.replace(hour=0, minute=0, second=0, microsecond=0)
    elif name in ("week", "w"):
        day = when.replace(hour=0, minute=0, second=0, microsecond=0)
        when = day - timedelta(days=day.weekday())  # Monday, as PostgreSQL
    elif name == "month":
        when = when.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    elif name == "quarter":
        month = (when.month - 1) // 3 * 3 + 1
        when = when.replace(month=month, day=1, hour=0, minute=0, second=0, microsecond=0)
    elif name == "year":
        when = when.replace(month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
    else:
        raise ValueError(f"date_trunc: unknown unit {unit!r}")
    return _iso(when)


def fr_date_bin(stride_s: float | None, value: object, origin: object = None) -> str | None:
    when = _to_dt(value)
    if when is None or stride_s is None:
        return None
    if stride_s <= 0:
        raise ValueError("time_bucket/date_bin: the interval must be positive")
    start = _to_dt(origin) or _EPOCH
    offset = (when - start).total_seconds()
    return _iso(start + timedelta(seconds=math.floor(offset / stride_s) * stride_s))


_EXTRACT: Final[dict[str, Callable[[datetime], float]]] = {
    "year": lambda d: d.year,
    "quarter": lambda d: (d.month - 1) // 3 + 1,
    "month": lambda d: d.month,
    "week": lambda d: d.isocalendar()[1],
    "day": lambda d: d.day,
    "dow": lambda d: d.isoweekday() % 7,
    "isodow": lambda d: d.isoweekday(),
    "doy": lambda d: d.timetuple().tm_yday,
    "hour": lambda d: d.hour,
    "minute": lambda d: d.minute,
    "second": lambda d: d.second + d.microsecond / 1e6,
    "millisecond": lambda d: d.second * 1e3 + d.microsecond / 1e3,
    "microsecond": lambda d: d.second * 1_000_000 + d.microsecond,
}


def fr_extract(unit: str, value: object) -> float | None:
    when = _to_dt(value)
    if when is None:
        return None
    name = unit.lower()
    part = _EXTRACT.get(name) or _EXTRACT.get(canonical_unit(name))
    if part is None:
        raise ValueError(f"extract: unknown field {unit!r}")
    return part(when)


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0 to 1) of sorted values, by linear interpolation between
    the closest ranks (``percentile_cont``, numpy's default); None for no values."""
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class _Budget:
    """The bytes of values the Python aggregates of one query hold, and their bound.

    SQLite hands every row of a group to ``step``; an aggregate that keeps
    them (percentiles, ``array_agg``) takes its share here, and gives it back
    when its group is finished, so that what all of one query's aggregates
    hold at once stays under ``limit`` (``service.query_max_bytes``; None: no
    bound). SQLite finishes one group before it starts the next.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int, what: str) -> None:
        """Count ``size`` more bytes for ``what`` (an aggregate's name).

        Raises:
            ValueError: the query's aggregates would hold more than ``limit``.
        """
        self.held += size
        if self.limit is not None and self.held > self.limit:
            raise ValueError(
                f"{what} holds over the {self.limit} byte limit (service.query_max_bytes) "
                "of values kept by the query's aggregates: aggregate fewer or smaller "
                "values (a narrower WHERE, a shorter time range)"
            )

    def give(self, size: int) -> None:
        self.held -= size


#: Bytes a number takes in an aggregate's memory (``array('d')``) and in an answer.
_NUMBER_BYTES: Final = 8


class _Percentile:
    """``percentile_cont`` (linear interpolation) or ``percentile_disc`` over non-null values."""

    discrete = False
    name = "percentile_cont"
    #: Set per query by :func:`install`; the class's own has no bound.
    budget: ClassVar[_Budget] = _Budget()

    def __init__(self) -> None:
        self.values = array("d")  # 8 bytes a value, as counted
        self.q: float | None = None

    def step(self, value: object, q: object) -> None:
        if self.q is None and isinstance(q, int | float):
            if not 0 <= q <= 1:
                raise ValueError("a percentile is between 0 and 1")
            self.q = float(q)
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):  # text that is no number: skipped
                number = float(value)
        if number is not None:
            self.budget.take(_NUMBER_BYTES, self.name)
            self.values.append(number)

    def finalize(self) -> float | None:
        self.budget.give(len(self.values) * _NUMBER_BYTES)
        if not self.values or self.q is None:
            return None
        ordered = sorted(self.values)
        self.values = array("d")
        if self.discrete:
            return ordered[max(0, math.ceil(self.q * len(ordered)) - 1)]
        return percentile(ordered, self.q)


class _PercentileDisc(_Percentile):
    discrete = True
    name = "percentile_disc"


class _Variance:
    """Sample (``ddof=1``) or population variance; ``root`` gives the standard deviation."""

    ddof = 1
    root = False

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def step(self, value: object) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            self.n += 1
            delta = value - self.mean
            self.mean += delta / self.n
            self.m2 += delta * (value - self.mean)

    def finalize(self) -> float | None:
        if self.n <= self.ddof - 1 or self.n == 0 or (self.ddof == 1 and self.n < 2):
            return None
        variance = self.m2 / (self.n - self.ddof)
        return math.sqrt(variance) if self.root else variance


class _VarPop(_Variance):
    ddof = 0


class _StddevSamp(_Variance):
    root = True


class _StddevPop(_Variance):
    ddof, root = 0, True


class _ArrayAgg:
    """``array_agg(x)``: a JSON array (SQLite has no arrays)."""

    budget: ClassVar[_Budget] = _Budget()

    def __init__(self) -> None:
        self.items: list[object] = []
        self.held = 0

    def step(self, value: object) -> None:
        # What the item adds to the JSON array: a text's length, quotes and comma.
        size = len(value) + 3 if isinstance(value, str | bytes) else _NUMBER_BYTES
        self.budget.take(size, "array_agg")
        self.held += size
        self.items.append(value)

    def finalize(self) -> str:
        self.budget.give(self.held)
        items, self.items, self.held = self.items, [], 0
        return json.dumps(items, ensure_ascii=False, default=str)


#: What a pattern RE2 refuses may be written as instead, told with its error.
_RE2_SYNTAX: Final = "RE2 syntax, as on Logfire: no backreferences or lookaround"
_UNANCHORED: Final = _re2.RE2.Anchor.UNANCHORED


@functools.lru_cache(maxsize=256)
def _pattern(pattern: str, ignore_case: bool) -> Any:
    """``pattern`` compiled by RE2, quietly (RE2 logs refusals to stderr by default).

    The binding under ``re2``'s Python wrapper: the wrapper's ``search`` builds
    a match object and decodes offsets, five times the cost of the match itself
    for the short texts of a store (10 µs a row against 2 µs); a query only
    needs whether it matched.

    Raises:
        ValueError: RE2 cannot compile it; the message says why.
    """
    options = re2.Options()
    options.log_errors = False
    options.never_capture = True
    options.case_sensitive = not ignore_case
    compiled = _re2.RE2(pattern.encode(), options)
    if not compiled.ok():
        reason = compiled.error()
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise ValueError(f"regular expression {pattern!r}: {reason} ({_RE2_SYNTAX})")
    return compiled


def _regexp(pattern: object, value: object, *, ignore_case: bool = False) -> bool | None:
    """``value ~ pattern``: does RE2's ``pattern`` match anywhere in ``value``."""
    if pattern is None or value is None:
        return None
    text = str(value).encode()
    spans = _pattern(str(pattern), ignore_case).Match(_UNANCHORED, text, 0, len(text))
    return bool(spans[0][0] != -1)


def _iregexp(pattern: object, value: object) -> bool | None:
    """``value ~* pattern``: ``~`` ignoring case."""
    return _regexp(pattern, value, ignore_case=True)


def install(conn: sqlite3.Connection, *, now: datetime, max_bytes: int | None = None) -> list[str]:
    """Register on ``conn`` the functions translated SQL calls; ``now()`` is ``now``.

    ``now()`` is one value for the whole statement, as in PostgreSQL. The
    aggregates that keep values (percentiles, ``array_agg``) hold at most
    ``max_bytes`` of them at once, all of a statement's together. Returns a list
    that collects what the functions refused (SQLite itself only says
    "user-defined function raised exception"), for the error message.
    """
    stamp = _iso(now.astimezone(UTC))
    problems: list[str] = []
    budget = _Budget(max_bytes)

    def told(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def call(*args: Any) -> Any:
            try:
                return func(*args)
            except ValueError as exc:
                problems.append(str(exc))
                raise
            except OverflowError:
                # Raised as it is, sqlite3 would report "string or blob too big".
                problems.append(
                    "a value out of range: timestamps run from year 1 to 9999 "
                    "(a smaller interval or number)"
                )
                raise ValueError(problems[-1]) from None

        return call

    def bounded(kind: type[Any]) -> type[Any]:
        """``kind`` on this query's budget, its refusals told."""

        class Told(kind):  # type: ignore[misc]
            def step(self, *args: object) -> None:
                told(super().step)(*args)

            def finalize(self) -> object:
                return told(super().finalize)()

        Told.budget = budget
        return Told

    conn.create_function("fr_now", 0, lambda: stamp, deterministic=True)
    for name, func, arity in (
        ("fr_ts", fr_ts, 1),
        ("fr_ts_add", fr_ts_add, 2),
        ("fr_ts_diff", fr_ts_diff, 2),
        ("fr_epoch", fr_epoch, 1),
        ("fr_date_trunc", fr_date_trunc, 2),
        ("fr_date_bin", fr_date_bin, 2),
        ("fr_date_bin", fr_date_bin, 3),
        ("fr_extract", fr_extract, 2),
        ("fr_plus_interval", fr_plus_interval, 2),
        ("fr_ts_plus", fr_ts_plus, 2),
        ("fr_ts_minus", fr_ts_minus, 2),
        ("regexp", _regexp, 2),
        ("fr_iregexp", _iregexp, 2),
    ):
        conn.create_function(name, arity, told(func), deterministic=True)
    conn.create_aggregate("fr_percentile_cont", 2, cast(Any, bounded(_Percentile)))
    conn.create_aggregate("fr_percentile_disc", 2, cast(Any, bounded(_PercentileDisc)))
    for name, aggregate in (
        ("variance", _Variance),
        ("var_samp", _Variance),
        ("var_pop", _VarPop),
        ("variance_pop", _VarPop),  # what sqlglot writes var_pop as
        ("stddev", _StddevSamp),
        ("stddev_samp", _StddevSamp),
        ("stddev_pop", _StddevPop),
    ):
        conn.create_aggregate(name, 1, cast(Any, aggregate))
    conn.create_aggregate("array_agg", 1, cast(Any, bounded(_ArrayAgg)))
    return problems
