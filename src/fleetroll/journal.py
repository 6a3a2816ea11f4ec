"""The result journal: every finished rollout on disk, so a crash loses none.

Results are appended to a JSON Lines file as they complete; a writer task
gathers whatever is ready and writes and fsyncs it in one go, in a worker
thread (never on the event loop). A line is written whole or the reader
drops it: :func:`read_journal` ignores (and :class:`Journal` truncates) a
last line without its newline, which is all a ``kill -9`` mid-write can
leave behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from fleetroll.results import RolloutResult

__all__ = ["Journal", "read_journal"]

_MAX_LINES_PER_WRITE = 512


def read_journal(path: Path) -> list[RolloutResult]:
    """Every complete result line in ``path`` (none when it does not exist).

    A last line without a newline (a write cut short) is ignored; a complete
    line that is not a result is an error.

    Raises:
        ValueError: a complete line is not a valid result (the message names it).
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    results = []
    for number, line in enumerate(complete.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            results.append(RolloutResult.model_validate_json(line))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not a rollout result: {exc}") from None
    return results


def _truncate_partial_tail(path: Path) -> None:
    if not path.exists():
        return
    with path.open("rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())


class Journal:
    """Appends results to a JSONL file from a background writer task.

    Use inside a task group's lifetime::

        async with Journal(path, tg) as journal:
            journal.append(result)
    """

    def __init__(self, path: Path, task_group: TaskGroup) -> None:
        self.path = path
        self._tg = task_group
        self._send: MemoryObjectSendStream[RolloutResult]
        self._receive: MemoryObjectReceiveStream[RolloutResult]
        self._send, self._receive = anyio.create_memory_object_stream[RolloutResult](
            max_buffer_size=float("inf")
        )
        self._done = anyio.Event()
        self._error: BaseException | None = None
        self.written = 0

    async def __aenter__(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        await anyio.to_thread.run_sync(_truncate_partial_tail, self.path)
        self._tg.start_soon(self._writer)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._send.close()
        # Whatever happened, what was appended reaches the disk.
        with anyio.CancelScope(shield=True):
            await self._done.wait()
        if self._error is not None and exc is None:
            raise OSError(f"writing the journal {self.path} failed: {self._error}")

    def append(self, result: RolloutResult) -> None:
        """Queue a result for writing. Never blocks; safe during cancellation."""
        self._send.send_nowait(result)

    async def _writer(self) -> None:
        try:
            # Drain even when the batch is cancelled.
            with anyio.CancelScope(shield=True), self._receive, self.path.open("ab") as f:
                async for first in self._receive:
                    lines = [first]
                    while len(lines) < _MAX_LINES_PER_WRITE:
                        try:
                            lines.append(self._receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    await anyio.to_thread.run_sync(_write, f, _encode(lines))
                    self.written += len(lines)
        except OSError as exc:
            self._error = exc
        finally:
            self._done.set()


def _encode(results: Iterable[RolloutResult]) -> bytes:
    return b"".join(r.model_dump_json().encode() + b"\n" for r in results)


def _write(f: BinaryIO, data: bytes) -> None:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
