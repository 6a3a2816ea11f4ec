"""Weight updates while rollouts generate: ``policy.weight_update`` side by side.

For each mode (``pause``, ``abort``, ``in_flight``) the same batch runs on the
emulator (in process), its policy the tiny random model behind the test
server (:class:`fleetroll.testing.model_server.ModelServer`, one generation at
a time, CPU), while a trainer stand-in pushes new weights every
``update_every_s`` seconds with :func:`fleetroll.training.weight_sync.sync_weights`
(SGLang's ``/update_weights_from_disk``, two saved models in turn). Measured
per mode: generated tokens per second of the batch's wall time, the server's
idle share (1 - the time it spent generating / the wall time), the updates
made, the generations aborted and the tokens they had made (all kept, resumed
on the new weights), the turns whose tokens span two versions, and the
rollouts dropped as ``stale``.

The numbers are a CPU toy's: a real server's update is a GPU copy, not a
``from_pretrained`` from disk; what they compare is the modes, on one machine.
Needs the ``train`` extra (torch, transformers).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import anyio

from fleetroll.bench.records import WeightUpdateRecord, WeightUpdateRow
from fleetroll.bench.scenarios import Scenario, bench_tasks
from fleetroll.emulator import Emulator
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.settings import load_settings
from fleetroll.telemetry import Events
from fleetroll.testing.model_server import ModelServer
from fleetroll.testing.tiny_model import save_tiny_model
from fleetroll.training.weight_sync import SGLangDiskSync, sync_weights

__all__ = ["MODES", "weight_update_bench"]

MODES = ("pause", "abort", "in_flight")


async def weight_update_bench(
    scenario: Scenario,
    *,
    config_file: str | None = None,
    echo: Callable[[str], None] = print,
) -> WeightUpdateRecord:
    """Run ``scenario``'s batch once per mode, with periodic weight updates."""
    concurrency = scenario.concurrency[0]
    with tempfile.TemporaryDirectory(prefix="fleetroll-bench-weights-") as folder:
        weights = [save_tiny_model(Path(folder) / f"step-{seed}", seed=seed) for seed in (0, 1)]
        # Unmeasured, no update: imports, the first forward passes, the emulator's
        # first instances would otherwise be charged to the first mode.
        warm_up = replace(scenario, rollouts=scenario.samples_per_task, update_every_s=math.inf)
        await _run_mode(warm_up, "pause", weights, concurrency, config_file)
        rows = []
        for mode in MODES:
            row = await _run_mode(scenario, mode, weights, concurrency, config_file)
            echo(
                f"  {mode}: {row.tokens_per_s:.0f} tokens/s, server idle {row.idle_share:.0%},"
                f" {row.updates} updates ({row.update_s:.2f} s each), {row.aborted} aborted"
                f" ({row.kept_tokens} tokens kept)"
            )
            rows.append(row)
    return WeightUpdateRecord(
        rollouts=scenario.rollouts,
        concurrency=concurrency,
        max_tokens=scenario.max_tokens,
        update_every_s=scenario.update_every_s,
        rows=rows,
    )


async def _run_mode(
    scenario: Scenario,
    mode: str,
    weights: list[Path],
    concurrency: int,
    config_file: str | None,
) -> WeightUpdateRow:
    tasks, samples = bench_tasks(scenario.rollouts, scenario.steps, scenario.samples_per_task)
    server = ModelServer(weights[0], in_flight_updates=mode == "in_flight")
    updates = 0
    pushing = 0.0
    async with server, Emulator() as emu:
        settings = load_settings(
            config_file,
            pool={"concurrency": concurrency, "max_steps": scenario.steps + 5},
            provisioning={"creates_per_second": 100_000.0, "max_concurrent_creates": concurrency},
            policy={
                "kind": "openai",
                "base_url": server.base_url,
                "model": server.model_name,
                "max_tokens": scenario.max_tokens,
                "return_token_ids": True,
                "logprobs": True,
                "temperature": 1.0,
                "weight_update": mode,
            },
        )
        pool = RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events())
        sync = SGLangDiskSync(server.base_url)
        async with pool, OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy:
            busy_before = server.busy_s
            began = time.monotonic()
            with anyio.fail_after(scenario.wall_limit_s):
                batch = pool.run_batch(tasks, policy, samples_per_task=samples)
                async with anyio.create_task_group() as trainer:

                    async def push_periodically() -> None:
                        nonlocal updates, pushing
                        while True:
                            await anyio.sleep(scenario.update_every_s)
                            pushed = time.monotonic()
                            await sync_weights(pool, sync, weights[(updates + 1) % 2])
                            pushing += time.monotonic() - pushed
                            updates += 1

                    trainer.start_soon(push_periodically)
                    results = await batch.results()
                    trainer.cancel_scope.cancel()
            wall = time.monotonic() - began
            busy = server.busy_s - busy_before
    turns = [turn for result in results for turn in result.turns]
    tokens = sum(len(turn.completion_token_ids or ()) for turn in turns)
    return WeightUpdateRow(
        mode=mode,
        rollouts=len(results),
        wall_s=wall,
        generated_tokens=tokens,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        idle_share=max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0,
        updates=updates,
        update_s=pushing / updates if updates else 0.0,
        aborted=server.aborted,
        kept_tokens=server.aborted_tokens,
        straddling_turns=sum(1 for t in turns if len(set(t.token_versions or ())) > 1),
        stale=sum(1 for r in results if r.failure_reason == FailureReason.STALE),
    )
