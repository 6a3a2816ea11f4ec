"""Which environments and versions a batch names that a listing does not have.

A pure helper shared by :mod:`fleetroll.pool.preflight` (which re-exports it) and
:mod:`fleetroll.environments.fleet.provider`'s Fleet preflight; it imports nothing of the
pool, so the provider can use it without an import cycle.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetroll.tasks import TaskSpec

__all__ = ["missing_environments"]

#: Known names listed in a message about an unknown one, at most.
_LIST_AT_MOST = 12


def _listed(names: Collection[str]) -> str:
    ordered = sorted(names)
    more = len(ordered) - _LIST_AT_MOST
    shown = ", ".join(ordered[:_LIST_AT_MOST])
    return shown + (f" and {more} more" if more > 0 else "") if ordered else "none"


def _did_you_mean(name: str, known: Collection[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def missing_environments(
    tasks: Sequence[TaskSpec], known: Mapping[str, Collection[str]]
) -> list[str]:
    """One line per distinct environment or version of ``tasks`` not in ``known``.

    ``known`` maps each environment key to its versions. A task without a
    version takes the environment's default, so only its key is checked.
    """
    wanted = Counter((task.env_key, task.env_version) for task in tasks)
    problems: list[str] = []
    for (key, version), count in sorted(wanted.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        used = f"{count} task{'s' if count != 1 else ''}"
        if key not in known:
            problems.append(
                f"unknown environment {key!r} ({used}); {_did_you_mean(key, known)}"
                f"environments: {_listed(known)}"
            )
        elif version is not None and version not in known[key]:
            problems.append(
                f"environment {key!r} has no version {version!r} ({used}); "
                f"{_did_you_mean(version, known[key])}versions: {_listed(known[key])}"
            )
    return problems
