"""Reading task files: bytes to JSON records, each with where it came from.

A file holds JSON Lines (one task per line, blank lines skipped) or a JSON
array, recognised by its first non-blank character ``[`` whatever the
extension. Lines are split on ``\\n`` only and numbered, a UTF-8 BOM is
dropped, and the byte and task budgets are checked while reading, never
after. Each record comes with a :class:`Where` (file, line, position in the
array) so that :mod:`fleetroll.tasks`, which checks the records, names the
place of every problem. Raises only :class:`~fleetroll.errors.TaskFileError`.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Final

from fleetroll.errors import TaskFileError

__all__ = ["Where", "nth", "read_records", "too_big", "too_many"]


@dataclass(frozen=True, slots=True)
class Where:
    """Where a record came from, to build errors that point at it."""

    source: str
    line: int | None = None
    nth: int = 0  # 1-based position in a JSON array or a list; 0 when in neither
    container: str = "array"

    @property
    def ordinal(self) -> str:
        return f"the {nth(self.nth)} task in the {self.container}" if self.nth else ""

    def error(self, reason: str, field: str | None = None) -> TaskFileError:
        reason = f"{reason} ({self.ordinal})" if self.ordinal else reason
        return TaskFileError(reason, path=self.source, line=self.line, field=field)


def read_records(
    f: IO[bytes], source: str, *, max_bytes: int | None, max_tasks: int | None
) -> Iterator[tuple[object, Where]]:
    """The records of the open task file ``f`` (named ``source`` in errors), in order.

    A JSON array is valid JSON as a whole before its first item is given.

    Raises:
        TaskFileError: the file is over ``max_bytes`` or holds more than
            ``max_tasks`` records, is not UTF-8, or is not valid JSON.
    """
    if max_bytes is not None:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise TaskFileError(too_big("is", size, max_bytes), path=source)
    lines = _raw_lines(f, source, max_bytes)
    head: list[tuple[int, bytes]] = []
    for number, raw in lines:
        head.append((number, raw))
        if raw.strip():
            break
    if head and head[-1][1].lstrip().startswith(b"["):
        entries = iter(_array(_chain(head, lines), source))
    else:
        entries = _read_lines(_chain(head, lines), source)
    yield from _capped(entries, max_tasks, source)


def too_many(limit: int) -> str:
    """The reason for refusing more than ``limit`` tasks."""
    return f"more than {limit:,} tasks, over the limit of {limit:,}"


def too_big(what: str, size: int, limit: int) -> str:
    """The reason for refusing ``size`` bytes over ``limit`` (``what``: "is", "holds"...)."""
    return f"{what} {size:,} bytes, over the limit of {limit:,}"


def _chain(
    head: list[tuple[int, bytes]], rest: Iterator[tuple[int, bytes]]
) -> Iterator[tuple[int, bytes]]:
    yield from head
    yield from rest


def _array(lines: Iterator[tuple[int, bytes]], source: str) -> list[tuple[object, Where]]:
    """Every item of a JSON array: the whole array is valid JSON before any task is checked."""
    text = _decode(b"".join(raw for _, raw in lines), source, None)
    return list(_read_array(text, source))


def _raw_lines(f: IO[bytes], source: str, budget: int | None) -> Iterator[tuple[int, bytes]]:
    """Numbered lines of ``f`` (split on ``\\n`` only), never reading past ``budget`` bytes."""
    read = 0
    number = 0
    while True:
        raw = f.readline() if budget is None else f.readline(budget - read + 1)
        if not raw:
            return
        read += len(raw)
        if budget is not None and read > budget:
            raise TaskFileError(too_big("holds more than", budget, budget), path=source)
        number += 1
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        yield number, raw


_BOM: Final = b"\xef\xbb\xbf"


def _decode(raw: bytes, source: str, line: int | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"not UTF-8 text (byte {exc.start})", path=source, line=line) from None


def _capped(
    entries: Iterator[tuple[object, Where]], limit: int | None, source: str
) -> Iterator[tuple[object, Where]]:
    for count, entry in enumerate(entries, 1):
        if limit is not None and count > limit:
            raise TaskFileError(too_many(limit), path=source, line=entry[1].line)
        yield entry


def _read_lines(lines: Iterable[tuple[int, bytes]], source: str) -> Iterator[tuple[object, Where]]:
    # Split on "\n" only (see _raw_lines), not splitlines(): JSON strings may hold a raw U+2028.
    for number, raw in lines:
        if not raw.strip():
            continue
        text = _decode(raw, source, number)
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            cut = exc.pos >= len(text.rstrip())
            hint = " (JSON Lines needs each task on one line, or use a JSON array)" if cut else ""
            reason = f"invalid JSON at column {exc.colno}: {exc.msg}{hint}"
            raise TaskFileError(reason, path=source, line=number) from None
        except RecursionError:
            raise TaskFileError("JSON nested too deeply", path=source, line=number) from None
        yield record, Where(source, line=number)


def _read_array(text: str, source: str) -> Iterator[tuple[object, Where]]:
    """The items of a JSON array, each with the line it starts on."""
    pos = _skip_blank(text, 0) + 1  # past the "["
    line, counted = 1, 0
    pos = _skip_blank(text, pos)
    if pos < len(text) and text[pos] == "]":
        pos = _skip_blank(text, pos + 1)
        if pos < len(text):
            _array_error(text, pos, "Extra data", source)
        return
    for nth in itertools.count(1):
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            record, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            reason = f"invalid JSON at column {exc.colno}: {exc.msg}"
            raise TaskFileError(reason, path=source, line=exc.lineno) from None
        except RecursionError:
            raise TaskFileError("JSON nested too deeply", path=source, line=line) from None
        yield record, Where(source, line=line, nth=nth)
        pos = _skip_blank(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_blank(text, pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            pos = _skip_blank(text, pos + 1)
            if pos < len(text):
                _array_error(text, pos, "Extra data", source)
            return
        _array_error(text, pos, "Expecting ',' delimiter", source)


def _array_error(text: str, pos: int, msg: str, source: str) -> None:
    exc = json.JSONDecodeError(msg, text, pos)
    reason = f"invalid JSON at column {exc.colno}: {exc.msg}"
    raise TaskFileError(reason, path=source, line=exc.lineno)


def _skip_blank(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


_DECODER: Final = json.JSONDecoder()


def nth(n: int) -> str:
    """``n`` as an ordinal: 1st, 2nd, 3rd, 11th, 21st..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
