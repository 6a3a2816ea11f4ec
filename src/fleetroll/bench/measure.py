"""Instruments: event-loop lag, CPU, peak RSS, the emulator's CPU, percentiles.

Everything is read from this process's own accounting (``getrusage``,
``/proc/self/status``) or from ``/proc/<pid>/stat`` of the emulator process
and its children (the verifier workers), so nothing extra needs installing.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from fleetroll.telemetry.sql_functions import percentile as sorted_percentile

__all__ = [
    "CpuClock",
    "LoopLag",
    "machine_cpu_s",
    "peak_rss_mb",
    "percentile",
    "process_tree_cpu_s",
    "reset_peak_rss",
]

_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of values in any order, by linear interpolation;
    None for no values."""
    return sorted_percentile(sorted(values), q / 100)


class LoopLag:
    """A watchdog task: sleeps ``interval_s`` again and again and records the oversleep.

    The oversleep is how long the event loop was busy with something else when
    the timer was due: the delay every other task saw at that moment.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            began = time.perf_counter()
            await anyio.sleep(self.interval_s)
            self.samples.append(max(0.0, time.perf_counter() - began - self.interval_s))

    def p99_ms(self) -> float | None:
        value = percentile(self.samples, 99)
        return None if value is None else value * 1000

    def max_ms(self) -> float | None:
        return max(self.samples) * 1000 if self.samples else None


@dataclass(frozen=True, slots=True)
class CpuClock:
    """This process's user + system CPU seconds at one moment."""

    seconds: float

    @classmethod
    def now(cls) -> CpuClock:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cls(usage.ru_utime + usage.ru_stime)

    def since(self, earlier: CpuClock) -> float:
        return self.seconds - earlier.seconds


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``), so the next reading is one run's.

    Linux only (``/proc/self/clear_refs``); returns whether it worked. When it
    does not, :func:`peak_rss_mb` reports the peak of the whole process.
    """
    try:
        (_PROC / "self" / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MiB."""
    try:
        for line in (_PROC / "self" / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def machine_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy (every core, every process)."""
    try:
        first = (_PROC / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if first[:1] != ["cpu"]:
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
    ticks = [int(v) for v in first[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICKS


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of one process, from ``/proc/<pid>/stat``."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it.
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def process_tree_cpu_s(root: int) -> float | None:
    """CPU seconds (user + system) of ``root`` and its living descendants.

    The emulator runs verifiers in long-lived worker processes: their CPU is
    the emulator's too. None when ``root`` is gone or ``/proc`` is missing.
    """
    own = _stat(root)
    if own is None:
        return None
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {root: own[1]}
    try:
        entries = [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return own[1]
    for pid in entries:
        stat = _stat(pid) if pid != root else None
        if stat is not None:
            parents[pid], cpu[pid] = stat
    total = 0.0
    for pid, seconds in cpu.items():
        ancestor = pid
        while ancestor != root and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root:
            total += seconds
    return total
