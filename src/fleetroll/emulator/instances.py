"""Instances of the emulator: their state, lifetimes and SQLite databases.

Each instance owns one SQLite file (its ``current`` database), seeded by its
environment from the create's ``data_key``. The file is what tools change and
what the verifier subprocess reads, so scoring always sees the real state.

A reset (Fleet's ``ResetRequest``) may name a ``seed`` and a ``timestamp``:
the instance's random source (:attr:`Instance.rng`, what environments draw
their random values from) starts from the seed (seed 0 when none is given), and
its clock (:meth:`Instance.now`, and ``fleet_now()`` in its database's SQL)
stands still at the timestamp (the wall clock when none is given). So a
seeded, time-pinned reset followed by the same tool calls gives the same
state every time.

Time-based ends (TTL, missed heartbeats, injected death) are kept in a heap of
deadlines, so the reaper wakes only when one is due, and looks only at that
instance. Ended instances are kept for late reads (a ``GET`` or ``DELETE``
after a death) up to a count and an age; then they and their files go.
"""

from __future__ import annotations

import heapq
import itertools
import random
import secrets
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetroll.emulator.ledger import Ledger

if TYPE_CHECKING:
    from fleetroll.emulator.envs.base import SampleEnv

__all__ = [
    "MISSED_HEARTBEATS",
    "Instance",
    "InstanceStatus",
    "InstanceStore",
    "NewDatabase",
    "bind_clock",
]

TEAM_ID = "team-emulator"
#: An instance made with a heartbeat interval stops once its last heartbeat is
#: this many intervals old (monitoring starts at its first heartbeat). Fleet
#: does not publish its factor; two is what fleetroll plans for: it beats a new
#: instance at once and then every half interval, so one lost beat never stops
#: an instance, and a killed process's instances stop between 1.5 and 2
#: intervals after its last beat.
MISSED_HEARTBEATS = 2


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


class InstanceStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    STOPPED = "stopped"
    ERROR = "error"


@dataclass(eq=False)
class Instance:
    """One emulated Fleet instance."""

    instance_id: str
    env: SampleEnv
    version: str
    data_key: str | None
    data_version: str | None
    region: str
    run_id: str | None
    env_variables: dict[str, Any] | None
    image_type: str | None
    db_path: Path
    conn: sqlite3.Connection
    created_mono: float
    ttl_s: float | None
    dies_at_mono: float | None
    heartbeat_interval: int | None
    status: InstanceStatus = InstanceStatus.RUNNING
    created_at: str = field(default_factory=_now_iso)
    updated_at: str = field(default_factory=_now_iso)
    terminated_at: str | None = None
    last_heartbeat_mono: float | None = None
    last_heartbeat_at: str | None = None
    #: The last reset's seed and timestamp (Unix seconds); None: not given.
    seed: int | None = None
    timestamp: int | None = None
    #: What the environment draws its random values from (see the module's docstring).
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def now(self) -> datetime:
        """The instance's time: its reset's ``timestamp`` (standing still), else now (UTC)."""
        if self.timestamp is None:
            return datetime.now(UTC)
        return datetime.fromtimestamp(self.timestamp, UTC)

    @property
    def alive(self) -> bool:
        return self.status is InstanceStatus.RUNNING

    def age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.created_mono

    def deadline(self) -> float | None:
        """When this instance ends by itself unless something changes (monotonic)."""
        times = []
        if self.dies_at_mono is not None:
            times.append(self.dies_at_mono)
        if self.ttl_s is not None:
            times.append(self.created_mono + self.ttl_s)
        beats = self.heartbeat_deadline()
        if beats is not None:
            times.append(beats)
        return min(times, default=None)

    def heartbeat_deadline(self) -> float | None:
        """When missed heartbeats stop it (monotonic); None: not monitored (yet)."""
        if not self.heartbeat_interval or self.last_heartbeat_mono is None:
            return None
        return self.last_heartbeat_mono + MISSED_HEARTBEATS * self.heartbeat_interval

    def to_response(self, base_url: str) -> dict[str, Any]:
        """The instance as Fleet's ``InstanceResponse`` JSON."""
        root = f"{base_url}/instances/{self.instance_id}/"
        manager = f"{root}api/v1/env"
        return {
            "instance_id": self.instance_id,
            "env_key": self.env.key,
            "version": self.version,
            "status": self.status.value,
            "subdomain": self.instance_id,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "terminated_at": self.terminated_at,
            "team_id": TEAM_ID,
            "region": self.region,
            "env_variables": self.env_variables,
            "data_key": self.data_key,
            "data_version": self.data_version,
            "urls": {
                "root": root,
                "app": [root],
                "api": f"{root}raw",
                "health": f"{manager}/health",
                "api_docs": f"{manager}/docs",
                "manager": {
                    "api": manager,
                    "docs": f"{manager}/docs",
                    "reset": f"{manager}/reset",
                    "diff": f"{manager}/diff",
                    "snapshot": f"{manager}/snapshot",
                    "execute_verifier_function": f"{manager}/execute_verifier_function",
                    "execute_verifier_function_with_upload": (
                        f"{manager}/execute_verifier_function_with_upload"
                    ),
                },
            },
            "health": self.alive,
            "run_id": self.run_id,
            "profile_id": None,
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_region": None,
        }


def _only_this_file(action: int, *_: object) -> int:
    # The manager API runs any SQL a client sends: ATTACH would let it create
    # or read any file this user can.
    return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_ATTACH else sqlite3.SQLITE_OK


def open_db(path: Path, now: Callable[[], datetime] | None = None) -> sqlite3.Connection:
    """The instance's connection; ``fleet_now()`` in its SQL is ``now()`` in ISO
    form, to the second (the wall clock when ``now`` is None)."""
    # The emulator is a test double: durability buys nothing, speed does.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=MEMORY")
    conn.execute("PRAGMA synchronous=OFF")
    conn.set_authorizer(_only_this_file)
    bind_clock(conn, now)
    return conn


def bind_clock(conn: sqlite3.Connection, now: Callable[[], datetime] | None = None) -> None:
    """Give ``conn``'s SQL ``fleet_now()``: ``now()`` (else the wall clock, UTC) in ISO form."""
    clock = now or (lambda: datetime.now(UTC))
    conn.create_function("fleet_now", 0, lambda: clock().isoformat(timespec="seconds"))


class InstanceStore:
    """All instances of one emulator, keyed by id, with the ledger kept in step.

    Args:
        data_dir: the folder for the instances' SQLite files (made by the caller).
        keep_ended, keep_ended_s: ended instances kept, at most this many and
            this long; then they are forgotten and their files deleted.
    """

    def __init__(
        self,
        data_dir: Path,
        ledger: Ledger,
        *,
        keep_ended: int = 1024,
        keep_ended_s: float = 600.0,
        unseeded_random: bool = False,
    ) -> None:
        self._unseeded = unseeded_random
        self._dir = data_dir
        self._ledger = ledger
        self._instances: dict[str, Instance] = {}
        self._keep_ended = keep_ended
        self._keep_ended_s = keep_ended_s
        self._deadlines: list[tuple[float, int, str]] = []  # (when, tiebreak, instance id)
        self._tiebreak = itertools.count()
        self._ended: deque[tuple[float, str]] = deque()  # (when it ended, id), oldest first
        self._templates: dict[tuple[str, str], sqlite3.Connection] = {}
        #: Called when a deadline earlier than all others appears (the reaper's wake-up).
        self.on_earlier_deadline: Callable[[], None] | None = None

    @property
    def data_dir(self) -> Path:
        return self._dir

    def __len__(self) -> int:
        return len(self._instances)

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._instances.values()))

    def create(
        self,
        env: SampleEnv,
        *,
        version: str,
        data_key: str | None,
        data_version: str | None,
        region: str,
        run_id: str | None,
        env_variables: dict[str, Any] | None,
        image_type: str | None,
        ttl_s: float | None,
        dies_after_s: float | None,
        heartbeat_interval: int | None,
        database: NewDatabase | None = None,
    ) -> Instance:
        """Register a new running instance, on ``database`` (made now when None)."""
        if database is None:
            database = self.new_database(env, data_key)
            database.make()
        instance_id, db_path, conn = database.take()
        now = time.monotonic()
        inst = Instance(
            instance_id=instance_id,
            env=env,
            version=version,
            data_key=data_key,
            data_version=data_version,
            region=region,
            run_id=run_id,
            env_variables=env_variables,
            image_type=image_type,
            db_path=db_path,
            conn=conn,
            created_mono=now,
            rng=self._rng(None),
            ttl_s=ttl_s,
            dies_at_mono=None if dies_after_s is None else now + dies_after_s,
            heartbeat_interval=heartbeat_interval,
        )
        self._instances[instance_id] = inst
        self._ledger.instance_started(env.key)
        self._schedule(inst)
        return inst

    def new_database(self, env: SampleEnv, data_key: str | None) -> NewDatabase:
        """A new instance's database, to be made (perhaps in a worker thread) and
        handed to :meth:`create`. The seed's template is made here, on the caller's
        thread; :meth:`NewDatabase.make` only copies it into the new file."""
        # Unguessable: the instance's URLs (MCP, manager API) need no API key.
        instance_id = secrets.token_hex(8)
        template = self._seeded(env, data_key)
        return NewDatabase(instance_id, self._dir / f"{instance_id}.db", template)

    def _seeded(self, env: SampleEnv, data_key: str | None) -> sqlite3.Connection:
        """An in-memory database seeded for ``(env, data_key)``, made once.

        Instances get a copy, and a reset copies it again (SQLite's backup API
        copies pages in C): running the seed's SQL for each create and reset
        cost the emulator ~2.7 ms of CPU per realistic rollout.
        """
        key = (env.key, data_key or env.default_data_key)
        template = self._templates.get(key)
        if template is None:
            template = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            with template:  # one transaction for the whole seed
                template.execute("BEGIN")
                env.seed(template, key[1])
            self._templates[key] = template
        return template

    def heartbeat(self, inst: Instance) -> None:
        inst.last_heartbeat_mono = time.monotonic()
        inst.last_heartbeat_at = _now_iso()
        self._schedule(inst)

    def _schedule(self, inst: Instance) -> None:
        when = inst.deadline()
        if when is None:
            return
        if len(self._deadlines) > 2 * len(self._instances) + 64:
            # Entries of deleted instances, and deadlines a heartbeat moved, would
            # otherwise wait for their time: keep one per live instance, its current one.
            current = {
                i.instance_id: when
                for i in self._instances.values()
                if i.alive and (when := i.deadline()) is not None
            }
            self._deadlines = [e for e in self._deadlines if current.get(e[2]) == e[0]]
            heapq.heapify(self._deadlines)
        earliest = self._deadlines[0][0] if self._deadlines else None
        heapq.heappush(self._deadlines, (when, next(self._tiebreak), inst.instance_id))
        if (earliest is None or when < earliest) and self.on_earlier_deadline is not None:
            self.on_earlier_deadline()

    def next_deadline(self) -> float | None:
        """When :meth:`expire_due` next has something to do (monotonic), if ever."""
        times = []
        if self._deadlines:
            times.append(self._deadlines[0][0])
        if self._ended:
            times.append(self._ended[0][0] + self._keep_ended_s)
        return min(times, default=None)

    def expire_due(self, now: float | None = None) -> None:
        """End the instances whose deadline has come, and forget old ended ones.

        Looks only at instances with a deadline at or before ``now``: a later
        heartbeat moved an instance's deadline, so it is scheduled again.
        """
        now = time.monotonic() if now is None else now
        again = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, instance_id = heapq.heappop(self._deadlines)
            inst = self._instances.get(instance_id)
            if inst is None or not inst.alive:
                continue
            self.refresh(inst, now)
            if inst.alive:
                again.append(inst)
        for inst in again:
            self._schedule(inst)
        self._forget_old(now)

    def get(self, instance_id: str) -> Instance | None:
        """The instance, with its time-based transitions (TTL, death) applied."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            self.refresh(inst)
        return inst

    def refresh(self, inst: Instance, now: float | None = None) -> None:
        if not inst.alive:
            return
        now = time.monotonic() if now is None else now
        if inst.dies_at_mono is not None and now >= inst.dies_at_mono:
            self._end(inst, InstanceStatus.ERROR, "died")
        elif (beats := inst.heartbeat_deadline()) is not None and now >= beats:
            self._end(inst, InstanceStatus.STOPPED, "heartbeats_missed")
        elif self._expired(inst, now):
            self._end(inst, InstanceStatus.STOPPED, "expired")

    @staticmethod
    def _expired(inst: Instance, now: float) -> bool:
        # Compared at the instant of expiry, not by subtracting: `now - created`
        # can round to just under the TTL at exactly `created + ttl`.
        return inst.ttl_s is not None and now >= inst.created_mono + inst.ttl_s

    def refresh_all(self) -> None:
        now = time.monotonic()
        for inst in self:
            self.refresh(inst, now)

    def delete(self, inst: Instance) -> None:
        if inst.alive:
            self._end(inst, InstanceStatus.STOPPED, "deleted")

    def kill(self, inst: Instance) -> None:
        """Make a running instance die now, as the ``p_instance_death`` fault does."""
        if inst.alive:
            self._end(inst, InstanceStatus.ERROR, "died")

    def reseed(
        self, inst: Instance, *, seed: int | None = None, timestamp: int | None = None
    ) -> None:
        """Restore the instance's seed: the file's pages, and a new connection;
        its random source from ``seed`` and its clock at ``timestamp`` (see the
        module's docstring).

        TEMP tables and triggers, and pragmas, made through the manager API's
        query live in the connection, not the file: a backup alone would leave
        them for the next rollout (a TEMP trigger would change its writes).
        Closing the old connection also rolls back a transaction left open.
        """
        inst.seed, inst.timestamp = seed, timestamp
        inst.rng = self._rng(seed)
        inst.conn.close()
        inst.conn = open_db(inst.db_path, inst.now)
        self._seeded(inst.env, inst.data_key).backup(inst.conn)
        inst.updated_at = _now_iso()

    def _rng(self, seed: int | None) -> random.Random:
        """An instance's random source: from ``seed`` (0 when None), or unseeded
        when None and the profile's ``unseeded_random`` is on."""
        if seed is None and self._unseeded:
            return random.Random()
        return random.Random(0 if seed is None else seed)

    def _end(self, inst: Instance, status: InstanceStatus, how: str) -> None:
        inst.status = status
        inst.terminated_at = inst.updated_at = _now_iso()
        self._ledger.instance_ended(how)
        inst.conn.close()
        # The file stays a while (a verifier may still be reading it), not forever.
        now = time.monotonic()
        if not self._ended and self.on_earlier_deadline is not None:
            self.on_earlier_deadline()
        self._ended.append((now, inst.instance_id))
        self._forget_old(now)

    def _forget_old(self, now: float) -> None:
        while self._ended and (
            len(self._ended) > self._keep_ended or self._ended[0][0] + self._keep_ended_s <= now
        ):
            _, instance_id = self._ended.popleft()
            inst = self._instances.pop(instance_id, None)
            if inst is not None:
                _delete_files(inst.db_path)

    def close(self) -> None:
        for inst in self:
            if inst.alive:
                inst.conn.close()
        for template in self._templates.values():
            template.close()
        self._templates.clear()
        self._instances.clear()
        self._deadlines.clear()
        self._ended.clear()


class NewDatabase:
    """A new instance's SQLite file, copied from its seed's template by :meth:`make`.

    :meth:`make` may run in a worker thread (SQLite serializes the template's
    use, and releases the GIL while it works): the emulator makes an instance's
    file while its create's latency runs. :meth:`discard` removes a file no
    instance took (the client left, the create timed out).
    """

    def __init__(self, instance_id: str, path: Path, template: sqlite3.Connection) -> None:
        self.instance_id = instance_id
        self.path = path
        self._template = template
        self._conn: sqlite3.Connection | None = None

    def make(self) -> None:
        """Copy the template into the new file (on failure, :meth:`discard` removes it)."""
        self._conn = open_db(self.path)
        self._template.backup(self._conn)

    def take(self) -> tuple[str, Path, sqlite3.Connection]:
        conn, self._conn = self._conn, None
        if conn is None:
            raise RuntimeError("the database was not made, or was taken already")
        return self.instance_id, self.path, conn

    def discard(self) -> None:
        """Close and delete the file unless an instance took it."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            _delete_files(self.path)


def _delete_files(db_path: Path) -> None:
    for path in (db_path, *(db_path.with_name(db_path.name + s) for s in ("-journal", "-wal"))):
        path.unlink(missing_ok=True)
