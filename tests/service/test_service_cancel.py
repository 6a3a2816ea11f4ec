"""A cancel returns everything: batches cancelled while their creates are in
flight give back every admission place and leave no instance running on Fleet
(``fleetroll serve`` over real HTTP, the emulator as Fleet: creates that go on
after their client left, as Fleet's do)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from service_helpers import LEDGER

from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.service import Service, create_app, serve_app
from fleetroll.service import app as service_app
from fleetroll.settings import load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Events, MemorySink
from ledger_watch import Changes, creates_sent

pytestmark = pytest.mark.slow

#: The instance cap of the service under test.
CAP = 40
#: Cancels, each of a batch whose creates are all in flight.
CANCELS = 16
#: Rollouts of each cancelled batch.
PER_BATCH = 2
#: Long enough that every cancel lands while its batch's creates are at work.
SLOW_CREATES = FaultProfile(
    create_latency=Latency(min_s=3.0, max_s=4.0), creates_outlive_clients=True
)


@asynccontextmanager
async def serving(
    emu: Emulator, sink: MemorySink, changes: Changes
) -> AsyncIterator[tuple[str, Service]]:
    """``fleetroll serve`` over ``emu`` with an instance cap of ``CAP``."""
    settings = load_settings(
        provisioning={
            "adaptive_creates": False,
            "creates_per_second": 1000,
            "max_concurrent_creates": CAP,
        },
        admission={"max_instances": CAP},
    )
    events = Events([sink, changes])
    async with RolloutPool(
        settings, api_key=emu.api_key, base_url=emu.base_url, events=events
    ) as pool:
        service = Service(pool, settings)
        async with serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop) as url:
            yield url, service


class Gathering(ScriptedPolicy):
    """Plays solutions once ``rollouts`` rollouts are in it at once (each holding
    its instance): a batch that cannot have them all waits for ever."""

    def __init__(self, rollouts: int) -> None:
        super().__init__()
        self.rollouts = rollouts
        self.waiting = self.most_at_once = 0
        self.gathered = anyio.Event()

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if not self.gathered.is_set():
            self.waiting += 1
            self.most_at_once = max(self.most_at_once, self.waiting)
            if self.waiting == self.rollouts:
                self.gathered.set()
            await self.gathered.wait()
        return await super().act(task, messages, tools)


async def gauges(http: httpx.AsyncClient) -> dict[str, float]:
    """The gauges of ``GET /metrics`` (unlabelled ones)."""
    with anyio.fail_after(30):
        response = await http.get("/metrics")
    response.raise_for_status()
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            values[name] = float(value)
    return values


IN_FLIGHT = (
    "fleetroll_admission_in_use",
    "fleetroll_admission_starting",
    "fleetroll_creates_in_flight",
    "fleetroll_rollouts_in_flight",
)


def in_flight(values: dict[str, float]) -> dict[str, float]:
    """The gauges that read 0 once nothing is in flight."""
    return {name: values[name] for name in IN_FLIGHT}


def idle(values: dict[str, float]) -> bool:
    return not any(in_flight(values).values())


async def cancel_mid_provisioning(url: str, emu: Emulator, changes: Changes) -> None:
    """``CANCELS`` batches, each cancelled once all its creates reached Fleet."""
    async with FleetrollClient(url) as client:
        for n in range(CANCELS):
            sent = creates_sent(emu.ledger)
            batch = client.run_batch(LEDGER[:PER_BATCH], ScriptedPolicy(), batch_id=f"cut-{n}")
            with anyio.fail_after(30):
                await batch.submit()

                async def arrived(sent: int = sent) -> bool:
                    return creates_sent(emu.ledger) == sent + PER_BATCH

                await changes.until(arrived)
                await batch.cancel()
                results = await batch.results()
            assert [r.failure_reason for r in results] == [FailureReason.CANCELLED] * PER_BATCH


async def test_sixteen_cancels_mid_provisioning_give_back_every_place_and_instance() -> None:
    sink = MemorySink()
    async with Emulator(SLOW_CREATES) as emu:
        changes = Changes(emu.ledger)
        async with serving(emu, sink, changes) as (url, _), httpx.AsyncClient(base_url=url) as http:
            await cancel_mid_provisioning(url, emu, changes)

            async def returned() -> bool:
                ledger = emu.ledger.snapshot()
                quiet = ledger["running"] == 0 and ledger["creates_in_flight"] == 0
                return quiet and idle(await gauges(http))

            with anyio.move_on_after(10):  # from the last cancel
                await changes.until(returned)
            values = await gauges(http)
            ledger = emu.ledger.snapshot()
    # Nothing in flight: no admission place held, no instance running on Fleet.
    assert in_flight(values) == dict.fromkeys(IN_FLIGHT, 0)
    assert (ledger["running"], ledger["creates_in_flight"]) == (0, 0), ledger
    made = ledger["created"]
    # Every create went on at Fleet and made its instance, each released at once.
    assert made == CANCELS * PER_BATCH
    assert emu.ledger.creates_by_outcome["client_gone"] == 0  # none of them was cut
    abandoned = sink.named("fleet_create_abandoned")
    assert len(abandoned) == CANCELS * PER_BATCH
    assert {e.attributes["outcome"] for e in abandoned} == {"released"}
    assert len({e.attributes["instance_id"] for e in abandoned}) == made
    assert {e.attributes["batch_id"] for e in abandoned} == {f"cut-{n}" for n in range(CANCELS)}
    assert {e.attributes["reason"] for e in abandoned} == {"cancelled"}


async def test_a_batch_after_sixteen_cancels_mid_provisioning_runs_on_its_whole_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = MemorySink()
    async with Emulator(SLOW_CREATES) as emu:
        changes = Changes(emu.ledger)
        async with serving(emu, sink, changes) as (url, _), httpx.AsyncClient(base_url=url) as http:
            await cancel_mid_provisioning(url, emu, changes)
            emu.app.faults.profile = SLOW_CREATES.model_copy(
                update={"create_latency": Latency(min_s=0.05)}
            )
            # Every rollout holds its instance until CAP of them hold one at once.
            tasks = LEDGER[: CAP // 2]
            policy = Gathering(CAP)
            monkeypatch.setattr(service_app, "build_policy", lambda config, settings: policy)
            async with FleetrollClient(url) as client:
                batch = client.run_batch(tasks, samples_per_task=2, batch_id="whole-cap")
                results = []
                with anyio.move_on_after(60):  # on fewer places, it waits for ever
                    results = await batch.results()
                values = await gauges(http)
    assert policy.most_at_once == CAP
    assert len(results) == CAP and all(r.reward == 1.0 for r in results)
    assert values["fleetroll_admission_limit"] == CAP
