"""Rollouts started and not completed: still running, or lost with their process.

Every record in the store names the process that wrote it: ``process_pid``,
``service_instance_id`` (one per telemetry set-up, so a reused pid is a
different writer) and the host (``host.name`` in ``otel_resource_attributes``,
which Logfire's resource carries). A rollout whose starts outnumber its
completions is **lost** when the processes that started it without completing
it are all gone (a ``fleetroll run`` killed with ``-9`` cannot emit its
``fleet_rollout_completed``); otherwise it is still **in flight**.

A process counts as gone only when it ran on this host and its pid is not
alive, is a zombie, or now names a process that started after the rollout did
(the pid was reused). A writer on another host is never called gone: this
host cannot tell.

Used by ``fleetroll stats --check`` (:func:`fleetroll.telemetry.queries.check`)
and the dashboard. The SQL runs through a ``run`` callable the caller gives
(its read-only query function), so this module imports no query code.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from fleetroll.telemetry.store import ROLLOUT_EVENTS_FROM_RECORDS

__all__ = ["Unfinished", "Writer", "process_gone", "unfinished"]

#: Runs our SQL (SQLite's, read-only) with named parameters; returns the rows.
Run = Callable[[str, Mapping[str, Any]], Sequence[Sequence[Any]]]

_STARTED, _COMPLETED = "fleet_rollout_started", "fleet_rollout_completed"
#: At most this many unfinished rollouts are looked at (the newest).
_MAX_UNFINISHED: Final = 5000

#: The phase a rollout is in, as far as its latest event in the store tells.
_PHASE_OF_EVENT: Final[Mapping[str, str]] = {
    _STARTED: "provisioning",
    "fleet_make_retry": "provisioning",
    "fleet_make_failed": "provisioning",
    "fleet_provisioning_completed": "acting",
    "fleet_env_created": "acting",
    "fleet_env_reset_failed": "acting",
    "fleet_tool_call": "acting",
    "fleet_tool_call_failed": "acting",
    "fleet_mcp_tool_error": "acting",
    "fleet_rollout_restarted": "provisioning",
    "fleet_verifier_failed": "verifying",
    "fleet_instance_released": "releasing",
    "fleet_instance_release_failed": "releasing",
    "fleet_env_close_failed": "releasing",
}

#: ``{events}``: ``rollout_events``, or the same columns read from ``records``
#: (:data:`fleetroll.telemetry.store.ROLLOUT_EVENTS_FROM_RECORDS`).
_UNFINISHED_SQL: Final = """
SELECT rollout_id AS rid
FROM {events}
WHERE service_name = :service
  AND message IN ('fleet_rollout_started', 'fleet_rollout_completed'){batch}
GROUP BY 1
HAVING COUNT(*) FILTER (WHERE message = 'fleet_rollout_started')
    > COUNT(*) FILTER (WHERE message = 'fleet_rollout_completed')
ORDER BY MAX(start_timestamp) DESC
LIMIT :limit
"""

#: Every event of those rollouts, oldest first.
_EVENTS_SQL: Final = """
SELECT attributes->>'rollout_id', message, start_timestamp, process_pid, service_instance_id,
    otel_resource_attributes->>'$."host.name"', attributes->>'instance_id',
    attributes->>'batch_id', attributes->>'env_key', attributes->>'task_key'
FROM records
WHERE service_name = :service AND attributes->>'rollout_id' IN ({unfinished})
ORDER BY start_timestamp
"""


@dataclass(frozen=True, slots=True)
class Writer:
    """One process that wrote records: its pid and host, and its telemetry set-up's id."""

    pid: int | None
    host: str | None
    instance: str | None


@dataclass(slots=True)
class Unfinished:
    """A rollout with more starts than completions."""

    rollout_id: str
    batch_id: str | None
    env_key: str | None
    task_key: str | None
    started_at: str
    #: Its latest event's phase (``provisioning``, ``acting``, ``verifying``,
    #: ``releasing``), and that event's name.
    phase: str
    last_event: str
    instance_id: str | None
    #: The process of its latest start.
    writer: Writer
    started: int = 0
    completed: int = 0
    #: Every start without a completion came from a process that is gone.
    lost: bool = False
    starts: dict[Writer, int] = field(default_factory=dict)
    completions: dict[Writer, int] = field(default_factory=dict)


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp()


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def process_gone(pid: int | None, host: str | None, since: float | None = None) -> bool:
    """Whether the process ``pid`` on ``host`` has certainly ended.

    False when it cannot tell (no pid, another host). With ``since`` (epoch
    seconds: when it wrote a record), a live pid whose process started later
    is a reused pid: gone.
    """
    if pid is None or pid <= 0 or host is None or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True  # ended in between
    except OSError:
        return False  # no /proc (not Linux): alive, as kill(0) says
    fields = stat.rsplit(")", 1)[-1].split()
    if fields and fields[0] in ("Z", "X"):  # a zombie: killed, not yet reaped
        return True
    boot = _boot_time()
    if since is not None and boot is not None and len(fields) > 19:
        began = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        if began > since + 1.0:  # clock ticks and rounding: a second of slack
            return True
    return False


def unfinished(
    run: Run,
    *,
    batch_id: str | None = None,
    service_name: str = "fleetroll",
    events: str = ROLLOUT_EVENTS_FROM_RECORDS,
) -> list[Unfinished]:
    """Every rollout (of ``batch_id``) started more often than completed, newest first.

    Each says whether it is lost (:attr:`Unfinished.lost`): the starts it lacks
    a completion for all came from processes that are gone. ``events`` is
    where the starts and completions are counted: the store's
    ``rollout_events`` table when it has one.
    """
    batch = "\n  AND batch_id = :batch" if batch_id is not None else ""
    params = {"service": service_name, "batch": batch_id, "limit": _MAX_UNFINISHED}
    found: dict[str, Unfinished] = {}
    first_write: dict[Writer, float] = {}
    # Over the whole store the counts per rollout come from the covering index
    # alone; left to itself, SQLite reads every row instead, three times slower.
    # One batch's rows are few: found through its own index.
    whole = events == "rollout_events" and batch_id is None
    source = f"{events} INDEXED BY rollout_events_rollout" if whole else events
    gaps = _UNFINISHED_SQL.replace("{batch}", batch).replace("{events}", source)
    for rid, message, at, pid, instance, host, iid, bid, env, task in run(
        _EVENTS_SQL.replace("{unfinished}", gaps), params
    ):
        writer = Writer(int(pid) if isinstance(pid, int) else None, host, instance)
        first_write.setdefault(writer, _epoch(at))
        entry = found.get(rid)
        if entry is None:
            entry = found[rid] = Unfinished(
                rid, bid, env, task, at, "provisioning", message, iid, writer
            )
        entry.last_event = message
        entry.phase = _PHASE_OF_EVENT.get(message, entry.phase)
        entry.instance_id = iid or entry.instance_id
        if message == _STARTED:
            entry.started += 1
            entry.started_at, entry.writer = at, writer
            entry.starts[writer] = entry.starts.get(writer, 0) + 1
        elif message == _COMPLETED:
            entry.completed += 1
            entry.completions[writer] = entry.completions.get(writer, 0) + 1
    gone = {w: process_gone(w.pid, w.host, since) for w, since in first_write.items()}
    out = []
    for entry in found.values():
        if entry.started <= entry.completed:
            continue
        lost_starts = sum(
            max(0, n - entry.completions.get(writer, 0))
            for writer, n in entry.starts.items()
            if gone[writer]
        )
        entry.lost = entry.started - entry.completed <= lost_starts
        out.append(entry)
    out.sort(key=lambda e: e.started_at, reverse=True)
    return out
