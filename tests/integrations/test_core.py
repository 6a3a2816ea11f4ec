"""The trainers' core: requests (task, sample) in, one row each out, matched exactly.

The unit tests need no server; the slow ones run rollouts on the emulator
with a scripted vLLM-shaped chat server (a real HTTP server with token ids
and logprobs), and one runs a trainer's process that exits without closing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.errors import ConfigError
from fleetroll.integrations.core import BlockingRollouts, Rollouts, fill_empty_row
from fleetroll.integrations.trl import RolloutFunc, _requests, reward
from fleetroll.pool.batch import rollout_id
from fleetroll.settings import Settings, config_dir, load_settings
from fleetroll.testing.fake_openai import HANG, FakeChatServer, FakeError, VllmShape, completion
from fleetroll_children import child_env

TASKS = config_dir() / "tasks" / "ledger.jsonl"
RECORDS = [json.loads(line) for line in TASKS.read_text(encoding="utf-8").splitlines() if line]
OPENAI = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "max_tokens": 8}


def settings_for(base_url: str, emu: Emulator | None = None) -> Settings:
    fleet = {} if emu is None else {"fleet_base_url": emu.base_url, "fleet_api_key": emu.api_key}
    return load_settings(
        policy={**OPENAI, "base_url": base_url}, telemetry={"db_path": os.devnull}, **fleet
    )


# -- unit ----------------------------------------------------------------------------


def test_a_trainer_needs_a_model_server_not_the_scripted_policy() -> None:
    with pytest.raises(ConfigError, match=r'policy\.kind = "openai"'):
        Rollouts(TASKS, load_settings(policy={"kind": "scripted"}))


async def test_requests_naming_an_unknown_task_or_a_sample_twice_are_refused() -> None:
    rollouts = Rollouts(TASKS, load_settings(policy=OPENAI))
    with pytest.raises(KeyError, match="no task 'nope'"):
        await rollouts.run([("nope", 0)])
    with pytest.raises(ValueError, match="sample 1 of task 'ledger-001' is asked twice"):
        await rollouts.run([("ledger-001", 1), ("ledger-001", 1)])
    with pytest.raises(ValueError, match="an int >= 0"):
        await rollouts.run([("ledger-001", -1)])


def test_each_of_trls_repeat_runs_is_a_group_and_a_task_seen_twice_goes_on_counting() -> None:
    keys = ["a", "a", "b", "b", "a", "a"]

    assert _requests(keys, 2) == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("a", 3)
    ]  # fmt: skip
    # Not whole groups of G: each run of one task's prompts is a group.
    assert _requests(["a", "a", "a", "b"], None) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert _requests(["a", "b", "b", "b"], 2) == [("a", 0), ("b", 0), ("b", 1), ("b", 2)]


def test_a_prompt_maps_to_its_task_by_its_key_and_shared_texts_are_refused() -> None:
    twins = [RECORDS[0], {**RECORDS[0], "key": "twin"}]
    func = RolloutFunc(twins, load_settings(policy=OPENAI))
    prompt = RECORDS[0]["prompt"]

    assert func._key_of([{"role": "user", "content": prompt, "task_key": "twin"}]) == "twin"
    with pytest.raises(ConfigError, match="share the prompt"):
        func._key_of(prompt)
    with pytest.raises(ConfigError, match="no task's"):
        func._key_of([{"role": "user", "content": "something else"}])
    with pytest.raises(ConfigError, match="not among the tasks"):
        func._key_of([{"role": "user", "content": prompt, "task_key": "gone"}])


def test_trls_dataset_carries_each_tasks_key_in_its_prompt_message_and_a_column() -> None:
    pytest.importorskip("datasets")
    from fleetroll.integrations.trl import dataset

    rows = dataset(RECORDS[:2]).to_list()

    assert [r["task_key"] for r in rows] == [RECORDS[0]["key"], RECORDS[1]["key"]]
    assert rows[0]["prompt"] == [
        {"role": "user", "content": RECORDS[0]["prompt"], "task_key": RECORDS[0]["key"]}
    ]


def test_a_trainer_sampling_at_another_temperature_than_fleetroll_is_refused() -> None:
    func = RolloutFunc(RECORDS[:1], load_settings(policy={**OPENAI, "temperature": 0.7}))
    trainer = SimpleNamespace(temperature=1.0)

    shown = r"temperature 1 but fleetroll's policy\.temperature is 0\.7"
    with pytest.raises(ConfigError, match=shown):
        func([RECORDS[0]["prompt"]], trainer)
    unset = RolloutFunc(RECORDS[:1], load_settings(policy=OPENAI))
    unset_shown = r"set policy\.temperature to the trainer's temperature \(1\)"
    with pytest.raises(ConfigError, match=unset_shown):
        unset([RECORDS[0]["prompt"]], trainer)


def test_trls_reward_is_fleetrolls_and_none_for_a_failed_rollout() -> None:
    assert reward([], [], fleetroll_reward=[1.0, None, 0]) == [1.0, None, 0.0]
    with pytest.raises(ValueError, match=r"rollout_func=fleetroll\.integrations\.trl\.RolloutFunc"):
        reward([], [])


def test_a_row_with_no_model_call_is_filled_with_the_prompt_and_one_masked_end_token() -> None:
    empty = {
        "prompt_ids": [],
        "completion_ids": [],
        "completion_mask": [],
        "completion_logprobs": [],
        "completion_policy_versions": [],
        "reward": None,
    }

    filled = fill_empty_row(empty, prompt_ids=[1, 2], end_token_id=9)

    assert filled["prompt_ids"] == [1, 2] and filled["completion_ids"] == [9]
    assert filled["completion_mask"] == [0] and filled["completion_logprobs"] == [None]
    assert empty["prompt_ids"] == []  # a copy


# -- on the emulator -----------------------------------------------------------------


@pytest.mark.slow
async def test_rows_answer_the_requests_in_order_by_task_and_sample_even_with_shared_prompts(
    emulator: Emulator,
) -> None:
    refused = RECORDS[2]["prompt"]

    def answer(body: dict[str, Any]) -> Any:
        if any(m.get("content") == refused for m in body["messages"]):
            return FakeError(400, "this prompt is refused")  # a failed rollout: no reward
        return completion("done")

    tasks = [RECORDS[0], {**RECORDS[0], "key": "twin"}, RECORDS[2]]
    a, b, c = (t["key"] for t in tasks)
    # Shuffled, a task with samples {2, 5} (a batch of its own), two tasks sharing a prompt.
    requests = [(b, 1), (a, 0), (c, 5), (b, 0), (a, 1), (c, 2)]
    async with (
        FakeChatServer(answer, vllm=VllmShape()) as server,
        Rollouts(tasks, settings_for(server.base_url, emulator)) as rollouts,
    ):
        with anyio.fail_after(60):
            rows = await rollouts.run(requests, batch_id="b1")

    assert [(r["task_key"], r["sample_index"]) for r in rows] == requests
    for row, (key, index) in zip(rows, requests, strict=True):
        assert row["rollout_id"] in {rollout_id(f"b1-{n}", key, index) for n in (0, 1)}
        if key == c:
            assert row["reward"] is None and row["status"] == "failed"
            assert row["failure_reason"] == "policy_error"
            assert set(row["completion_mask"]) <= {0} and row["advantage"] == 0.0
        else:
            assert row["reward"] is not None and row["status"] == "scored"
            assert row["prompt_ids"] and 1 in row["completion_mask"]
            n = len(row["completion_ids"])
            assert len(row["completion_mask"]) == len(row["completion_logprobs"]) == n
            assert row["completion_policy_versions"] == [
                0 if m else None for m in row["completion_mask"]
            ]
    assert len({r["rollout_id"] for r in rows}) == len(rows)
    assert emulator.ledger.running == 0


@pytest.mark.slow
async def test_a_trainer_that_exits_without_closing_releases_its_instances_and_does_not_hang(
    emulator: Emulator, tmp_path: Path
) -> None:
    """The process ends while a rollout's model call is in flight: fleetroll closes
    at interpreter exit (the rollout cancelled, its instance released)."""
    called = anyio.Event()

    def answer(body: dict[str, Any]) -> Any:
        called.set()
        return HANG

    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, threading\n"
        "from fleetroll.integrations.core import BlockingRollouts\n"
        "rollouts = BlockingRollouts(sys.argv[1]).open()\n"
        "threading.Thread(target=rollouts.run, args=([('ledger-001', 0)],), daemon=True).start()\n"
        "sys.stdin.readline()  # the test: its model call is in flight\n"
        "print('leaving', flush=True)\n",
        encoding="utf-8",
    )
    created = emulator.ledger.created
    async with FakeChatServer(answer, vllm=VllmShape()) as server:
        env = child_env(
            emulator,
            FLEETROLL_POLICY__KIND="openai",
            FLEETROLL_POLICY__BASE_URL=server.base_url,
        )
        async with await anyio.open_process(
            [sys.executable, str(script), str(TASKS)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as process:
            assert process.stdin is not None and process.stdout is not None
            with anyio.fail_after(60):
                await called.wait()
                await process.stdin.send(b"go\n")
                code = await process.wait()
            out = await process.stdout.receive()

    assert code == 0 and b"leaving" in out
    assert emulator.ledger.created == created + 1
    assert emulator.ledger.running == 0


def test_blocking_rollouts_refuse_to_reopen_once_closed() -> None:
    rollouts = BlockingRollouts(TASKS, load_settings(policy=OPENAI))
    rollouts.close()  # never opened: nothing to close
    with pytest.raises(RuntimeError, match="closed"):
        rollouts.open()


@pytest.mark.slow
async def test_the_async_grpo_worker_puts_trls_samples_of_scored_rollouts_with_their_version(
    emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's AsyncGRPOTrainer needs CUDA; its worker protocol and samples are checked here."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    async_grpo = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from fleetroll.integrations.trl import RolloutWorker

    protocol = async_grpo.RolloutWorkerProtocol
    methods = {"start", "stop", "update_model_version", "check_health"}
    assert all(callable(getattr(protocol, name, None)) for name in methods)  # as installed
    async with FakeChatServer(lambda body: completion("done"), vllm=VllmShape()) as server:
        worker = RolloutWorker(
            RECORDS[:2], settings_for(server.base_url, emulator), num_generations=2
        )
        assert all(hasattr(worker, name) for name in [*methods, *protocol.__annotations__])

        def drain() -> list[Any]:
            worker.start()
            first = [worker.rollout_buffer.get(timeout=60) for _ in range(4)]
            worker.update_model_version(3)
            later = first[-1]
            while later.model_version != 3:
                later = worker.rollout_buffer.get(timeout=60)
            worker.check_health(60)
            worker.stop()
            return [*first, later]

        samples = await anyio.to_thread.run_sync(drain)

    for sample in samples:
        assert isinstance(sample, RolloutSample)
        n = len(sample.input_ids)
        assert len(sample.completion_mask) == len(sample.old_log_probs) == n
        assert sample.completion_mask.sum() > 0 and sample.completion_mask[0] == 0
        assert (sample.old_log_probs[sample.completion_mask == 0] == 0).all()
        assert sample.metrics["reward"] is not None
    # Two groups of two (one task each) first, then version 3 once it is set.
    assert sorted(s.group_id for s in samples[:4]) == [0, 0, 1, 1]
    assert [s.model_version for s in samples[:4]] == [0, 0, 0, 0]
    assert samples[-1].model_version == 3
    assert emulator.ledger.running == 0
