"""The cpu-floor baseline against the embedded emulator: fleetroll's requests, its rewards."""

from __future__ import annotations

from collections import Counter

from fleetroll.bench.cpu_floor import run_cpu_floor
from fleetroll.bench.scenarios import SCENARIOS, bench_tasks, fleetroll_settings
from fleetroll.bench.systems import RunContext, run_fleetroll
from fleetroll.emulator import Emulator

#: Scores the instance's state: the number of accounts (11 in the seed) over 44.
_PARTIAL = (
    "def verify(env, final_answer=None):\n"
    "    rows = env.db('current').query('SELECT COUNT(*) FROM accounts').rows\n"
    "    return rows[0][0] / 44\n"
)


def context(emulator: Emulator) -> RunContext:
    scenario = SCENARIOS["smoke"]
    tasks, samples = bench_tasks(4, 2, samples=2)
    tasks[1] = tasks[1].model_copy(update={"key": "bench-partial", "verifier_func": _PARTIAL})
    return RunContext(
        scenario=scenario,
        concurrency=4,
        tasks=tasks,
        samples_per_task=samples,
        settings=fleetroll_settings(scenario, 4),
        base_url=emulator.base_url,
        api_key=emulator.api_key,
    )


async def test_the_cpu_floor_scores_every_rollout_as_fleetroll_does(emulator: Emulator) -> None:
    ctx = context(emulator)
    fleetroll = await run_fleetroll(ctx)
    floor = await run_cpu_floor(ctx)
    assert floor.finished_on_its_own and floor.returned == 4
    assert [s.failure for s in floor.samples] == [None] * 4
    assert sorted(s.reward for s in floor.samples) == sorted(s.reward for s in fleetroll.samples)
    assert sorted(s.reward for s in floor.samples) == [0.25, 0.25, 1.0, 1.0]


async def test_the_cpu_floor_makes_a_rollouts_requests_and_deletes_its_instances(
    emulator: Emulator,
) -> None:
    ctx = context(emulator)
    before = emulator.ledger.snapshot()
    outcome = await run_cpu_floor(ctx)
    after = emulator.ledger.snapshot()
    assert outcome.returned == 4
    # Per rollout: a create, a reset, 2 tool calls, a verifier run, a delete.
    assert after["created"] - before["created"] == 4
    assert after["deleted"] - before["deleted"] == 4
    assert after["resets"] - before["resets"] == 4
    assert after["tool_calls"] - before["tool_calls"] == 8
    assert after["verifier_runs"] - before["verifier_runs"] == 4
    assert after["running"] == before["running"]


async def test_the_cpu_floor_sends_the_control_plane_requests_fleetroll_sends() -> None:
    # Its CPU is the floor of *fleetroll's* requests: one that fleetroll makes and
    # it does not (the heartbeats, once) would flatter the floor and fleetroll's ratio.
    def kinds(emulator: Emulator) -> Counter[str]:
        ids = {r.path.split("/")[4] for r in emulator.requests if r.method == "DELETE"}
        seen: Counter[str] = Counter()
        for r in emulator.requests:
            path = r.path
            for instance_id in ids:
                path = path.replace(instance_id, "{id}")
            seen[f"{r.method} {path}"] += 1
        return seen

    made = []
    for run in (run_fleetroll, run_cpu_floor):
        async with Emulator(record_requests=1000) as emulator:
            await run(context(emulator))
            made.append(kinds(emulator))
    fleetroll, floor = made
    per_instance = {k for k in fleetroll if "{id}" in k}
    assert "POST /v1/env/instances/{id}/heartbeat" in per_instance
    assert {k: floor[k] for k in per_instance} == {k: fleetroll[k] for k in per_instance}
