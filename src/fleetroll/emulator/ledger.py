"""The emulator's ledger: what happened to every instance, for leak checks.

Tests and benchmarks read it (as this object in-process, or as JSON from
``GET /_emulator/ledger``) to prove that nothing leaked: at the end of a run,
``running`` must be 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ledger"]


@dataclass
class Ledger:
    """Counters of the emulator's instance lifecycle and traffic."""

    created: int = 0
    deleted: int = 0
    expired: int = 0
    #: Stopped by Fleet's rule, nobody releasing them: their heartbeats stopped.
    heartbeats_missed: int = 0
    died: int = 0
    running: int = 0
    peak_running: int = 0
    creates_by_outcome: Counter[str] = field(default_factory=Counter)
    creates_by_env: Counter[str] = field(default_factory=Counter)
    tool_calls: int = 0
    tool_calls_by_outcome: Counter[str] = field(default_factory=Counter)
    resets: int = 0
    #: Resets that named a seed, a timestamp (Fleet's ``ResetRequest``).
    resets_seeded: int = 0
    resets_time_pinned: int = 0
    verifier_runs: int = 0
    verifier_runs_by_outcome: Counter[str] = field(default_factory=Counter)
    mcp_rejected_warming: int = 0
    #: Environment listings served (``GET /v1/env/``): what pre-flights cost Fleet.
    env_listings: int = 0
    #: Highest number of creates being served at the same moment.
    peak_concurrent_creates: int = 0
    _creates_in_flight: int = 0

    def instance_started(self, env_key: str) -> None:
        self.created += 1
        self.creates_by_env[env_key] += 1
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)

    def instance_ended(self, how: str) -> None:
        """Count an instance leaving the running set: ``deleted``, ``expired``,
        ``heartbeats_missed`` or ``died``."""
        self.running -= 1
        setattr(self, how, getattr(self, how) + 1)

    def create_started(self) -> None:
        self._creates_in_flight += 1
        self.peak_concurrent_creates = max(self.peak_concurrent_creates, self._creates_in_flight)

    def create_finished(self, outcome: str) -> None:
        self._creates_in_flight -= 1
        self.creates_by_outcome[outcome] += 1

    def tool_called(self, outcome: str) -> None:
        self.tool_calls += 1
        self.tool_calls_by_outcome[outcome] += 1

    def reset(self, *, seed: int | None, timestamp: int | None) -> None:
        self.resets += 1
        self.resets_seeded += seed is not None
        self.resets_time_pinned += timestamp is not None

    def verifier_ran(self, outcome: str) -> None:
        self.verifier_runs += 1
        self.verifier_runs_by_outcome[outcome] += 1

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy of every counter."""
        return {
            "created": self.created,
            "deleted": self.deleted,
            "expired": self.expired,
            "heartbeats_missed": self.heartbeats_missed,
            "died": self.died,
            "running": self.running,
            "peak_running": self.peak_running,
            "creates_by_outcome": dict(self.creates_by_outcome),
            "creates_by_env": dict(self.creates_by_env),
            "creates_in_flight": self._creates_in_flight,
            "peak_concurrent_creates": self.peak_concurrent_creates,
            "tool_calls": self.tool_calls,
            "tool_calls_by_outcome": dict(self.tool_calls_by_outcome),
            "resets": self.resets,
            "resets_seeded": self.resets_seeded,
            "resets_time_pinned": self.resets_time_pinned,
            "verifier_runs": self.verifier_runs,
            "verifier_runs_by_outcome": dict(self.verifier_runs_by_outcome),
            "mcp_rejected_warming": self.mcp_rejected_warming,
            "env_listings": self.env_listings,
        }
