"""The processes and folders of the ``mcp`` provider (:mod:`fleetroll.environments.mcp.provider`).

* :func:`make_workdir` / :func:`remove_workdir`: a rollout's working directory
  (``tempfile.mkdtemp`` with :data:`WORKDIR_PREFIX`); removal refuses any
  folder this module did not make.
* :func:`run_command`: a command (``setup``, ``verifier.command``) in its own
  process group, output kept up to :data:`OUTPUT_KEPT`, killed at its limit.
* :func:`stop_process`: SIGTERM to a process group, SIGKILL after a grace; shielded.
* :func:`process_transport`: an MCP transport over a running server's pipes,
  its lines read by :class:`LineReader` (linear time, each capped).
* :func:`reward_number`, :func:`tool_reward`, :func:`no_reward`: a verifier's answer
  read as a reward (:mod:`fleetroll.tasks.verifier_results`: a finite number, a
  boolean, an object's ``score``, ``reward`` or ``value``), or a verdict without one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL, PIPE
from typing import TYPE_CHECKING, Any, Final

import anyio
import mcp_types as types
from anyio.abc import Process
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from fleetroll.environments.provider import Verdict
from fleetroll.errors import ProvisionError
from fleetroll.results import VerifierOutcome
from fleetroll.tasks.verifier_results import verifier_reward, verifier_reward_text
from fleetroll.tools.session import AnswerLimits, ToolResult

if TYPE_CHECKING:
    from mcp.shared.message import SessionMessage

__all__ = [
    "OUTPUT_KEPT",
    "WORKDIR_PREFIX",
    "LineReader",
    "Ran",
    "make_workdir",
    "no_reward",
    "open_program",
    "process_transport",
    "remove_workdir",
    "reward_number",
    "run_command",
    "stop_process",
    "tool_reward",
]

#: Every working directory the mcp provider makes starts so; it deletes no other.
WORKDIR_PREFIX: Final = "fleetroll-mcp-"
OUTPUT_KEPT: Final = 64 * 1024  # bytes of a command's stdout/stderr kept for the result


@dataclass(frozen=True, slots=True)
class Ran:
    """A finished (or killed) command."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


def make_workdir(root: Path | None, files: Mapping[str, str], made: list[Path]) -> Path:
    """A fresh folder (``WORKDIR_PREFIX``) under ``root`` holding ``work/`` with ``files``.

    The folder is appended to ``made`` as soon as it exists, so a caller
    cancelled meanwhile can still remove it.
    """
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=root)).resolve()
    made.append(folder)
    workdir = folder / "work"
    try:
        workdir.mkdir()
        for relative, text in files.items():
            target = (workdir / relative).resolve()
            if workdir not in target.parents:  # checked at load; a symlink could escape
                raise ProvisionError(
                    f"file {relative!r} leaves the working directory", transient=False
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    except (OSError, ProvisionError):
        made.clear()
        with suppress(OSError):
            remove_workdir(folder, root)
        raise
    return folder


def remove_workdir(folder: Path, root: Path | None) -> None:
    """Delete ``folder``, only if :func:`make_workdir` made it: its prefix, in its root.

    Raises:
        OSError: it is not such a folder, or it could not be removed.
    """
    expected = Path(tempfile.gettempdir() if root is None else root).resolve()
    if not folder.name.startswith(WORKDIR_PREFIX) or folder.parent != expected:
        raise OSError(f"refusing to remove {folder}: not a folder fleetroll made")
    shutil.rmtree(folder)


async def open_program(argv: list[str], **options: Any) -> Process:
    """``anyio.open_process(argv, **options)``, whose start-up errors name the program.

    asyncio's loop puts the program in a missing one's error; uvloop's (the
    loop of Ray's async actors, and of many trainers) says only "No such file
    or directory".

    Raises:
        OSError: it could not be started; ``filename`` is the program.
    """
    try:
        return await anyio.open_process(argv, **options)
    except OSError as exc:
        if exc.filename is not None or not argv or exc.errno is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, argv[0]) from None


async def run_command(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    limit_s: float,
    *,
    grace_s: float,
    wait_s: float,
) -> Ran:
    """Run a command in ``cwd`` in its own process group, killed at ``limit_s``.

    Stopping it is :func:`stop_process` with ``grace_s`` and ``wait_s``.

    Raises:
        OSError: it could not be started (no such command...).
    """
    process = await open_program(
        argv,
        cwd=cwd,
        env=env,
        stdin=DEVNULL,
        stdout=PIPE,
        stderr=PIPE,
        start_new_session=True,
    )
    out: list[bytes] = []
    err: list[bytes] = []
    try:
        with anyio.move_on_after(limit_s) as scope:
            async with anyio.create_task_group() as tg:
                assert process.stdout is not None and process.stderr is not None
                tg.start_soon(_collect, process.stdout, out)
                tg.start_soon(_collect, process.stderr, err)
            await process.wait()
    finally:
        await stop_process(process, grace_s=grace_s, wait_s=wait_s)
    return Ran(
        None if scope.cancelled_caught else process.returncode,
        b"".join(out).decode("utf-8", "replace"),
        b"".join(err).decode("utf-8", "replace"),
        scope.cancelled_caught,
    )


async def stop_process(process: Process, *, grace_s: float, wait_s: float) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace_s``; shielded.

    ``wait_s`` bounds the wait for the process after SIGKILL.
    """
    with anyio.CancelScope(shield=True):
        _signal_group(process.pid, signal.SIGTERM)
        with anyio.move_on_after(grace_s):
            await process.wait()
        # Even when the leader is gone, what it started may still run.
        _signal_group(process.pid, signal.SIGKILL)
        with anyio.move_on_after(wait_s):
            await process.wait()
        # The process's own aclose closes the pipes' transports too: a pipe whose
        # reading was paused (a server wrote more than was read) stays open else.
        with anyio.move_on_after(wait_s), suppress(Exception):
            await process.aclose()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _collect(stream: anyio.abc.ByteReceiveStream, into: list[bytes]) -> None:
    kept = 0
    with suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
        async for chunk in stream:
            if kept < OUTPUT_KEPT:
                into.append(chunk[: OUTPUT_KEPT - kept])
                kept += len(chunk)


#: A response's id, as the mcp SDK writes it (``jsonrpc``, ``id``, then ``result``/``error``).
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*(-?\d{1,18}|"[^"\\]{0,128}")\s*,\s*"(?:result|error)"')


class LineReader:
    """A server's stdout as JSON-RPC lines, split in linear time, each one capped.

    The pieces of the line being read are kept and joined once, when its
    newline arrives: joining the partial line to each new chunk copied it
    again per chunk, quadratic in the line's length (an 80 MB answer: 69 s).

    A line is capped by :class:`~fleetroll.tools.session.AnswerLimits` (the listing
    cap when it answers a ``tools/list`` request, see :meth:`sent`); past its
    cap the rest of the line is dropped unread, and the request it answers
    gets an :data:`~fleetroll.tools.session.ANSWER_TOO_LARGE` error instead.
    """

    def __init__(self, limits: AnswerLimits) -> None:
        self._limits = limits
        self._pieces: list[bytes] = []
        self._size = 0
        self._dropping = False  # the line passed its cap: dropped up to its newline
        self._listings: set[types.RequestId] = set()

    def sent(self, message: types.JSONRPCMessage) -> None:
        """Note a request written to the server (a listing's answer has its own cap)."""
        if isinstance(message, types.JSONRPCRequest) and message.method == "tools/list":
            if len(self._listings) >= 1024:  # answered long ago; never let it grow
                self._listings.clear()
            self._listings.add(message.id)

    def feed(self, chunk: bytes) -> list[SessionMessage | Exception]:
        """What ``chunk`` completes: parsed lines, and errors for lines over their cap."""
        out: list[SessionMessage | Exception] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            out += self._add(piece)
            if end < 0:
                return out
            if not self._dropping and self._pieces:
                line = b"".join(self._pieces)
                if line.strip():
                    out.append(_parse(line.decode("utf-8", "replace")))
            self._pieces, self._size, self._dropping = [], 0, False
            start = end + 1

    def _add(self, piece: bytes) -> list[SessionMessage | Exception]:
        if self._dropping or not piece:
            return []
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size <= min(self._limits.answer_bytes, self._limits.listing_bytes):
            return []
        request_id = self._answered()
        method = "tools/list" if request_id in self._listings else "tools/call"
        if self._size <= self._limits.cap(method)[0]:
            return []
        self._pieces, self._size, self._dropping = [], 0, True
        if request_id is None:  # not an answer to a request of ours: nobody waits on it
            return [ValueError(self._limits.too_large(None))]
        self._listings.discard(request_id)
        return [_message(self._limits.error(method, request_id))]

    def _answered(self) -> types.RequestId | None:
        """The id of the request the line being read answers, from its first bytes."""
        head, size = [], 0
        for piece in self._pieces:
            head.append(piece[: 512 - size])
            size += len(head[-1])
            if size >= 512:
                break
        found = _RESPONSE_ID.search(b"".join(head))
        if found is None:
            return None
        raw = found.group(1)
        return raw[1:-1].decode("utf-8", "replace") if raw[:1] == b'"' else int(raw)


@asynccontextmanager
async def process_transport(
    process: Process, stdout_closed: anyio.Event, limits: AnswerLimits
) -> AsyncIterator[
    tuple[
        MemoryObjectReceiveStream[SessionMessage | Exception],
        MemoryObjectSendStream[SessionMessage],
    ]
]:
    """An MCP transport over a running server's pipes, leaving the server running.

    The SDK's ``stdio_client`` starts and stops its own process; here the
    process outlives each session (the rollout's tools, then a verifier's
    tool call), and release kills it. Lines are read by :class:`LineReader`
    (linear time, capped by ``limits``).
    """
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout
    to_session, read_stream = anyio.create_memory_object_stream["SessionMessage | Exception"](0)
    write_stream, from_session = anyio.create_memory_object_stream["SessionMessage"](0)
    lines = LineReader(limits)

    async def read() -> None:
        async with to_session:
            with suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                async for chunk in stdout:
                    for message in lines.feed(chunk):
                        await to_session.send(message)
            stdout_closed.set()  # end of stream: the server is exiting

    async def write() -> None:
        async with from_session:
            try:
                async for message in from_session:
                    lines.sent(message.message)
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stdin.send((data + "\n").encode())
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                await to_session.aclose()  # the session sees the end, not a hang

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        tg.start_soon(write)
        try:
            yield read_stream, write_stream
        finally:
            tg.cancel_scope.cancel()
            read_stream.close()
            write_stream.close()


def _parse(line: str) -> SessionMessage | Exception:
    try:
        return _message(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


def _message(message: types.JSONRPCMessage) -> SessionMessage:
    """``message`` as the SDK's session reads it."""
    # Imported here: ``mcp`` loads starlette and uvicorn (its server side), which
    # importing the pool does not; by now a session has imported it anyway.
    from mcp.shared.message import SessionMessage

    return SessionMessage(message)


# -- what a verifier answered -------------------------------------------------


def no_reward(error: str, stdout: str, error_type: str = "VerifierError") -> Verdict:
    return Verdict(None, VerifierOutcome(success=False, stdout=stdout, error=error), error_type)


def reward_number(text: str) -> float | None:
    """The reward a line or a reward file states
    (:func:`~fleetroll.tasks.verifier_results.verifier_reward_text`), or None."""
    try:
        return verifier_reward_text(text)
    except ValueError:
        return None


def tool_reward(answer: ToolResult) -> float:
    """The reward a verifier tool answered: its structured content read by
    :func:`~fleetroll.tasks.verifier_results.verifier_reward` (a bare value is
    wrapped as ``{"result": ...}`` by MCP), else its text.

    Raises:
        ValueError: neither holds a reward; the message says what the tool answered.
    """
    structured = answer.structured
    if isinstance(structured, Mapping) and set(structured) == {"result"}:
        structured = structured["result"]
    if structured is not None:
        try:
            return verifier_reward(structured)
        except ValueError:
            if not answer.text.strip():
                raise
    try:
        return verifier_reward_text(answer.text)
    except ValueError:
        shown = answer.text.strip()[:80]
        raise ValueError(f"the verifier tool answered {shown!r}, not a reward") from None
