"""The result journal: every finished rollout on disk, so a crash loses none.

Results are appended to a JSON Lines file as they complete; a writer task
gathers whatever is ready and writes and fsyncs it in one go, in a worker
thread (never on the event loop). A line is written whole or the reader
drops it: :func:`read_journal` ignores (and :class:`Journal` truncates) a
last line without its newline, which is all a ``kill -9`` mid-write can
leave behind. A complete line that is not a result (a disk's corruption, an
edit) is skipped with a warning naming the file and line: its rollout counts
as not done, so a resume runs it again.

No one result can stop the journal: a result JSON cannot hold (a string with
a lone surrogate, from a tool, a verifier or a policy) is journaled as its
rollout's failure, ``result_error``, whose ``error`` names the field
(:func:`~fleetroll.results.writable_result`; a rollout's machine makes it as
the rollout ends, so every view serves it; :func:`journal_line` is the net).
A write that fails (a full disk) is final: the journal cuts the file back to
its last whole write, writes nothing more, and tells its owner
(``on_failed``), who stops the batch; what was not written is never reported
written, so a reader is never shown a result the disk does not hold.

A rollout may have several lines (a resumed batch re-runs the rollouts it
had cancelled): the last one is its result.

With ``images="files"`` (``policy.image_store``), the images of turns and
trajectories are not written into the lines: each PNG is a file of its own in
``<journal>.images/``, named by its SHA-256 (the same screenshot in many turns,
or many rollouts, is one file), written and fsynced before the line that
names it; the line holds its reference (``path``, relative to the journal's
folder, with ``sha256`` and ``nbytes``). :func:`inline_images` (and
:meth:`~fleetroll.results.TurnImage.png`) read them back. The results the
journal hands back (:meth:`Journal.append`, ``on_written``) keep their images
inline: only the disk differs.

One run writes a journal at a time: :func:`claim_journal` takes an
exclusive lock on the file for the run's lifetime, and keeps the batch's
identity (its id, samples, and a digest of each task's content) in a
sidecar ``<journal>.meta.json``, so that a resume with other tasks or
other samples is refused instead of mixing results of two batches.

A run of steps (``fleetroll run --steps N --batch-tasks M``) journals every
step's batch in one file, each under the batch id :func:`step_batch_id`
makes of the run's id; its identity records ``batch_tasks``, and the task
sampler's state is kept in a second sidecar, ``<journal>.sampler.json``
(:func:`write_sampler_state`), as it was when the last step started.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from fleetroll.errors import ConfigError, JournalError
from fleetroll.results import (
    FailureReason,
    RolloutResult,
    TurnImage,
    map_images,
    writable_result,
)
from fleetroll.tasks import TaskSpec
from fleetroll.training.sampler import SamplerState

__all__ = [
    "BatchIdentity",
    "Journal",
    "JournalClaim",
    "JournalError",
    "claim_journal",
    "images_folder",
    "inline_images",
    "journal_line",
    "meta_path",
    "read_journal",
    "read_lines",
    "read_sampler_state",
    "rebased_images",
    "sampler_path",
    "step_batch_id",
    "stored_images",
    "write_results",
    "write_sampler_state",
]

_MAX_LINES_PER_WRITE = 512
#: A result queued for the journal: as handed back, its line, its image files.
_Queued = tuple[RolloutResult, bytes, list[tuple[str, bytes]]]
_log = logging.getLogger(__name__)
_META_FORMAT = 1
_STEP = "-step"


def read_journal(path: Path, *, latest: bool = True, strict: bool = False) -> list[RolloutResult]:
    """The results in ``path`` (none when it does not exist).

    With ``latest`` (the default), one result per rollout id: its last line,
    in the order of those last lines. Otherwise every line, in file order.
    A last line without a newline (a write cut short) is ignored; a complete
    line that is not a result is skipped with a warning (:func:`read_lines`),
    or, with ``strict`` (a results file read as input: ``eval``, ``rescore``,
    which would otherwise drop it unseen), an error.

    Raises:
        ValueError: ``path`` is not a regular file; with ``strict``, a line is
            not a result (the message names the file and line first).
        OSError: ``path`` cannot be read.
    """
    results = [r for r in read_lines(path, strict=strict) if r is not None]
    if not latest:
        return results
    last: dict[str, RolloutResult] = {}
    for r in results:
        last.pop(r.rollout_id, None)
        last[r.rollout_id] = r
    return list(last.values())


def read_lines(path: Path, *, strict: bool = False) -> list[RolloutResult | None]:
    """Every complete line of the journal at ``path``, in file order: its result,
    or None for a line that is not one (logged as a warning naming the file and
    line; its rollout counts as not done). Blank lines are left out, as is a
    last line without its newline (a write cut short). Empty when ``path`` does
    not exist.

    Raises:
        ValueError: ``path`` is not a regular file; with ``strict``, a line is
            not a result.
        OSError: ``path`` cannot be read.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        return []
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file")
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    results: list[RolloutResult | None] = []
    for number, line in enumerate(complete.split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            results.append(RolloutResult.model_validate_json(line))
        except ValueError as exc:
            why = " ".join(str(exc).split())[:200]
            if strict:
                raise ValueError(f"{path}:{number}: not a rollout result: {why}") from None
            _log.warning(
                "%s:%d: not a rollout result, skipped (its rollout counts as not done): %s",
                path,
                number,
                why,
            )
            results.append(None)
    return results


def write_results(path: Path, results: Iterable[RolloutResult]) -> None:
    """Write ``results`` as a results file (JSON Lines) at ``path``, atomically:
    a reader sees the old file or the whole new one (``fleetroll rescore``).

    Raises:
        OSError: the file (or its temporary sibling) could not be written.
    """
    _write_atomically(path, _encode(results))


def meta_path(path: Path) -> Path:
    """Where the journal at ``path`` keeps its batch's identity."""
    return path.with_name(path.name + ".meta.json")


def images_folder(path: Path) -> Path:
    """Where the journal at ``path`` keeps its images as files (``policy.image_store``)."""
    return path.with_name(path.name + ".images")


#: One image to write beside a journal: its SHA-256 and its PNG.
ImageFile = tuple[str, bytes]


def stored_images(result: RolloutResult, path: Path) -> tuple[RolloutResult, list[ImageFile]]:
    """``result`` as the journal at ``path`` holds it with ``images="files"``:
    every inline image replaced by its file's reference, and the files to
    write (each distinct image once)."""
    files: dict[str, bytes] = {}
    folder = images_folder(path).name

    def to_file(image: TurnImage) -> TurnImage:
        if image.data is None:
            return image  # a file already
        png = image.png()
        files.setdefault(image.sha256, png)
        return image.model_copy(
            update={"data": None, "path": f"{folder}/{image.sha256}.png", "nbytes": len(png)}
        )

    stored = map_images(result, to_file)
    return stored, list(files.items())


def inline_images(result: RolloutResult, root: Path) -> RolloutResult:
    """``result`` with every image that is a file (``policy.image_store =
    "files"``) read back into ``data``; ``root`` is the journal's folder.

    Raises:
        ValueError: a file's bytes are not its image's.
        OSError: a file cannot be read.
    """
    return map_images(result, lambda image: image.inline(root))


def rebased_images(result: RolloutResult, old: Path, new: Path) -> RolloutResult:
    """``result``, read from a file in folder ``old``, as a file in folder
    ``new`` holds it: each image file's ``path`` made relative to ``new``
    (the files stay where they are)."""

    def rebase(image: TurnImage) -> TurnImage:
        if image.path is None:
            return image
        path = os.path.relpath(os.path.join(old, image.path), new)
        return image.model_copy(update={"path": Path(path).as_posix()})

    return map_images(result, rebase) if old.resolve() != new.resolve() else result


def sampler_path(path: Path) -> Path:
    """Where the journal at ``path`` of a run of steps keeps its task sampler's state."""
    return path.with_name(path.name + ".sampler.json")


def step_batch_id(run_id: str, step: int) -> str:
    """The batch id of step ``step`` (from 0) of the run of steps ``run_id``."""
    return f"{run_id}{_STEP}{step}"


def write_sampler_state(path: Path, state: SamplerState) -> None:
    """Keep ``state`` beside the journal at ``path``, atomically. Blocking file I/O."""
    _write_atomically(sampler_path(path), state.model_dump_json(indent=1).encode())


def read_sampler_state(path: Path) -> SamplerState | None:
    """The sampler state kept beside the journal at ``path``; None when there is none.

    Raises:
        ConfigError: the file is there but is not a sampler state.
    """
    where = sampler_path(path)
    try:
        data = where.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror}") from None
    try:
        return SamplerState.model_validate_json(data)
    except ValueError as exc:
        raise ConfigError(f"{where}: not a sampler state: {exc}") from None


def task_digest(task: TaskSpec) -> str:
    """A digest of everything a task says (prompt, env, verifier, solution...).

    Fields left at their defaults are left out, so a field added to
    :class:`TaskSpec` later does not change the digest of existing tasks.
    """
    spec = task.model_dump(mode="json", exclude_defaults=True)
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class BatchIdentity:
    """What makes a batch the same batch: its id, its samples, its oversample,
    its tasks' content.

    ``oversample`` is None in an identity written before it was recorded: such
    a journal resumes whatever this run's ``pool.oversample`` (as it did).
    ``batch_tasks`` is set for a run of steps (``--steps``, ``--batch-tasks``):
    ``batch_id`` is then the run's id and ``tasks`` the set the steps draw from.
    """

    batch_id: str
    samples: int
    tasks: Mapping[str, str] = field(repr=False)  # task key -> task_digest
    oversample: int | None = 0
    batch_tasks: int | None = None

    @classmethod
    def of(
        cls,
        batch_id: str,
        tasks: Sequence[TaskSpec],
        samples: int,
        oversample: int = 0,
        batch_tasks: int | None = None,
    ) -> BatchIdentity:
        digests = {t.key: task_digest(t) for t in tasks}
        return cls(batch_id, samples, digests, oversample, batch_tasks)

    def difference(self, other: BatchIdentity) -> str | None:
        """How ``other`` (this run) differs from this batch, or None (batch ids aside)."""
        if other.batch_tasks != self.batch_tasks:
            if self.batch_tasks is None:
                return "it was started as one batch, without --steps"
            if other.batch_tasks is None:
                return "it was started with --steps, this run asks for one batch"
            return (
                f"it was started with --batch-tasks {self.batch_tasks},"
                f" this run asks for {other.batch_tasks}"
            )
        if other.samples != self.samples:
            return (
                f"it was started with --samples {self.samples}, this run asks for {other.samples}"
            )
        if None not in (self.oversample, other.oversample) and other.oversample != self.oversample:
            return (
                f"it was started with pool.oversample = {self.oversample}, this run asks"
                f" for {other.oversample}"
            )
        for key, digest in self.tasks.items():
            if key not in other.tasks:
                return f"its task {key!r} is not among this run's tasks"
            if other.tasks[key] != digest:
                return f"task {key!r} has changed since it was started"
        for key in other.tasks:
            if key not in self.tasks:
                return f"task {key!r} was not in the batch it was started with"
        return None

    def to_json(self) -> bytes:
        raw: dict[str, Any] = {
            "format": _META_FORMAT,
            "batch_id": self.batch_id,
            "samples": self.samples,
            "oversample": self.oversample,
            "tasks": dict(self.tasks),
        }
        if self.batch_tasks is not None:  # a run of steps
            raw["batch_tasks"] = self.batch_tasks
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> BatchIdentity:
        """Raises: ValueError: not a batch identity this version writes."""
        try:
            raw: Any = json.loads(data)
            if raw.get("format") != _META_FORMAT:
                raise ValueError(f"unknown format {raw.get('format')!r}")
            tasks = raw["tasks"]
            if not isinstance(tasks, dict):
                raise ValueError("'tasks' is not an object")
            oversample = raw.get("oversample")  # absent: written before it was recorded
            batch_tasks = raw.get("batch_tasks")  # absent: one batch
            return cls(
                str(raw["batch_id"]),
                int(raw["samples"]),
                tasks,
                None if oversample is None else int(oversample),
                None if batch_tasks is None else int(batch_tasks),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a batch identity: {exc}") from None


@dataclass(slots=True)
class JournalClaim:
    """A journal this run holds the lock of, and what a resume starts from.

    Attributes:
        batch_id: the batch's id (the journaled one on resume).
        previous: the last result of every rollout journaled, cancelled ones
            included (use :attr:`done` for what a resume skips).
    """

    path: Path
    batch_id: str
    previous: list[RolloutResult]
    _fd: int | None

    @property
    def done(self) -> list[RolloutResult]:
        """Results a resume keeps: every last result that is not ``cancelled``."""
        return [r for r in self.previous if r.failure_reason is not FailureReason.CANCELLED]

    def close(self) -> None:
        """Release the lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def claim_journal(path: Path, identity: BatchIdentity, *, resume: bool) -> JournalClaim:
    """Lock the journal at ``path`` for one run and check the batch it holds.

    A fresh journal (absent or empty) gets ``identity`` written beside it. A
    journal with results needs ``resume`` and must belong to the same batch:
    the same tasks (key and content) and samples. Blocking file I/O: call it
    from a worker thread.

    Raises:
        ConfigError: ``path`` is not a regular file, another run holds its
            lock, it has results and ``resume`` was not asked, or it belongs
            to another batch; or it (or its identity) cannot be read or
            written. The message says which and what to do.
    """
    fd = _open_locked(path)
    with contextlib.ExitStack() as undo:
        undo.callback(os.close, fd)  # unless the claim is made
        try:
            claim = _check(path, fd, identity, resume=resume)
        except OSError as exc:  # its identity could not be written (a full disk), or read
            where = exc.filename or path
            raise ConfigError(f"--out {path}: {where}: {exc.strerror or exc}") from None
        undo.pop_all()
    return claim


def check_journal(path: Path, identity: BatchIdentity, *, resume: bool) -> None:
    """Refuse now what :func:`claim_journal` would refuse, leaving nothing behind.

    For a command line that wants its user's mistakes said before it starts
    anything; the claim still checks again. A journal that does not exist
    yet passes (the claim creates it).

    Raises:
        ConfigError: as :func:`claim_journal`.
    """
    if not os.path.lexists(path):
        return
    fd = _open_locked(path)
    try:
        _check(path, fd, identity, resume=resume, write=False)
    finally:
        os.close(fd)


def _open_locked(path: Path) -> int:
    try:
        info = path.stat()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"--out {path}: {exc.strerror}") from None
    else:
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"--out {path}: not a regular file (a journal must be a plain file)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_NONBLOCK: opening whatever replaced the file since (a FIFO) must not hang.
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise ConfigError(f"--out {path}: cannot open it: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"--out {path}: not a regular file (a journal must be a plain file)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"--out {path} is in use by another fleetroll run; "
            "wait for it to end, or choose another --out"
        ) from None
    return fd


def _check(
    path: Path, fd: int, identity: BatchIdentity, *, resume: bool, write: bool = True
) -> JournalClaim:
    meta = meta_path(path)
    if os.fstat(fd).st_size == 0:
        kept = _started_before(meta, identity) if resume else None
        if kept is not None:
            # Killed before its first result: the same batch, and the same batch id
            # (its instances' run id, which the resume releases).
            return JournalClaim(path, kept.batch_id, [], fd)
        if write:
            _write_atomically(meta, identity.to_json())
        return JournalClaim(path, identity.batch_id, [], fd)
    if not resume:
        raise ConfigError(
            f"{path} already exists: pass --resume to continue that batch, or choose another --out"
        )
    try:
        previous = read_journal(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    batches = sorted({r.batch_id for r in previous})
    try:
        started: BatchIdentity | None = BatchIdentity.from_json(meta.read_bytes())
    except FileNotFoundError:
        started = None  # a journal from before identities were kept
    except ValueError as exc:
        raise ConfigError(f"{meta}: {exc}") from None
    if started is not None and started.batch_tasks is not None:
        stray = [b for b in batches if not b.startswith(f"{started.batch_id}{_STEP}")]
        if stray:
            raise ConfigError(
                f"{path} holds batch {stray[0]}, not a step of the run {started.batch_id}"
                f" that {meta} says"
            )
    elif len(batches) > 1:
        raise ConfigError(f"{path} holds results of several batches ({', '.join(batches)})")
    elif started is None and identity.batch_tasks is not None:
        raise ConfigError(f"cannot resume {path} with --steps: {meta} is missing")
    if started is not None:
        if started.batch_tasks is None and batches and batches != [started.batch_id]:
            raise ConfigError(
                f"{path} holds batch {batches[0]}, but {meta} says {started.batch_id}"
            )
        why = started.difference(identity)
        if why is not None:
            raise ConfigError(
                f"cannot resume {path}: {why}; resume with the same tasks, --samples,"
                " pool.oversample (and --batch-tasks), or choose another --out"
            )
        return JournalClaim(path, started.batch_id, previous, fd)
    unknown = sorted({r.task_key for r in previous} - set(identity.tasks))
    if unknown:
        raise ConfigError(
            f"cannot resume {path}: it holds results for tasks not among this run's tasks: "
            + ", ".join(unknown[:5])
        )
    beyond = max((r.sample_index for r in previous), default=0)
    if beyond >= identity.samples + (identity.oversample or 0):
        raise ConfigError(
            f"cannot resume {path}: it holds sample {beyond} of a task, "
            f"this run asks for --samples {identity.samples}"
        )
    batch_id = batches[0] if batches else identity.batch_id
    started = BatchIdentity(batch_id, identity.samples, identity.tasks, identity.oversample)
    if write:
        _write_atomically(meta, started.to_json())
    return JournalClaim(path, batch_id, previous, fd)


def _started_before(meta: Path, identity: BatchIdentity) -> BatchIdentity | None:
    """The identity in ``meta`` if it is this batch's (same tasks and samples), else None."""
    try:
        started = BatchIdentity.from_json(meta.read_bytes())
    except (OSError, ValueError):
        return None
    return started if started.difference(identity) is None else None


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename reaches the disk with its folder
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _truncate_partial_tail(path: Path) -> None:
    try:
        info = path.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path}: not a regular file (a journal must be a plain file)")
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

    ``images="files"`` keeps every image of turns and trajectories as a file
    in :func:`images_folder`, named by its SHA-256 and written before the first
    line that names it; the lines hold references (:func:`stored_images`).

    ``on_written`` hears of each result once it is on disk: a service shows a
    result to its readers only then, so a crash never takes back what a reader
    saw. A write that fails is final: the file is cut back to its last whole
    write, nothing more is written, ``on_failed`` hears why (once), the results
    not written never reach ``on_written``, and leaving the block raises
    :class:`~fleetroll.errors.JournalError`.
    """

    def __init__(
        self,
        path: Path,
        task_group: TaskGroup,
        *,
        on_written: Callable[[Sequence[RolloutResult]], None] | None = None,
        on_failed: Callable[[OSError], None] | None = None,
        images: Literal["inline", "files"] = "inline",
    ) -> None:
        self.path = path
        self.images = images
        #: The images already on disk beside the journal (by SHA-256).
        self._image_files: set[str] = set()
        self._tg = task_group
        #: Called on the loop with each group of results once they are on disk.
        self._on_written = on_written
        #: Called on the loop, once, when a write failed (nothing is written after it).
        self._on_failed = on_failed
        self._send: MemoryObjectSendStream[_Queued]
        self._receive: MemoryObjectReceiveStream[_Queued]
        self._send, self._receive = anyio.create_memory_object_stream[_Queued](
            max_buffer_size=float("inf")
        )
        self._done = anyio.Event()
        self._error: OSError | None = None
        #: Results on disk.
        self.written = 0

    async def __aenter__(self) -> Self:
        """Raises: JournalError: the file cannot be opened for appending."""
        try:
            self._fd = await anyio.to_thread.run_sync(_open_append, self.path)
        except OSError as exc:
            raise JournalError(self.path, exc, 0) from None
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
            raise JournalError(self.path, self._error, self.written)

    @property
    def error(self) -> OSError | None:
        """Why writing failed (then nothing more is written), or None."""
        return self._error

    def append(self, result: RolloutResult) -> RolloutResult:
        """Queue a result for writing; the result as journaled (:func:`journal_line`).

        Never blocks; safe during cancellation. After a write failed, nothing
        is queued (and nothing more written).
        """
        if self._error is not None:
            return result
        kept, line = journal_line(result)
        if kept is not result:
            _log.warning(
                "journal %s: rollout %s: %s; journaled as %s",
                self.path,
                kept.rollout_id,
                kept.error,
                FailureReason.RESULT_ERROR.value,
            )
        files: list[ImageFile] = []
        if self.images == "files":
            stored, files = stored_images(kept, self.path)
            if stored is not kept:
                line = stored.model_dump_json().encode() + b"\n"
        self._send.send_nowait((kept, line, files))
        return kept

    async def _writer(self) -> None:
        fd = self._fd
        try:
            # Drain even when the batch is cancelled.
            with anyio.CancelScope(shield=True), self._receive:
                try:
                    kept = os.lseek(fd, 0, os.SEEK_END)  # the end of the last whole write
                    async for first in self._receive:
                        group = [first]
                        while len(group) < _MAX_LINES_PER_WRITE:
                            try:
                                group.append(self._receive.receive_nowait())
                            except (anyio.WouldBlock, anyio.EndOfStream):
                                break
                        data = b"".join(line for _, line, _ in group)
                        files = [file for _, _, files in group for file in files]
                        try:
                            if files:  # on disk before any line that names them
                                await anyio.to_thread.run_sync(
                                    _write_images,
                                    images_folder(self.path),
                                    files,
                                    self._image_files,
                                )
                            await anyio.to_thread.run_sync(_write, fd, data)
                        except OSError:
                            # What got out of the failed write was never acknowledged:
                            # the file holds exactly what its listeners heard of.
                            await anyio.to_thread.run_sync(_cut, fd, kept, self.path)
                            raise
                        kept += len(data)
                        self.written += len(group)
                        # On disk now: what a watcher of a run (and its tests) can wait on.
                        _log.debug("journal %s: %d results written", self.path, self.written)
                        if self._on_written is not None:
                            self._on_written([result for result, _, _ in group])
                except OSError as exc:
                    self._error = exc
                    if self._on_failed is not None:
                        self._on_failed(exc)
                    async for _ in self._receive:
                        pass  # not written, so never reported written
        finally:
            os.close(fd)
            self._done.set()


def journal_line(result: RolloutResult) -> tuple[RolloutResult, bytes]:
    """The journal line of ``result``, and the result that line holds.

    That is ``result`` itself, unless it cannot be written as JSON: then its
    stand-in, :func:`~fleetroll.results.writable_result` (``result_error``).
    A rollout's machine already hands out that stand-in, so every view of the
    rollout agrees with its line; this is the net for a result made elsewhere.
    """
    try:
        return result, result.model_dump_json().encode() + b"\n"
    except (ValueError, TypeError):  # pydantic's serialisation error is a ValueError
        stand_in = writable_result(result)
    return stand_in, _encode((stand_in,))


def _encode(results: Iterable[RolloutResult]) -> bytes:
    return b"".join(r.model_dump_json().encode() + b"\n" for r in results)


def _open_append(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_partial_tail(path)
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _write_images(folder: Path, files: Sequence[ImageFile], written: set[str]) -> None:
    """Each image not yet in ``folder`` written as ``<sha256>.png`` (whole or not
    at all: a temporary file renamed), fsynced with the folder; ``written``
    (the images known on disk) gains them."""
    new = False
    for sha256, png in files:
        if sha256 in written:
            continue
        target = folder / f"{sha256}.png"
        if not target.exists():  # a resumed run's, or another rollout's
            folder.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            with tmp.open("wb") as f:
                f.write(png)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            new = True
        written.add(sha256)
    if new:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write(fd: int, data: bytes) -> None:
    """All of ``data`` on disk (a short write goes on; an error is raised as it is)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def _cut(fd: int, size: int, path: Path) -> None:
    """Cut the file back to ``size`` bytes after a failed write (best effort: a
    failure is logged, and a reader drops a torn last line anyway)."""
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as exc:
        _log.warning("journal %s: cannot cut back the failed write: %s", path, exc)
