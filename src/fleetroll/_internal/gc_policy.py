"""The process's garbage-collector policy, set by fleetroll's own entry points.

fleetroll runs inside trainers: importing it, opening a pool or running a
batch never touches the collector. Only the CLI (``fleetroll run``,
``fleetroll bench``) and the service (``fleetroll serve``), which own their
process, enter :func:`gc_policy` around their work (``pool.gc_policy``).

Why: every in-flight rollout holds hundreds of objects the cyclic collector
tracks (its MCP session's task groups, cancel scopes, streams, coroutines), and
Python's default thresholds (700, 10, 10) run a young collection every 700
allocations and a full one, walking every tracked object in the process, often:
at 1,000 rollouts in flight, each full collection is a loop pause of 100 ms or
more. ``"tuned"`` freezes what start-up made (modules, settings, the SDKs'
tables: never garbage, never walked again) and collects less often; the
cycles rollouts leave are still collected, later and in bigger batches.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

__all__ = ["TUNED_THRESHOLDS", "GcPolicy", "gc_policy"]

GcPolicy = Literal["tuned", "python"]

#: Young collections every 2,000 net new tracked objects instead of 700; the
#: older generations as Python does. Measured (2,000 scale rollouts at C=500,
#: benchmarks/RESULTS.md): higher thresholds (10,000 to 50,000) cut the
#: collector's CPU a little more but ran no full collection at all, so the
#: cycles finished MCP sessions leave piled up (+30 to +55 MiB); this one
#: still runs full collections, on far fewer objects once start-up is frozen.
TUNED_THRESHOLDS = (2_000, 10, 10)


@contextmanager
def gc_policy(policy: GcPolicy) -> Iterator[None]:
    """Run the block under ``policy``; the collector is as it was afterwards.

    ``"python"`` leaves the collector alone. ``"tuned"`` collects once, freezes
    every object that survives (start-up's), and raises the thresholds
    (:data:`TUNED_THRESHOLDS`); on exit it restores the thresholds and unfreezes.
    """
    if policy == "python":
        yield
        return
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*TUNED_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
