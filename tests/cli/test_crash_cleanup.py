"""Nothing outlives a crash for long: heartbeats, run ids, ``fleetroll gc`` and ``--resume``.

Real processes: ``fleetroll run`` as a child on the embedded emulator of this
test (a real HTTP server on loopback), killed with SIGKILL while its rollouts
act; the emulator stops instances whose heartbeats stopped
(:data:`fleetroll.emulator.instances.MISSED_HEARTBEATS` intervals after the last).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.emulator.instances import MISSED_HEARTBEATS, Instance
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import fleet_provider
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink
from fleetroll_children import child_env

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
TASK_LINES = (config_dir() / "tasks" / "ledger.jsonl").read_text().splitlines()[:4]
INTERVAL_S = 2
#: The reaper's wake-up and a loaded machine's lag, past the deadline.
SLACK_S = 1.0


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused"])
async def test_heartbeats_keep_instances_alive_while_rollouts_use_them(reuse: bool) -> None:
    sink = MemorySink()
    async with Emulator() as emu:
        settings = load_settings(provisioning={"heartbeat_s": 1, "reuse": reuse})
        async with RolloutPool(
            settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink])
        ) as pool:
            with anyio.fail_after(120):
                # Each rollout acts for several intervals.
                policy = ScriptedPolicy(think_time_s=1.0)
                results = await pool.run_batch(LEDGER[:4], policy).results()
        made = list(emu.store)
        assert emu.ledger.running == 0 and emu.ledger.heartbeats_missed == 0
    assert all(r.reward is not None for r in results)
    assert max(r.timings.total_s for r in results) > MISSED_HEARTBEATS * 1
    assert made and all(inst.heartbeat_interval == 1 for inst in made)
    assert all(inst.last_heartbeat_mono is not None for inst in made)


async def fleetroll(
    tmp_path: Path, env: Mapping[str, str], *args: str, name: str
) -> anyio.abc.Process:
    with (tmp_path / f"{name}.log").open("wb") as log:  # the child keeps its own copy
        return await anyio.open_process(
            [sys.executable, "-m", "fleetroll", *args],
            cwd=tmp_path,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )


async def killed_while_acting(tmp_path: Path, emu: Emulator, heartbeat_s: int) -> float:
    """Start ``fleetroll run`` on 4 tasks, SIGKILL it once its 4 instances act (and
    were beaten once); returns when it was killed (``time.time()``)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(TASK_LINES) + "\n")
    env = child_env(
        emu,
        FLEETROLL_PROVISIONING__HEARTBEAT_S=str(heartbeat_s),
        FLEETROLL_POLICY__THINK_TIME_S="60",  # they act until killed
    )
    child = await fleetroll(
        tmp_path, env, "run", str(tasks), "--out", str(tmp_path / "out.jsonl"), name="killed"
    )
    try:
        with anyio.fail_after(120):
            while len(beaten := [i for i in emu.store if i.alive and i.last_heartbeat_mono]) < 4:
                await anyio.sleep(0.05)
        assert all(inst.heartbeat_interval == heartbeat_s for inst in beaten)
    finally:
        child.kill()  # SIGKILL, to this child only
        killed = time.time()
        with anyio.fail_after(30):
            await child.wait()
    return killed


def ended_at(inst: Instance) -> float:
    assert inst.terminated_at is not None
    return datetime.fromisoformat(inst.terminated_at).timestamp()


async def test_a_killed_runs_instances_stop_within_two_heartbeat_intervals_unreleased(
    tmp_path: Path,
) -> None:
    async with Emulator() as emu:
        killed = await killed_while_acting(tmp_path, emu, INTERVAL_S)
        mine = [inst for inst in emu.store if inst.run_id is not None]
        with anyio.fail_after(MISSED_HEARTBEATS * INTERVAL_S * 5):
            while emu.ledger.running:
                await anyio.sleep(0.1)
        ledger = emu.ledger
        assert len(mine) == 4 and ledger.created == 4
        # Nobody released them: Fleet's rule stopped them.
        assert ledger.heartbeats_missed == 4 and ledger.deleted == 0 and ledger.expired == 0
        late = [ended_at(inst) - killed for inst in mine]
        assert max(late) <= MISSED_HEARTBEATS * INTERVAL_S + SLACK_S, late


@pytest.mark.parametrize("how", ["gc", "resume"])
async def test_gc_and_resume_release_what_a_killed_run_left(tmp_path: Path, how: str) -> None:
    async with Emulator() as emu:
        await killed_while_acting(tmp_path, emu, heartbeat_s=3600)  # heartbeats alone: an hour
        left = {inst.instance_id for inst in emu.store if inst.alive}
        (run_id,) = {inst.run_id for inst in emu.store}
        assert len(left) == 4 and run_id is not None
        env = child_env(emu, FLEETROLL_POLICY__THINK_TIME_S="0")
        out = str(tmp_path / "out.jsonl")
        args = ["gc", "--run-id", run_id] if how == "gc" else ["run", "--resume", "--out", out]
        args += [] if how == "gc" else [str(tmp_path / "tasks.jsonl")]
        child = await fleetroll(tmp_path, env, *args, name=how)
        with anyio.fail_after(120):
            code = await child.wait()
        said = (tmp_path / f"{how}.log").read_text()
        assert code == 0, said
        ended = {inst.instance_id: inst for inst in emu.store if not inst.alive}
        assert left <= set(ended) and emu.ledger.running == 0
        assert emu.ledger.heartbeats_missed == 0
    if how == "gc":
        assert {line.split()[1] for line in said.splitlines() if line.startswith("released ")} == (
            left
        )
        assert f"run {run_id}: 4 instance(s) released" in said
    else:
        assert f"released 4 instance(s) of run {run_id}" in said


async def test_a_sweep_and_a_collect_leave_alone_what_this_process_holds() -> None:
    task = LEDGER[0]
    async with Emulator() as emu:
        provider = fleet_provider(
            load_settings(), Events(), api_key=emu.api_key, base_url=emu.base_url
        )
        held = await provider.provision(task, run_id="r")
        # Orphans: a create whose answer never came, an actor's, another run's.
        orphan = await provider.fleet.make(task.env_spec, data_key=task.data_spec, run_id="r")
        actor = await provider.fleet.make(task.env_spec, data_key=task.data_spec, run_id="r-w1")
        other = await provider.fleet.make(task.env_spec, data_key=task.data_spec, run_id="rx")
        assert await provider.sweep("r") == 1
        assert sorted(await provider.collect("r")) == [actor.instance_id]
        alive = {inst.instance_id for inst in emu.store if inst.alive}
        assert alive == {held.instance_id, other.instance_id}
        assert orphan.instance_id not in alive
        assert await provider.release(held)
        await other.close()
        await provider.aclose()
