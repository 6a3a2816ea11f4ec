"""Per tool call: fleetroll's ToolSession against a bare ``mcp`` client session.

One instance on a fresh emulator with no injected latency, so a call costs
what the protocol and the clients cost on this machine. fleetroll's session
is opened as a rollout opens it (:meth:`FleetProvider.open_tools`) and calls go through
:meth:`ToolSession.call` (deadline, error translation, normalisation); the
bare session is ``mcp.Client(url)`` and ``call_tool``, nothing else. Calls
alternate between the two (and which goes first), so drift on a busy machine
hits both alike. For scale, a few calls each on a fresh session (the
reference's habit) are timed too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from mcp import Client

from fleetroll.bench.measure import CpuClock, machine_cpu_s, percentile, process_tree_cpu_s
from fleetroll.bench.records import BUSY_CORES, ToolCallRecord, ToolCallStats, load_average
from fleetroll.bench.scenarios import Scenario, bench_tasks
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.environments.fleet.provider import FleetProvider
from fleetroll.pool.assembly import fleet_provider
from fleetroll.settings import Settings
from fleetroll.settings.fault_profiles import FaultProfile
from fleetroll.telemetry.events import Events

__all__ = ["tool_call_bench"]

_TOOL = "get_balance"
_ARGUMENTS = {"account": "Checking"}
_WARM_UP = 20
_FRESH_SESSION_CALLS = 50


class _Series:
    def __init__(self, client: str) -> None:
        self.client = client
        self.wall: list[float] = []
        self.cpu: list[float] = []

    async def time(self, call: Callable[[], Awaitable[object]]) -> None:
        cpu = time.process_time()
        began = time.perf_counter()
        await call()
        self.wall.append(time.perf_counter() - began)
        self.cpu.append(time.process_time() - cpu)

    def stats(self) -> ToolCallStats:
        def ms(value: float | None) -> float:
            return round((value or 0.0) * 1000, 3)

        return ToolCallStats(
            client=self.client,
            calls=len(self.wall),
            wall_mean_ms=ms(sum(self.wall) / len(self.wall)),
            wall_p50_ms=ms(percentile(self.wall, 50)),
            wall_p95_ms=ms(percentile(self.wall, 95)),
            cpu_mean_ms=ms(sum(self.cpu) / len(self.cpu)),
        )


@asynccontextmanager
async def _fleet(settings: Settings, emu: EmulatorProcess) -> AsyncIterator[FleetProvider]:
    provider = fleet_provider(settings, Events(), api_key=emu.api_key, base_url=emu.base_url)
    try:
        yield provider
    finally:
        await provider.aclose()


async def tool_call_bench(scenario: Scenario, calls: int, settings: Settings) -> ToolCallRecord:
    """Time ``calls`` calls through each client on one instance, interleaved.

    Raises:
        TimeoutError: the whole benchmark passed the scenario's wall limit.
    """
    load = load_average()
    task = bench_tasks(1, 1, samples=1)[0][0]
    fleetroll = _Series("fleetroll ToolSession")
    bare = _Series("bare mcp Client")
    fresh = _Series("fresh session per call")
    async with EmulatorProcess(FaultProfile()) as emu, _fleet(settings, emu) as provider:
        assert emu.pid is not None
        began = time.perf_counter()
        before = (machine_cpu_s(), CpuClock.now(), process_tree_cpu_s(emu.pid))
        instance = await provider.provision(task, run_id="tool-call-bench")
        try:
            route = provider.route(instance, task)
            url = route.url
            with anyio.fail_after(scenario.wall_limit_s):
                async with (
                    provider.open_tools(instance, route) as session,
                    Client(url) as client,
                ):

                    async def ours() -> object:
                        return await session.call(_TOOL, _ARGUMENTS)

                    async def theirs() -> object:
                        return await client.call_tool(_TOOL, dict(_ARGUMENTS))

                    for _ in range(_WARM_UP):
                        await ours()
                        await theirs()
                    for i in range(calls):
                        pair = (fleetroll, ours), (bare, theirs)
                        for series, call in pair if i % 2 == 0 else reversed(pair):
                            await series.time(call)

                async def fresh_call() -> object:
                    async with Client(url) as one_off:
                        return await one_off.call_tool(_TOOL, dict(_ARGUMENTS))

                for _ in range(min(calls, _FRESH_SESSION_CALLS)):
                    await fresh.time(fresh_call)
        finally:
            await provider.release(instance)
        elapsed = time.perf_counter() - began
        machine, own, emulator = machine_cpu_s(), CpuClock.now(), process_tree_cpu_s(emu.pid)
    ours_stats, bare_stats = fleetroll.stats(), bare.stats()
    others = None
    if None not in (machine, before[0], emulator, before[2]):
        assert machine is not None and before[0] is not None
        assert emulator is not None and before[2] is not None
        others = (machine - before[0]) - own.since(before[1]) - (emulator - before[2])
    return ToolCallRecord(
        calls=calls,
        tool=_TOOL,
        clients=[ours_stats, bare_stats, fresh.stats()],
        ratio_mean=round(ours_stats.wall_mean_ms / bare_stats.wall_mean_ms, 3),
        ratio_p50=round(ours_stats.wall_p50_ms / bare_stats.wall_p50_ms, 3),
        load_average_before=load,
        other_cpu_utilisation=None if others is None else round(max(0.0, others) / elapsed, 3),
        provisional=others is None or others / elapsed > BUSY_CORES,
    )
