"""Fleet's task contract, end to end on the emulator with both control clients
(``provisioning.control_client = "direct"`` and ``"sdk"``): a verifier's result
in every shape Fleet's verifiers return, and a task's ``seed`` and
``timestamp`` sent with every reset of its instance."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.emulator.app import RecordedRequest
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec, parse_task

pytestmark = pytest.mark.slow

MODES = ("direct", "sdk")
FAST = {"creates_per_second": 1000, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
#: 2026-01-01T00:00:00Z.
NEW_YEAR = 1_767_225_600


def returning(key: str, literal: str, **fields: Any) -> TaskSpec:
    """A ledger task whose verifier returns ``literal`` (Python source)."""
    code = f"def verify(env, final_answer=None):\n    return {literal}\n"
    return TaskSpec(
        key=key, prompt="Look around.", env_key="ledger", data_key="seed", verifier_func=code,
        solution=(SolutionStep(name="list_accounts"),), **fields,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Run:
    results: list[RolloutResult]
    #: What the emulator received, and its ledger once the batch ended.
    requests: list[RecordedRequest]
    ledger: dict[str, Any]


async def run(
    mode: str,
    tasks: list[TaskSpec],
    *,
    samples: int = 1,
    concurrency: int = 4,
    **provisioning: Any,
) -> Run:
    """``tasks`` (``samples`` each) on a fresh emulator recording its requests."""
    async with Emulator(record_requests=1000) as emu:
        settings = load_settings(
            provisioning={**FAST, "control_client": mode, **provisioning},
            pool={"concurrency": concurrency},
        )
        async with RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool:
            with anyio.fail_after(120):
                results = await pool.run_batch(
                    tasks, ScriptedPolicy(), samples_per_task=samples
                ).results()
        assert emu.ledger.running == 0
        return Run(results, emu.requests, emu.ledger.snapshot())


@pytest.mark.parametrize("mode", MODES)
async def test_every_shape_of_a_verifier_s_result_gives_its_reward(mode: str) -> None:
    shapes = {
        "float": ("0.25", 0.25),
        "score": ('{"score": 0.5}', 0.5),
        "reward": ('{"reward": 0.75}', 0.75),
        "value": ('{"value": 0.125}', 0.125),
        "true": ("True", 1.0),
        "unclamped": ("1.5", 1.5),
    }
    tasks = [returning(key, literal) for key, (literal, _) in shapes.items()]
    tasks.append(returning("text", '"abc"'))

    results = {r.task_key: r for r in (await run(mode, tasks)).results}

    for key, (_, reward) in shapes.items():
        assert results[key].reward == reward, (key, results[key].error)
        assert results[key].failure_reason is None
    bad = results["text"]
    assert bad.reward is None and bad.failure_reason is FailureReason.VERIFIER_ERROR
    assert bad.error is not None and "returned 'abc' (a str), not a number" in bad.error
    assert bad.verifier is not None and bad.verifier.error is not None
    assert "\n" not in bad.verifier.error


#: Prints the transactions the rollout added (the state it left), and scores
#: whether the newest one is dated on the instance's pinned day.
STATE = (
    "def verify(env, final_answer=None):\n"
    "    rows = env.db('current').query(\n"
    "        'SELECT id, date, description, amount_cents, reference FROM transactions'\n"
    "        ' WHERE id > 5 ORDER BY id'\n"
    "    ).rows\n"
    "    print(json.dumps(rows))\n"
    "    return {'score': 1.0 if rows and rows[-1][1] == '2026-01-01' else 0.0}\n"
)
#: An undated transaction: the instance's today, and a reference from its random source.
UNDATED = SolutionStep(
    name="record_transaction",
    arguments={"from_account": "Checking", "to_account": "Rent", "amount": 12.5,
               "description": "Desk rent"},
)  # fmt: skip


def stateful(key: str, **fields: Any) -> TaskSpec:
    return TaskSpec(
        key=key, prompt="Record the desk rent.", env_key="ledger", data_key="seed",
        verifier_func=STATE, solution=(UNDATED,), **fields,
    )  # fmt: skip


def reset_bodies(requests: list[RecordedRequest]) -> list[object]:
    return [r.json() for r in requests if r.method == "POST" and r.path.endswith("/env/reset")]


@pytest.mark.parametrize("mode", MODES)
async def test_a_task_s_seed_and_timestamp_go_with_every_reset_and_give_the_same_state_twice(
    mode: str,
) -> None:
    pinned = stateful("pinned", seed=7, timestamp=NEW_YEAR)
    # The same pinned task with its seed and time in metadata, as Fleet exports them.
    exported = parse_task(
        {
            "key": "exported", "prompt": pinned.prompt, "env_id": "ledger", "data_id": "seed",
            "verifier_func": STATE, "solution": [UNDATED.model_dump()],
            "metadata": {"seed": 7, "timestamp": NEW_YEAR, "task_modality": "tool_use"},
        },
        source="export.jsonl",
        modalities=("tool_use",),
    )  # fmt: skip
    assert (exported.seed, exported.timestamp) == (7, NEW_YEAR)
    other_seed = stateful("other-seed", seed=8, timestamp=NEW_YEAR)
    unpinned = stateful("unpinned")
    # One instance at a time, reused: the same instance is reset to each task's point.
    done = await run(
        mode, [pinned, exported, other_seed, unpinned], samples=2, concurrency=1, reuse=True
    )
    results, ledger = done.results, done.ledger

    by_key: dict[str, list[RolloutResult]] = {}
    for result in results:
        assert result.verifier is not None, result.error
        by_key.setdefault(result.task_key, []).append(result)
    state = {key: [json.loads(r.verifier.stdout) for r in rs] for key, rs in by_key.items()}  # type: ignore[union-attr]
    # Twice (and on the task given in Fleet's export form) the same state, to the
    # reference drawn from the seed; dated on the pinned day.
    assert state["pinned"][0] == state["pinned"][1] == state["exported"][0] == state["exported"][1]
    [[_, day, description, cents, reference]] = state["pinned"][0]
    assert (day, description, cents) == ("2026-01-01", "Desk rent", 1250)
    assert reference is not None and reference.startswith("TX-")
    assert [r.reward for r in by_key["pinned"] + by_key["exported"]] == [1.0] * 4
    # Another seed: another reference, the same day.
    assert state["other-seed"][0] == state["other-seed"][1]
    assert state["other-seed"][0][0][1] == day and state["other-seed"][0][0][4] != reference
    # Unpinned: the wall clock's day.
    assert [r.reward for r in by_key["unpinned"]] == [0.0, 0.0]

    # The emulator saw every reset ask for its task's seed and time (Fleet's ResetRequest).
    bodies = reset_bodies(done.requests)
    pinned_body = {"timestamp": NEW_YEAR, "seed": 7}
    assert bodies.count(pinned_body) >= 4  # each rollout of the two tasks resets
    assert {"timestamp": NEW_YEAR, "seed": 8} in bodies
    assert {"timestamp": None, "seed": None} in bodies
    assert set(map(json.dumps, bodies)) <= set(
        map(json.dumps, [pinned_body, {"timestamp": NEW_YEAR, "seed": 8},
                         {"timestamp": None, "seed": None}])
    )  # fmt: skip
    assert ledger["resets_seeded"] == ledger["resets_time_pinned"] >= 6
    assert ledger["created"] < len(results)  # reused: one instance served several
