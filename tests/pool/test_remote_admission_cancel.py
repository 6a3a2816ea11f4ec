"""A cancel returns everything on the Ray cluster's admission too: a pool whose
admission is a RemoteAdmission over the cluster's AdmissionHost (an actor's, with
calls carried as Ray carries them, in-process), its batches cancelled while their
creates are in flight on the emulator (real HTTP)."""

from __future__ import annotations

import anyio
import pytest
from test_remote_admission import InProcess

from fleetroll.emulator import Emulator
from fleetroll.environments.admission import CreateLimits
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.ray.admission import AdmissionHost, RemoteAdmission
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.settings import config_dir, load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink
from ledger_watch import Changes, creates_sent

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CAP, CANCELS, PER_BATCH = 8, 4, 2
SETTINGS = load_settings(
    provisioning={
        "adaptive_creates": False,
        "creates_per_second": 1000,
        "max_concurrent_creates": CAP,
    },
    admission={"max_instances": CAP},
)
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
#: Long enough that every cancel lands while its batch's creates are at work.
SLOW_CREATES = FaultProfile(
    create_latency=Latency(min_s=3.0, max_s=4.0), creates_outlive_clients=True
)


async def test_cancels_mid_provisioning_give_the_clusters_places_and_slots_back() -> None:
    host = AdmissionHost(SETTINGS)
    sink = MemorySink()
    async with Emulator(SLOW_CREATES) as emu, anyio.create_task_group() as calls:
        changes = Changes(emu.ledger)
        admission = RemoteAdmission(
            InProcess(host, calls),
            "worker-0",
            call_s=30,
            limits=CreateLimits.from_settings(SETTINGS.provisioning),
        )
        async with RolloutPool(
            SETTINGS,
            api_key=emu.api_key,
            base_url=emu.base_url,
            admission=admission,
            events=Events([sink, changes]),
        ) as pool:
            for n in range(CANCELS):
                batch = pool.run_batch(LEDGER[:PER_BATCH], ScriptedPolicy(), batch_id=f"cut-{n}")

                async def arrived(sent: int = (n + 1) * PER_BATCH) -> bool:
                    return creates_sent(emu.ledger) == sent

                with anyio.fail_after(30):
                    await changes.until(arrived)
                    batch.cancel()
                    results = await batch.results()
                assert [r.failure_reason for r in results] == [FailureReason.CANCELLED] * PER_BATCH

            async def returned() -> bool:
                ledger = emu.ledger.snapshot()
                state = host._admission.state()
                return (
                    ledger["running"] == ledger["creates_in_flight"] == 0
                    and state.in_use == state.starting == state.creates_in_flight == 0
                )

            with anyio.move_on_after(10):  # from the last cancel
                await changes.until(returned)
            state, stats = host._admission.state(), await host.stats()
            ledger = emu.ledger.snapshot()
        calls.cancel_scope.cancel()
    # The cluster's controller holds no place and no create slot; Fleet runs nothing.
    assert (state.in_use, state.starting, state.creates_in_flight) == (0, 0, 0), state
    assert stats["in_use"] == 0
    assert (ledger["running"], ledger["created"]) == (0, CANCELS * PER_BATCH), ledger
    events = sink.named("fleet_create_abandoned")
    assert sorted(e.attributes["batch_id"] for e in events) == sorted(
        f"cut-{n}" for n in range(CANCELS) for _ in range(PER_BATCH)
    )
    assert {e.attributes["outcome"] for e in events} == {"released"}
