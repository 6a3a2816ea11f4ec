"""What ``fleetroll serve`` keeps on disk, so that a restart forgets no batch.

``service.state_dir`` holds, under an exclusive lock for the service's
lifetime, one :mod:`fleetroll.pool.journal` per batch and the batch's request::

    <state_dir>/lock
    <state_dir>/batches/<batch_id>.jsonl            every result, in the order stored
    <state_dir>/batches/<batch_id>.jsonl.meta.json  the request (tasks, samples, policy...)

The request is written (atomically) before the batch is accepted; a result
is shown to readers only once its line is on disk, so a line's number is
the result's cursor before and after any restart, and nothing a reader saw
is taken back by a crash. A policy's ``api_key`` is never written: a
resubmission brings it again.

At start-up :func:`open_store` locks the folder and reads every batch back
(a line cut short by a kill is dropped, as ``run --resume`` does; a complete
line that is not a result is skipped with a warning naming the file and
line, keeping its cursor, and its rollout counts as having no result).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
from pydantic import BaseModel, ConfigDict, ValidationError

from fleetroll.errors import ConfigError
from fleetroll.pool.journal import _write_atomically, meta_path, read_lines
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.service.models import PolicyConfig
from fleetroll.tasks import TaskSpec

__all__ = [
    "BatchStore",
    "StoredBatch",
    "StoredRequest",
    "open_store",
    "rerun_starts",
    "service_run_id",
]

_SUFFIX = ".jsonl"
_CANCELLED = FailureReason.CANCELLED


class StoredRequest(BaseModel):
    """A batch's request as the service accepted it (``<id>.jsonl.meta.json``)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = 1
    batch_id: str
    #: The request's identity (:func:`fleetroll.service.requests.batch_fingerprint`).
    fingerprint: str
    tasks: list[TaskSpec]
    #: Its policy without the ``api_key`` (never written).
    policy: PolicyConfig | None = None
    samples_per_task: int
    deadline_s: float | None = None
    oversample: int = 0
    max_in_flight: int | None = None
    policy_version: int | None = None
    #: The agent command each rollout runs (``agent_command``), or None.
    agent_command: list[str] | None = None
    #: Its ``groups_target`` (straggler cut-off by whole groups), or None.
    groups_target: int | None = None


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """A batch read back at start-up: its request, every result line (None: a line
    that is not a result), when it last changed."""

    request: StoredRequest
    results: Sequence[RolloutResult | None]
    mtime: float


class BatchStore:
    """The batches folder of ``service.state_dir``, locked by this process.

    Every method does blocking file I/O: call it from a worker thread.
    """

    def __init__(self, root: Path, lock_fd: int) -> None:
        self.root = root
        self.folder = root / "batches"
        self._lock_fd: int | None = lock_fd
        #: Read at start-up by :func:`open_store`, oldest change first.
        self.restored: list[StoredBatch] = []
        #: The service's run id, kept in the folder across restarts (:meth:`read_run_id`).
        self.run_id = ""

    def read_run_id(self, *, make: bool) -> str | None:
        """The run id every instance of this service is tagged under (``{run_id}-{batch}``):
        made on first use (``make``) and kept in ``run_id``, so a restart on the same
        folder finds what a killed start left behind. None: none made yet."""
        path = self.root / "run_id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            if not make:
                return None
        run_id = f"svc-{uuid.uuid4().hex[:12]}"
        _write_atomically(path, run_id.encode())
        return run_id

    def journal_path(self, batch_id: str) -> Path:
        """Where the results of ``batch_id`` are journaled (batch ids are safe file names)."""
        return self.folder / f"{batch_id}{_SUFFIX}"

    def save_request(self, request: StoredRequest) -> None:
        """Write a new batch's request (atomically, on disk when this returns)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        data = request.model_dump_json(exclude={"policy": {"api_key"}}).encode()
        _write_atomically(meta_path(self.journal_path(request.batch_id)), data)

    def remove(self, batch_id: str) -> None:
        """Forget a batch: its journal and its request."""
        path = self.journal_path(batch_id)
        for gone in (path, meta_path(path)):
            with contextlib.suppress(FileNotFoundError):
                gone.unlink()

    def load(self) -> list[StoredBatch]:
        """Every batch in the folder, oldest change first.

        Raises:
            ConfigError: a request or a journal cannot be read (the message
                names the file and what to do).
        """
        batches: list[StoredBatch] = []
        for meta in sorted(self.folder.glob(f"*{_SUFFIX}.meta.json")):
            journal = meta.with_name(meta.name.removesuffix(".meta.json"))
            try:
                request = StoredRequest.model_validate_json(meta.read_bytes())
                results = read_lines(journal)
                mtime = max(meta.stat().st_mtime, _mtime(journal))
            except (OSError, ValidationError, ValueError) as exc:
                reason = str(exc).splitlines()[0]
                raise ConfigError(
                    f"service.state_dir: cannot read the batch stored in {meta}: {reason};"
                    " move that batch's two files away (or delete them) and start again"
                ) from None
            if request.batch_id != journal.name.removesuffix(_SUFFIX):
                raise ConfigError(
                    f"service.state_dir: {meta} holds batch {request.batch_id!r}, not the"
                    " one its name says; move that batch's two files away and start again"
                )
            batches.append(StoredBatch(request, results, mtime))
        batches.sort(key=lambda b: b.mtime)
        return batches

    def close(self) -> None:
        """Let go of the folder's lock."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _lock(root: Path) -> BatchStore:
    """Raises: ConfigError: the folder cannot be made, or another service holds it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"service.state_dir {root}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"service.state_dir {root} is in use by another fleetroll serve; stop it, or"
            " give this one another folder (FLEETROLL_SERVICE__STATE_DIR)"
        ) from None
    return BatchStore(root, fd)


def _open(root: Path) -> BatchStore:
    store = _lock(root)
    try:
        store.run_id = store.read_run_id(make=True) or ""
        store.restored = store.load()
    except BaseException:
        store.close()
        raise
    return store


def service_run_id(root: Path) -> str | None:
    """The run id of the service whose ``service.state_dir`` is ``root`` (None: it never ran).

    Blocking file I/O: call it from a worker thread.

    Raises:
        ConfigError: a running service holds the folder (its instances are live).
    """
    store = _lock(root)
    try:
        return store.read_run_id(make=False)
    finally:
        store.close()


@contextlib.asynccontextmanager
async def open_store(root: Path) -> AsyncIterator[BatchStore]:
    """Lock ``root`` (``service.state_dir``) and read its batches back, for the block's life.

    Raises:
        ConfigError: another service holds the folder, or a stored batch
            cannot be read.
    """
    store = await anyio.to_thread.run_sync(_open, root)
    try:
        yield store
    finally:
        store.close()


def rerun_starts(
    results: Sequence[RolloutResult | None], rollout_ids: Collection[str]
) -> Iterator[tuple[int, frozenset[str]]]:
    """Where a batch's stored results show a resubmission began re-running rollouts.

    ``rollout_ids`` are the batch's. A re-run starts at the first line of a
    rollout that has a line already and is not among those the re-run in
    progress still owes; it re-runs what a resubmission runs: every rollout
    of the batch but those whose newest result is not ``cancelled``. Yields
    ``(index, rollout ids)`` of each.
    """
    newest: dict[str, RolloutResult] = {}
    owed: set[str] = set()
    for i, result in enumerate(results):
        if result is None:  # a line that is not a result: no rollout's
            continue
        rid = result.rollout_id
        if rid in newest and rid not in owed:
            kept = {r for r, res in newest.items() if res.failure_reason is not _CANCELLED}
            owed = (set(rollout_ids) - kept) | {rid}
            yield i, frozenset(owed)
        owed.discard(rid)
        newest[rid] = result
