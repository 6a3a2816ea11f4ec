"""One RolloutPool, any executor: the pool's features the same in this process and on Ray.

The same test on the local executor and on two Ray actors running the local
executor (:mod:`fleetroll.pool.ray.executor`, what ``--ray`` opens).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import AsyncIterator

import anyio
import pytest

from fleetroll.emulator import FaultProfile, Latency
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import Batch, RolloutPool
from fleetroll.results import FailureReason
from fleetroll.rollout.agent_command import CommandAgent
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import SolutionStep, TaskSpec, load_tasks
from fleetroll.telemetry.events import Events, MemorySink
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape
from training_helpers import AGENT, sent_and_recorded, solving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ray = pytest.importorskip("ray")

SETTINGS = load_settings(provisioning={"backoff_initial_s": 0.05, "backoff_max_s": 0.5})
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)


@pytest.fixture(scope="module")
async def fleet() -> AsyncIterator[EmulatorProcess]:
    async with EmulatorProcess(FaultProfile(create_latency=Latency(min_s=0.01, max_s=0.05))) as emu:
        yield emu


@pytest.fixture(params=["local", "ray"])
async def pool(
    request: pytest.FixtureRequest, fleet: EmulatorProcess
) -> AsyncIterator[RolloutPool]:
    if request.param == "local":
        async with RolloutPool(SETTINGS, api_key=fleet.api_key, base_url=fleet.base_url) as local:
            yield local
        return
    pytest.importorskip("ray")
    request.getfixturevalue("local_ray")
    from fleetroll.pool.ray.executor import ray_pool

    async with ray_pool(
        SETTINGS, api_key=fleet.api_key, base_url=fleet.base_url, num_actors=2
    ) as on_ray:
        yield on_ray


async def test_oversampled_groups_on_a_paused_swapped_policy_then_a_resume_run_nothing_twice(
    pool: RolloutPool,
) -> None:
    tasks = LEDGER[:3]
    with anyio.fail_after(300):
        pool.policy_version = 1
        async with pool.policy_paused():
            batch = pool.run_batch(
                tasks, ScriptedPolicy(), samples_per_task=2, oversample=1, batch_id="b"
            )
            pool.policy_version = 2  # the weights were swapped during the pause
        results = await batch.results()
        again = pool.run_batch(
            tasks,
            ScriptedPolicy(),
            samples_per_task=2,
            oversample=1,
            batch_id="b",
            previous=results,
        )
        rerun = await again.results()
        versions = set()
        for r in results:
            if r.reward is not None:
                page = await batch.events(r.rollout_id, after=0, wait_s=0)
                versions |= {e.data["policy_version"] for e in page.events if e.kind == "turn"}
    assert len(results) == 9 and len({r.rollout_id for r in results}) == 9
    scored = [r for r in results if r.reward is not None]
    assert Counter(r.task_key for r in scored) == {t.key: 2 for t in tasks}
    assert all(r.failure_reason is FailureReason.SUPERSEDED for r in results if r not in scored)
    # Every policy call was made on the weights swapped in during the pause.
    assert versions == {2}
    assert [len(g.results) for g in batch.complete_groups] == [2, 2, 2]
    assert rerun == [] and [len(g.results) for g in again.complete_groups] == [2, 2, 2]


async def test_a_task_s_seed_and_timestamp_reach_every_reset_on_either_executor(
    pool: RolloutPool, fleet: EmulatorProcess
) -> None:
    # The verifier prints the transaction the rollout added: its date (the
    # instance's pinned day) and its reference (drawn from the seed).
    verifier = (
        "def verify(env, final_answer=None):\n"
        "    rows = env.db('current').query(\n"
        "        'SELECT date, reference FROM transactions WHERE id > 5').rows\n"
        "    print(json.dumps(rows))\n"
        "    return {'reward': 1.0 if rows and rows[0][0] == '2026-01-01' else 0.0}\n"
    )
    step = SolutionStep(
        name="record_transaction",
        arguments={"from_account": "Checking", "to_account": "Rent", "amount": 3.5,
                   "description": "Desk"},
    )  # fmt: skip
    task = TaskSpec(
        key="seeded", prompt="Record it.", env_key="ledger", data_key="seed",
        verifier_func=verifier, solution=(step,), seed=11, timestamp=1_767_225_600,
    )  # fmt: skip
    before = await fleet.ledger()
    with anyio.fail_after(300):
        results = await pool.run_batch([task], ScriptedPolicy(), samples_per_task=3).results()
    after = await fleet.ledger()

    assert [r.reward for r in results] == [1.0] * 3
    states = {r.verifier.stdout for r in results if r.verifier is not None}
    assert len(states) == 1  # three rollouts, one state: the seed's and the day's
    assert after["resets_seeded"] - before["resets_seeded"] >= 3
    assert after["resets_time_pinned"] - before["resets_time_pinned"] >= 3


async def test_a_killed_actor_s_rollouts_run_again_once_on_the_other(
    local_ray: None, fleet: EmulatorProcess
) -> None:
    from fleetroll.pool.ray.executor import RayExecutor, ray_pool

    sink = MemorySink()
    async with ray_pool(
        SETTINGS,
        api_key=fleet.api_key,
        base_url=fleet.base_url,
        num_actors=2,
        events=Events([sink]),
    ) as pool:
        executor = pool.executor
        assert isinstance(executor, RayExecutor)
        batch = pool.run_batch(LEDGER[:10], ScriptedPolicy(think_time_s=0.05), samples_per_task=2)
        results = []
        with anyio.fail_after(300):
            async for result in batch:
                results.append(result)
                if len(results) == 5:
                    ray.kill(executor.workers[1])
            # A weight sync after the death: the live actor gets it, the pool goes on
            # (the gate's mirror asked the dead actor too, and its error ended the pool).
            pool.policy_version = 3
            after = pool.run_batch(LEDGER[:2], ScriptedPolicy(), batch_id="after")
            later = await after.results()
            versions = [v for r in later for v in await turn_versions(after, r.rollout_id)]
        alive = list(executor.alive)
    ledger = await fleet.ledger()
    assert len(results) == 20 and len({r.rollout_id for r in results}) == 20
    assert [(r.rollout_id, r.failure_reason) for r in results if r.reward != 1.0] == []
    assert alive == [True, False] and sink.named("fleet_worker_lost")
    assert [r.reward for r in later] == [1.0, 1.0] and versions and set(versions) == {3}
    started = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started"))
    completed = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed"))
    assert started == completed and set(completed.values()) == {1}
    assert ledger["running"] == 0


async def turn_versions(batch: Batch, rollout_id: str) -> list[int]:
    page = await batch.events(rollout_id, after=0, wait_s=0)
    return [e.data["policy_version"] for e in page.events if e.kind == "turn"]


async def gates(pool: RolloutPool) -> list[tuple[int, bool, int]]:
    """Each gate policy calls start at: its version, whether paused, the calls it let start."""
    from fleetroll.pool.ray.executor import RayExecutor

    executor = pool.executor
    if isinstance(executor, RayExecutor):
        return [await worker.gate_state.remote() for worker in executor.workers]
    gate = pool.policy_gate
    return [(gate.version, gate.paused, gate.admitted)]


async def admitted(pool: RolloutPool) -> int:
    """Policy calls let start so far, counted at the gates they start at."""
    return sum(n for _, _, n in await gates(pool))


async def test_a_pause_and_version_bump_mid_batch_then_ctrl_c_and_resume_run_nothing_twice(
    pool: RolloutPool,
) -> None:
    # One task takes many more steps (read-only listings first), so its rollouts
    # are surely still acting when the others' results come and the batch is
    # cancelled: rollouts of one length end together, and a cancel raced them.
    slow = LEDGER[6]
    assert slow.solution is not None
    listing = slow.solution[0]  # list_invoices: changes nothing the verifier reads
    slow = slow.model_copy(update={"solution": (listing,) * 15 + slow.solution})
    tasks = [*LEDGER[3:6], slow]
    policy = ScriptedPolicy(think_time_s=0.05)
    with anyio.fail_after(300):
        pool.policy_version = 1
        batch = pool.run_batch(tasks, policy, samples_per_task=2, oversample=1, batch_id="c")
        results = []
        async for result in batch:
            results.append(result)
            if len(results) == 2:
                async with pool.policy_paused():  # mid-batch: a weight swap
                    in_pause = await gates(pool)
                    before_pause = sum(n for _, _, n in in_pause)
                    pool.policy_version = 2
                    during_pause = await admitted(pool) - before_pause
            if len(results) == 5:
                batch.cancel()  # Ctrl-C: the rest deliver their (cancelled) results
        versions = {r.rollout_id: await turn_versions(batch, r.rollout_id) for r in results}
        kept = [r for r in results if r.failure_reason is not FailureReason.CANCELLED]
        again = pool.run_batch(
            tasks, policy, samples_per_task=2, oversample=1, batch_id="c", previous=kept
        )
        rerun = await again.results()
        rerun_versions = [v for r in rerun for v in await turn_versions(again, r.rollout_id)]
    assert len(results) == 12 and any(r.failure_reason is FailureReason.CANCELLED for r in results)
    # No rollout run twice: the resume runs only what has no kept result.
    assert not {r.rollout_id for r in kept} & {r.rollout_id for r in rerun}
    final = kept + rerun
    assert len({r.rollout_id for r in final}) == len(final)
    scored = Counter(r.task_key for r in final if r.reward is not None)
    assert scored == {t.key: 2 for t in tasks}
    assert [len(g.results) for g in again.complete_groups] == [2] * len(tasks)
    # Every turn carries the version of its call: 1 before the swap, 2 after it.
    for seen in versions.values():
        assert seen == sorted(seen) and set(seen) <= {1, 2}
    # Once the pause is entered no actor admits a policy call, so every turn
    # with the old version started before it, and every later one has the new.
    assert all(paused for _, paused, _ in in_pause) and during_pause == 0
    assert sum(seen.count(1) for seen in versions.values()) <= before_pause
    assert rerun_versions and set(rerun_versions) == {2}


async def test_no_policy_call_starts_in_a_pause_and_every_later_turn_has_the_version_set_in_it(
    pool: RolloutPool,
) -> None:
    with anyio.fail_after(300):
        pool.policy_version = 1
        batch = pool.run_batch(LEDGER[:6], ScriptedPolicy(think_time_s=0.15), samples_per_task=2)
        quick = pool.run_batch(LEDGER[6:7], ScriptedPolicy(), samples_per_task=1)
        await quick.results()  # by now the slow batch's policy calls are under way
        async with pool.policy_paused():
            in_pause = await gates(pool)
            before_pause = sum(n for _, _, n in in_pause)
            pool.policy_version = 2
            await anyio.sleep(0.2)  # the weight sync, while rollouts wait for the policy
            during_pause = await admitted(pool) - before_pause
        results = await batch.results()
        versions = [await turn_versions(batch, r.rollout_id) for r in results]
    assert len(results) == 12 and all(r.reward == 1.0 for r in results)
    # Once the pause is entered every gate holds new calls, and none started in it.
    assert all(paused for _, paused, _ in in_pause) and during_pause == 0
    # A turn has the old version only if it started before the pause was entered.
    assert sum(seen.count(1) for seen in versions) <= before_pause
    assert all(seen == sorted(seen) and set(seen) <= {1, 2} for seen in versions)
    assert any(2 in seen for seen in versions)


async def test_on_ray_every_rollout_s_trace_is_posted_with_its_transcript_redacted(
    local_ray: None,
) -> None:
    """``--traces`` on actors: the transcript comes back with the result,
    redacted where the rollout ran, and the driver posts it."""
    from fleetroll.emulator import Emulator
    from fleetroll.pool.ray.executor import ray_pool
    from fleetroll.telemetry.events import Redactor

    secret = "sk-ray-trace-secret-0123456789abcdef"
    settings = load_settings(
        provisioning={"backoff_initial_s": 0.05, "backoff_max_s": 0.5},
        traces={"upload": True},
        openai_api_key=secret,
    )
    tasks = [LEDGER[0].model_copy(update={"prompt": f"{LEDGER[0].prompt} (key {secret})"})]
    tasks += LEDGER[1:3]
    async with Emulator() as emu:
        async with ray_pool(
            settings, api_key=emu.api_key, base_url=emu.base_url, num_actors=2
        ) as pool:
            with anyio.fail_after(300):
                results = await pool.run_batch(tasks, ScriptedPolicy()).results()
        sessions = list(emu.traces.sessions)
    assert [r.reward for r in results] == [1.0, 1.0, 1.0]
    by_rollout = {s.metadata["rollout_id"]: s for s in sessions if s.metadata}
    assert set(by_rollout) == {r.rollout_id for r in results}
    for result in results:
        messages = by_rollout[result.rollout_id].messages
        assert [m["role"] for m in messages] == [m["role"] for m in result.transcript]
    assert secret not in str([s.messages for s in sessions])
    (with_secret,) = [r for r in results if r.task_key == LEDGER[0].key]
    assert Redactor.MASK in str(by_rollout[with_secret.rollout_id].messages)


#: The example agents: on OpenAI's chat completions, Anthropic's Messages API and
#: OpenAI's Responses API.
AGENTS = {
    "openai": AGENT,
    "anthropic": AGENT.with_name("agent_anthropic_mcp.py"),
    "responses": AGENT.with_name("agent_responses_mcp.py"),
}


@pytest.mark.parametrize("dialect", sorted(AGENTS))
async def test_an_agent_command_runs_on_the_actors_and_its_turns_hold_the_server_s_ids(
    local_ray: None, fleet: EmulatorProcess, dialect: str
) -> None:
    from fleetroll.pool.ray.executor import ray_pool

    tasks = LEDGER[:2]
    sink = MemorySink()
    async with FakeChatServer(solving(tasks), vllm=VllmShape()) as server:
        policy = {"kind": "openai", "base_url": server.base_url, "model": "served"}
        policy |= {"return_token_ids": True, "logprobs": True}
        settings = SETTINGS.model_copy(update={"policy": SETTINGS.policy.model_copy(update=policy)})
        async with (
            ray_pool(
                settings,
                api_key=fleet.api_key,
                base_url=fleet.base_url,
                num_actors=2,
                events=Events([sink]),
            ) as pool,
            CommandAgent.from_config(
                [sys.executable, str(AGENTS[dialect])], chat_policy_config(settings)
            ) as agent,
        ):
            with anyio.fail_after(300):
                results = await pool.run_batch(tasks, agent, samples_per_task=2).results()
        replies = list(server.replies)
    ledger = await fleet.ledger()

    assert sorted((r.task_key, r.reward) for r in results) == sorted(
        (t.key, 1.0) for t in tasks for _ in range(2)
    )
    sent, recorded = sent_and_recorded(replies, results)
    assert recorded == sent and sum(len(r.turns) for r in results) == len(replies)
    # The rollouts (so their agents and gateways) ran on the actors, not here.
    completed = sink.named("fleet_rollout_completed")
    assert len(completed) == 4 and all("worker" in e.attributes for e in completed)
    assert ledger["running"] == 0
