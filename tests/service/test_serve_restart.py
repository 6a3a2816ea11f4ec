"""``fleetroll serve`` restarted under a trainer (kill -9, SIGTERM): the service remembers.

Real processes: the service with its embedded emulator, killed and started
again on the same ``service.state_dir``; the trainer is ``FleetrollClient``,
which reconnects with its cursor and resubmits the batch the restart cut.
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from pathlib import Path

import anyio
import httpx
import pytest
from service_helpers import TOKEN, free_port, serve_env, serving

from fleetroll.client import FleetrollClient
from fleetroll.pool.journal import read_journal
from fleetroll.pool.rollout_pool import rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.service.models import PolicyConfig
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

pytestmark = pytest.mark.slow

LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=load_settings().modalities)
TASKS = LEDGER[:6]
SAMPLES = 4  # 6 tasks x 4 samples = 24 rollouts
BATCH = "step-1"
#: Slow enough that when the service goes down, rollouts are done, running and waiting.
POLICY = PolicyConfig(kind="scripted", think_time_s=0.25)


async def restart_under_a_trainer(tmp_path: Path, stop: signal.Signals) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    journal = tmp_path / "state" / "batches" / f"{BATCH}.jsonl"
    seen: list[tuple[int, RolloutResult]] = []  # (cursor, result), as the trainer got them
    # Retries enough to ride out the moments between a stream's cut and the restart.
    async with FleetrollClient(
        url, token=TOKEN, max_retries=40, backoff_initial_s=0.05, backoff_max_s=0.5
    ) as client:
        batch = client.run_batch(TASKS, POLICY, samples_per_task=SAMPLES, batch_id=BATCH)
        async with serving(tmp_path, port) as (first, _):
            with anyio.fail_after(120):
                async for result in batch:
                    seen.append((batch.cursor, result))
                    if len(seen) == 8:
                        break
            first.send_signal(stop)
            with anyio.fail_after(60):
                code = await first.wait()
        assert code == (0 if stop is signal.SIGTERM else -signal.SIGKILL)

        async with serving(tmp_path, port) as (_, said):
            async with httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}
            ) as http:
                answer = await http.get(f"/v1/batches/{BATCH}")
            assert answer.status_code == 200, answer.text  # the batch survived the restart
            before = read_journal(journal, latest=False)
            assert 8 <= len(before) < len(TASKS) * SAMPLES  # some had not ended
            # Cut short by the stop: no result kept for them, so none is delivered twice.
            assert not [r for r in before if r.failure_reason is FailureReason.CANCELLED]
            assert answer.json()["status"] == "interrupted"
            assert answer.json()["results"] == len(before)
            assert any("(1 read back)" in line for line in said), said
            # The trainer goes on from its cursor; the stream says the batch was cut,
            # and the client submits it again: the rollouts without a result run.
            with anyio.fail_after(180):
                async for result in batch:
                    seen.append((batch.cursor, result))
            assert batch.resubmits == 1
            assert batch.rerun == len(TASKS) * SAMPLES - len(before)  # only those without one
            async with httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}
            ) as http:
                state = (await http.get(f"/v1/batches/{BATCH}")).json()
            assert state["status"] == "finished"

    expected = {rollout_id(BATCH, t.key, n) for t in TASKS for n in range(SAMPLES)}
    delivered = Counter(r.rollout_id for _, r in seen)
    assert set(delivered) == expected
    assert set(delivered.values()) == {1}, "a rollout was delivered twice"
    # Cursors only grow, and each is the result's line in the batch's journal.
    after = read_journal(journal, latest=False)
    assert [c for c, _ in seen] == sorted(c for c, _ in seen)
    assert len(after) == len(expected)
    for cursor, result in seen:
        assert after[cursor - 1] == result
    assert after[: len(before)] == before  # nothing stored before the restart changed


async def test_a_trainer_reading_a_batch_through_a_kill_9_of_serve_gets_each_rollout_once(
    tmp_path: Path,
) -> None:
    await restart_under_a_trainer(tmp_path, signal.SIGKILL)


async def test_a_trainer_reading_a_batch_through_a_sigterm_of_serve_gets_each_rollout_once(
    tmp_path: Path,
) -> None:
    await restart_under_a_trainer(tmp_path, signal.SIGTERM)


async def test_a_second_serve_on_the_same_state_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    async with serving(tmp_path, free_port()):
        command = [sys.executable, "-m", "fleetroll", "serve", "--port", str(free_port())]
        with anyio.fail_after(60):
            second = await anyio.run_process(
                command, cwd=tmp_path, env=serve_env(tmp_path / "state"), check=False
            )
    said = second.stderr.decode()
    assert second.returncode == 2, said
    assert "Traceback" not in said
    assert "is in use by another fleetroll serve" in said
    assert len(said.strip().splitlines()) == 1, said


async def test_a_client_rides_through_a_10_s_restart_of_serve_and_delivers_each_result_once(
    tmp_path: Path,
) -> None:
    # The client as a trainer makes it (its defaults: reconnect_s), reading all along:
    # no resume call, no second form; the service is down for about 10 s.
    port = free_port()
    seen: list[RolloutResult] = []
    eight, finished = anyio.Event(), anyio.Event()
    async with FleetrollClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:
        assert client.reconnect_s >= 60
        batch = client.run_batch(TASKS, POLICY, samples_per_task=SAMPLES, batch_id=BATCH)

        async def read() -> None:
            async for result in batch:
                seen.append(result)
                if len(seen) == 8:
                    eight.set()
            finished.set()

        async with anyio.create_task_group() as tg:
            async with serving(tmp_path, port) as (first, _):
                tg.start_soon(read)
                with anyio.fail_after(120):
                    await eight.wait()
                down_at = anyio.current_time()
                first.send_signal(signal.SIGTERM)
                with anyio.fail_after(60):
                    await first.wait()
            # The outage itself is what this test is about: keep the service down ~10 s.
            await anyio.sleep(max(0.0, 10.0 - (anyio.current_time() - down_at)))
            assert not finished.is_set()
            async with serving(tmp_path, port):
                with anyio.fail_after(180):
                    await finished.wait()

    expected = {rollout_id(BATCH, t.key, n) for t in TASKS for n in range(SAMPLES)}
    delivered = Counter(r.rollout_id for r in seen)
    assert set(delivered) == expected
    assert set(delivered.values()) == {1}, "a rollout was delivered twice"
    assert batch.reconnects >= 1 and batch.resubmits == 1
