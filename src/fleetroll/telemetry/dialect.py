"""Logfire's SQL on the local store: translated by sqlglot, finished by SQLite functions.

Logfire runs Apache DataFusion, whose SQL follows PostgreSQL; the local store
is SQLite. :func:`translate` parses the SQL a Logfire user writes as
PostgreSQL (sqlglot, a real parser: no pattern rewriting) and writes it out
for SQLite, rewriting on the syntax tree what SQLite has no words for:

- timestamps are the store's ISO 8601 text (``2026-01-01T12:00:00.000000Z``,
  which sorts as time): ``now()``, ``::timestamp``, ``date_trunc``,
  ``time_bucket``/``date_bin`` and ``timestamp ± interval`` all give that text,
  so comparisons with the timestamp columns stay text comparisons (and use
  the index on ``start_timestamp``);
- an ``interval`` is a number of seconds; ``timestamp - timestamp`` is one
  too, so ``extract(epoch from end_timestamp - start_timestamp)`` is seconds;
  ``x ± interval`` where nothing says what ``x`` is (a CTE's column, ``->>``)
  is decided per value (``fr_plus_interval``): a number is an interval, text
  must be a timestamp, never a number made from the text's leading digits;
- ``::json``/``::jsonb`` is SQLite's ``json(x)``, which refuses text that is
  no JSON (SQLite's ``CAST(x AS JSON)`` would make it the number 0);
- ``level`` compares by severity (``level > 'info'``,
  ``level >= level_num('error')``), as on Logfire, though the store keeps names;
- ``percentile_cont(q) WITHIN GROUP (ORDER BY x)``, ``percentile_disc``,
  ``approx_percentile_cont(x, q)``, ``median``, ``approx_median``,
  ``stddev``/``variance``, ``array_agg`` and ``~`` are SQLite functions
  registered by :func:`install`;
- ``->`` and ``->>`` keep the key as written (``attributes->>'env_key'``),
  which SQLite reads as that key, dots included, and which the store's
  expression indexes match.

Errors are one line about the SQL as written: a syntax error gives the line,
column and token, never the parser's own classes; SQL nested too deeply for
the parser is refused, not a ``RecursionError``.

What still differs from Logfire is listed in docs/telemetry.md.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any, ClassVar, Final

import sqlglot
from sqlglot import exp
from sqlglot.dialects.postgres import Postgres
from sqlglot.dialects.sqlite import SQLite
from sqlglot.errors import ErrorLevel, ParseError, SqlglotError, TokenError
from sqlglot.generators.sqlite import SQLiteGenerator
from sqlglot.parsers.postgres import PostgresParser

from fleetroll.errors import QueryError
from fleetroll.telemetry.sql_functions import UNIT_SECONDS as _SECONDS
from fleetroll.telemetry.sql_functions import canonical_unit as _unit
from fleetroll.telemetry.sql_functions import fr_date_bin as fr_date_bin
from fleetroll.telemetry.sql_functions import fr_date_trunc as fr_date_trunc
from fleetroll.telemetry.sql_functions import fr_epoch as fr_epoch
from fleetroll.telemetry.sql_functions import fr_extract as fr_extract
from fleetroll.telemetry.sql_functions import fr_plus_interval as fr_plus_interval
from fleetroll.telemetry.sql_functions import fr_ts as fr_ts
from fleetroll.telemetry.sql_functions import fr_ts_add as fr_ts_add
from fleetroll.telemetry.sql_functions import fr_ts_diff as fr_ts_diff
from fleetroll.telemetry.sql_functions import fr_ts_minus as fr_ts_minus
from fleetroll.telemetry.sql_functions import fr_ts_plus as fr_ts_plus
from fleetroll.telemetry.sql_functions import install as install

__all__ = ["install", "interval_seconds", "locate", "translate"]

# sqlglot logs a warning for every statement it passes through unparsed
# (PRAGMA, VACUUM...); SQLite itself refuses those on the read-only
# connection, with a clear message of ours.
logging.getLogger("sqlglot").setLevel(logging.ERROR)

#: Columns of ``records`` that hold timestamps.
TIMESTAMP_COLUMNS: Final = frozenset({"start_timestamp", "end_timestamp", "created_at"})
_TS_FUNCTIONS: Final = frozenset(
    {"fr_now", "fr_ts", "fr_date_trunc", "fr_date_bin", "fr_ts_add", "fr_ts_plus"}
)
_INTERVAL_FUNCTIONS: Final = frozenset({"fr_interval", "fr_ts_diff"})

_INTERVAL_PART = re.compile(r"\s*([-+]?\d+(?:\.\d+)?)\s*([a-z]+)\s*", re.IGNORECASE)


def interval_seconds(text: str, unit: str | None = None) -> float:
    """Seconds in an interval literal: ``'5 minutes'``, ``'1 hour 30 minutes'``, ``'2'`` + HOUR.

    Raises:
        QueryError: a unit with no fixed length (months, years) or no unit at all.
    """
    text = text.strip()
    if unit:
        text = f"{text} {unit}"
    pos, total = 0, 0.0
    while pos < len(text):
        match = _INTERVAL_PART.match(text, pos)
        if match is None or match.end() == pos:
            break
        name = _unit(match.group(2))
        if name not in _SECONDS:
            raise QueryError(
                f"interval {text!r}: {match.group(2)!r} has no fixed length here; use "
                "microseconds to weeks (the local store counts an interval in seconds)"
            )
        total += float(match.group(1)) * _SECONDS[name]
        pos = match.end()
    if pos != len(text) or not text:
        raise QueryError(
            f"interval {text!r} is not understood: write it as '5 minutes', '1 hour 30 minutes' "
            "or '90 seconds'"
        )
    return total


# -- the syntax tree -------------------------------------------------------------------


def _call(name: str, *args: exp.Expr) -> exp.Anonymous:
    return exp.Anonymous(this=name, expressions=list(args))


def _kind(node: exp.Expr | None) -> str | None:
    """``'ts'``, ``'interval'`` or None: what a (rewritten) expression holds."""
    if node is None:
        return None
    if isinstance(node, exp.Paren):
        return _kind(node.this)
    if isinstance(node, exp.Column):
        return "ts" if node.name.lower() in TIMESTAMP_COLUMNS else None
    if isinstance(node, exp.Anonymous):
        name = str(node.this).lower()
        if name in _TS_FUNCTIONS:
            return "ts"
        if name in _INTERVAL_FUNCTIONS:
            return "interval"
        return None
    if isinstance(node, exp.Min | exp.Max | exp.Coalesce):
        return _kind(node.this)
    if isinstance(node, exp.Neg):
        return "interval" if _kind(node.this) == "interval" else None
    if isinstance(node, exp.Mul | exp.Div):
        kinds = {_kind(node.this), _kind(node.expression)}
        return "interval" if "interval" in kinds else None
    return None


def _seconds_literal(value: float) -> exp.Expr:
    return exp.Literal.number(repr(value) if not value.is_integer() else int(value))


def _interval(node: exp.Interval) -> exp.Expr:
    unit = node.args.get("unit")
    text = node.this.name if isinstance(node.this, exp.Literal) else None
    if text is None:
        raise QueryError(f"interval {node.sql('postgres')}: write the length as a string")
    seconds = interval_seconds(text, unit.name if unit is not None else None)
    return _call("fr_interval", _seconds_literal(seconds))


def _as_interval(node: exp.Expr) -> exp.Expr:
    """A string literal used as an interval (``time_bucket('5 minutes', ...)``)."""
    if isinstance(node, exp.Literal) and node.is_string:
        return _call("fr_interval", _seconds_literal(interval_seconds(node.name)))
    return node


def _unit_name(node: exp.Expr | None) -> str:
    if node is None:
        return ""
    return node.name.lower()


def _percentile(order: exp.Expr, q: exp.Expr, *, discrete: bool = False) -> exp.Expr:
    ordered = order.expressions[0] if isinstance(order, exp.Order) and order.expressions else order
    value = ordered.this if isinstance(ordered, exp.Ordered) else ordered
    if isinstance(ordered, exp.Ordered) and ordered.args.get("desc"):
        q = exp.Sub(this=exp.Literal.number(1), expression=q)
    return _call("fr_percentile_disc" if discrete else "fr_percentile_cont", value, q)


_COMPARISONS: Final = (exp.GT, exp.GTE, exp.LT, exp.LTE, exp.EQ, exp.NEQ)
_APPROX_PERCENTILES: Final = frozenset({"approx_percentile_cont", "approx_percentile"})


def _bottom_up(node: exp.Expr) -> exp.Expr:
    """Rewrite the children first, so that :func:`_rewrite` sees what they became."""
    for key, value in list(node.args.items()):
        if isinstance(value, exp.Expr):
            node.set(key, _bottom_up(value))
        elif isinstance(value, list):
            node.set(key, [_bottom_up(v) if isinstance(v, exp.Expr) else v for v in value])
    return _rewrite(node)


def _rewrite(node: exp.Expr) -> exp.Expr:
    """One node, its children already rewritten."""
    if isinstance(node, exp.Interval):
        return _interval(node)
    if isinstance(node, exp.CurrentTimestamp) or (
        isinstance(node, exp.Anonymous) and str(node.this).lower() == "now"
    ):
        return _call("fr_now")
    if isinstance(node, exp.CurrentDate):
        return _call("substr", _call("fr_now"), exp.Literal.number(1), exp.Literal.number(10))
    if isinstance(node, exp.Cast) and node.to.this in (
        exp.DataType.Type.TIMESTAMP,
        exp.DataType.Type.TIMESTAMPTZ,
        exp.DataType.Type.TIMESTAMPLTZ,
        exp.DataType.Type.DATETIME,
    ):
        return _call("fr_ts", node.this)
    if isinstance(node, exp.Cast) and node.to.this == exp.DataType.Type.INTERVAL:
        return _as_interval(node.this)
    if isinstance(node, exp.Cast) and node.to.this in (
        exp.DataType.Type.JSON,
        exp.DataType.Type.JSONB,
    ):
        return _call("json", node.this)
    if isinstance(node, exp.RegexpILike):  # x ~* pattern
        return _call("fr_iregexp", node.expression, node.this)
    if isinstance(node, exp.TimestampTrunc | exp.DateTrunc):
        unit = _unit_name(node.args.get("unit"))
        return _call("fr_date_trunc", exp.Literal.string(unit), node.this)
    if isinstance(node, exp.Anonymous):
        name = str(node.this).lower()
        args = node.expressions
        if name in ("time_bucket", "date_bin") and len(args) >= 2:
            return _call("fr_date_bin", _as_interval(args[0]), *args[1:3])
        if name in _APPROX_PERCENTILES and len(args) >= 2:
            return _call("fr_percentile_cont", args[0], args[1])
        if name == "approx_median" and len(args) == 1:
            return _call("fr_percentile_cont", args[0], exp.Literal.number(0.5))
        if name == "to_timestamp" and len(args) == 1:
            return _call("fr_ts", args[0])
    if isinstance(node, exp.UnixToTime) and set(node.args) == {"this"}:  # to_timestamp(n)
        return _call("fr_ts", node.this)
    if isinstance(node, exp.Median):
        return _call("fr_percentile_cont", node.this, exp.Literal.number(0.5))
    if isinstance(node, exp.WithinGroup):
        inner = node.this
        if isinstance(inner, exp.PercentileCont | exp.PercentileDisc):
            return _percentile(
                node.expression, inner.this, discrete=isinstance(inner, exp.PercentileDisc)
            )
        if isinstance(inner, exp.Anonymous) and str(inner.this).lower() in _APPROX_PERCENTILES:
            return _percentile(node.expression, inner.expressions[0])
    if isinstance(node, exp.Count) and node.this is None and not node.expressions:
        return exp.Count(this=exp.Star())  # Logfire's COUNT()
    if isinstance(node, exp.Extract):
        unit = _unit_name(node.this)
        target: exp.Expr = node.expression
        if unit == "epoch":
            if _kind(target) == "interval":
                return target
            return _call("fr_epoch", target)
        return _call("fr_extract", exp.Literal.string(unit), target)
    if isinstance(node, exp.Add | exp.Sub):
        left, right = _kind(node.this), _kind(node.expression)
        if isinstance(node, exp.Sub) and left == "ts" and right == "ts":
            return _call("fr_ts_diff", node.this, node.expression)
        if left == "ts" and right == "interval":
            delta = node.expression
            if isinstance(node, exp.Sub):
                delta = exp.Neg(this=exp.Paren(this=delta))
            return _call("fr_ts_add", node.this, delta)
        if isinstance(node, exp.Add) and left == "interval" and right == "ts":
            return _call("fr_ts_add", node.expression, node.this)
        # Something the SQL does not type (a CTE's column, ->>, a literal) and an
        # interval: SQLite would subtract seconds from the number it reads out of
        # a timestamp's text ('2026-...' - 3600 = -1574). Decided per value instead.
        if left is None and right == "interval":
            delta = node.expression
            if isinstance(node, exp.Sub):
                delta = exp.Neg(this=exp.Paren(this=delta))
            return _call("fr_plus_interval", node.this, delta)
        if isinstance(node, exp.Add) and left == "interval" and right is None:
            return _call("fr_plus_interval", node.expression, node.this)
        # A timestamp and something untyped (a number, a CTE's timestamp, lag(...)):
        # SQLite would add to the year it reads out of the text ('2026-...' + 1 = 2027).
        if left == "ts" and right is None:
            name = "fr_ts_plus" if isinstance(node, exp.Add) else "fr_ts_minus"
            return _call(name, node.this, node.expression)
        if left is None and right == "ts":
            if isinstance(node, exp.Add):
                return _call("fr_ts_plus", node.expression, node.this)
            return _call("fr_ts_diff", node.this, node.expression)
    if isinstance(node, exp.JSONExtract | exp.JSONExtractScalar):
        path = node.expression
        if isinstance(path, exp.Cast) and isinstance(path.this, exp.Literal):
            # attributes->>'reward'::float: PostgreSQL would cast 'reward' itself
            # (:: binds first) and fail; what was meant is the value, cast.
            inner = node.copy()
            inner.set("expression", path.this)
            inner.set("only_json_types", True)  # an arrow, not json_extract()
            return exp.Cast(this=_rewrite(inner), to=path.to)
    if isinstance(node, _COMPARISONS):
        return _comparison(node)
    return node


def _comparison(node: exp.Expr) -> exp.Expr:
    if isinstance(node.parent, exp.Update):
        return node  # SET column = value: an assignment (refused anyway: read-only)
    left, right = node.this, node.expression
    ordering = not isinstance(node, exp.EQ | exp.NEQ)
    if (_is_level(left) and (ordering or not _is_string(right))) or (
        _is_level(right) and (ordering or not _is_string(left))
    ):
        node.set("this", _call("level_num", left))
        node.set("expression", _call("level_num", right))
        return node
    if _kind(left) == "ts" and _is_time_text(right):
        node.set("expression", _call("fr_ts", right))
    elif _kind(right) == "ts" and _is_time_text(left):
        node.set("this", _call("fr_ts", left))
    return node


def _is_time_text(node: exp.Expr) -> bool:
    """A time spelt some other way than the store's text: a string, a parameter, datetime()."""
    return _is_string(node) or isinstance(node, exp.Placeholder | exp.Datetime)


def _is_string(node: exp.Expr) -> bool:
    return isinstance(node, exp.Literal) and node.is_string


def _is_level(node: exp.Expr) -> bool:
    return isinstance(node, exp.Column) and node.name.lower() == "level"


def _unwrap_intervals(node: exp.Expr) -> exp.Expr:
    if isinstance(node, exp.Anonymous) and str(node.this).lower() == "fr_interval":
        return exp.Paren(this=node.expressions[0])
    return node


def _json_key(path: exp.Expr) -> str | None:
    """The key or index of a one-step JSON path, as SQLite's ``->`` takes it."""
    if not isinstance(path, exp.JSONPath):
        return None
    steps = [p for p in path.expressions if not isinstance(p, exp.JSONPathRoot)]
    if len(steps) != 1:
        return None
    step = steps[0]
    if isinstance(step, exp.JSONPathKey) and isinstance(step.this, str):
        return "'" + step.this.replace("'", "''") + "'"
    if isinstance(step, exp.JSONPathSubscript) and isinstance(step.this, int):
        return str(step.this)
    return None


def _arrow(operator: str) -> Callable[[Any, exp.Expr], str]:
    def generate(self: Any, node: exp.Expr) -> str:
        if "only_json_types" not in node.args:
            # SQLite's json_extract(x, '$.path'), kept: it answers SQL values, not JSON.
            return f"JSON_EXTRACT({self.sql(node, 'this')}, {self.sql(node, 'expression')})"
        key = _json_key(node.expression)
        if key is None:
            key = self.sql(node, "expression")
        return f"{self.sql(node, 'this')} {operator} {key}"

    return generate


class _LocalGenerator(SQLiteGenerator):
    TRANSFORMS: ClassVar[dict[type[exp.Expr], Callable[..., str]]] = {
        **SQLiteGenerator.TRANSFORMS,
        exp.JSONExtract: _arrow("->"),
        exp.JSONExtractScalar: _arrow("->>"),
    }


class _LocalStore(SQLite):
    """SQLite, with ``->``/``->>`` keys kept as written (see the module docstring)."""

    Generator = _LocalGenerator


class _LogfireParser(PostgresParser):
    # sqlglot reads date_bin's third argument (the origin) as a unit word: a
    # column becomes the bare name, a string loses its quotes. Kept as written,
    # it is rewritten like time_bucket.
    FUNCTIONS: ClassVar[dict[str, Callable[..., exp.Expr]]] = {
        **PostgresParser.FUNCTIONS,
        "DATE_BIN": lambda args: exp.Anonymous(this="date_bin", expressions=args),
    }


class _Logfire(Postgres):
    """PostgreSQL as Logfire's users write it (see :class:`_LogfireParser`)."""

    Parser = _LogfireParser


@functools.lru_cache(maxsize=256)
def translate(sql: str) -> str:
    """The SQLite text of one statement of Logfire's (PostgreSQL-flavoured) SQL.

    Raises:
        QueryError: the SQL does not parse (the message gives the line,
            column and token), holds more than one statement, or uses
            something the local store cannot express.
    """
    try:
        return _translate(sql)
    except RecursionError:
        # sqlglot parses and rewrites recursively: a few hundred nested
        # parentheses or a long chain of operators run out of stack.
        raise QueryError(
            "the SQL is nested too deeply to read (hundreds of levels of parentheses, "
            "or a very long chain of operators): write it flatter, e.g. with a CTE"
        ) from None


def _translate(sql: str) -> str:
    try:
        statements = [s for s in sqlglot.parse(sql, read=_Logfire) if s is not None]
    except ParseError as exc:
        raise QueryError(_parse_error(sql, exc)) from None
    except TokenError as exc:
        raise QueryError(f"the SQL cannot be read: {_token_error(sql, exc)}") from None
    if len(statements) != 1:
        raise QueryError(
            f"give exactly one SQL statement (found {len(statements)}; "
            "remove the ';'-separated rest)"
        )
    try:
        tree = _bottom_up(statements[0]).transform(_unwrap_intervals)
        return tree.sql(dialect=_LocalStore, unsupported_level=ErrorLevel.RAISE)
    except QueryError:
        raise
    except SqlglotError as exc:
        raise QueryError(f"the local store cannot run this SQL: {_plain(str(exc))}") from None


def _parse_error(sql: str, exc: ParseError) -> str:
    if not exc.errors:
        return f"SQL syntax error: {exc}"
    first = exc.errors[0]
    line, col = first.get("line"), first.get("col")
    token = str(first.get("highlight") or "")
    description = str(first.get("description") or "syntax error")
    if isinstance(col, int) and token and "\n" not in token:
        col = max(1, col - len(token) + 1)  # sqlglot points at the token's end
    if len(token) > 40:  # a long string literal: its start says where
        token = token[:40] + "…"
    near = f" near {token!r}" if token else ""
    where = f" at line {line}, column {col}" if line is not None else ""
    return f"SQL syntax error{where}{near}: {_plain(description).lower()}"


#: sqlglot's words for "this part of the SQL is incomplete".
_MISSING: Final = re.compile(r"required keyword: '\w+' missing for <class '[\w.]+'>", re.I)
_INTERNAL: Final = re.compile(r"<(?:class|token)\b[^>]*>", re.I)


def _plain(description: str) -> str:
    """sqlglot's description of an error without its internals (classes, tokens)."""
    text = description.partition(" but got <")[0]  # "...but got <Token token_type: ...>"
    text = _MISSING.sub("something is missing after it", text)
    text = _INTERNAL.sub("", text)
    return " ".join(text.split()) or "syntax error"


def _token_error(sql: str, exc: TokenError) -> str:
    for quote, what in (("'", "a string"), ('"', "a quoted name")):
        opened: int | None = None
        for i, char in enumerate(sql):
            if char == quote:
                opened = i if opened is None else None  # '' inside a string toggles twice
        if opened is not None:
            line = sql.count("\n", 0, opened) + 1
            column = opened - (sql.rfind("\n", 0, opened) + 1) + 1
            return f"{what} opened at line {line}, column {column} is never closed"
    return str(exc).splitlines()[0]


# -- where a name is in the user's SQL ------------------------------------------------


def locate(sql: str, word: str) -> str:
    """``" at line L, column C"`` of ``word`` (a whole word, any case) in ``sql``, or ``""``."""
    match = re.search(rf"(?<![\w.]){re.escape(word)}(?!\w)", sql, re.IGNORECASE)
    if match is None:
        return ""
    line = sql.count("\n", 0, match.start()) + 1
    column = match.start() - (sql.rfind("\n", 0, match.start()) + 1) + 1
    return f" at line {line}, column {column}"
