"""The heartbeat loop (fleetroll.environments.fleet.heartbeats), over a stand-in instance."""

from __future__ import annotations

import logging
from typing import Any, cast

import anyio
import pytest
from fleet._async import exceptions as fleet_errors
from fleet._async.client import AsyncEnv

from fleetroll.environments.fleet.heartbeats import Heartbeats


class Beaten:
    """An instance's two fields the loop reads, and its heartbeat call (the edge)."""

    def __init__(self, instance_id: str, interval: int | None = 1) -> None:
        self.instance_id = instance_id
        self.heartbeat_interval = interval
        self.beats = 0
        self.beaten = anyio.Event()

    async def heartbeat(self) -> None:
        self.beats += 1
        self.beaten.set()
        self.beaten = anyio.Event()


def env(beaten: Beaten) -> AsyncEnv:
    return cast(AsyncEnv, cast(Any, beaten))


async def test_creates_ask_for_heartbeats_only_while_the_loop_runs() -> None:
    beats = Heartbeats(60, timeout_s=5)
    assert beats.interval is None
    async with anyio.create_task_group() as tg:
        beats.start(tg)
        assert beats.interval == 60
        tg.cancel_scope.cancel()
    assert beats.interval is None
    assert Heartbeats(None, timeout_s=5).interval is None


async def test_a_new_instance_is_beaten_at_once_then_every_half_interval_until_dropped() -> None:
    beats = Heartbeats(1, timeout_s=5)
    first, gone = Beaten("a"), Beaten("b")
    async with anyio.create_task_group() as tg:
        beats.start(tg)
        with anyio.fail_after(5):
            beats.hold(env(first))
            await first.beaten.wait()  # at once, not after half an interval
            beats.hold(env(gone))
            await gone.beaten.wait()
            beats.drop("b")
            for _ in range(2):  # the rounds go on for the held one
                await first.beaten.wait()
        tg.cancel_scope.cancel()
    assert first.beats >= 3 and gone.beats == 1


async def test_an_instance_made_without_an_interval_is_not_beaten() -> None:
    beats = Heartbeats(1, timeout_s=5)
    plain, kept = Beaten("a", interval=None), Beaten("b")
    async with anyio.create_task_group() as tg:
        beats.start(tg)
        beats.hold(env(plain))
        beats.hold(env(kept))
        with anyio.fail_after(5):
            for _ in range(2):
                await kept.beaten.wait()
        tg.cancel_scope.cancel()
    assert plain.beats == 0


class Released(Beaten):
    """An instance whose beat crosses its release (or, held still, is lost): a 404."""

    def __init__(self, instance_id: str, beats: Heartbeats, *, release: bool) -> None:
        super().__init__(instance_id)
        self._beats = beats
        self._release = release

    async def heartbeat(self) -> None:
        await super().heartbeat()
        if self._release:
            self._beats.drop(self.instance_id)  # the rollout's release, meanwhile
        raise fleet_errors.FleetAPIError("Instance not found", status_code=404)


@pytest.mark.parametrize("released", [True, False], ids=["released", "held"])
async def test_a_beat_that_crossed_its_release_is_no_console_warning(
    released: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # 22 of 10,000 `scale` rollouts printed one each: the delete won the race.
    beats = Heartbeats(60, timeout_s=5)
    instance = Released("a", beats, release=released)
    caplog.set_level(logging.DEBUG, "fleetroll.environments.fleet.heartbeats")
    async with anyio.create_task_group() as tg:
        beats.start(tg)
        with anyio.fail_after(5):
            beats.hold(env(instance))
            await instance.beaten.wait()
            while beats.failed == 0:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    (record,) = caplog.records
    assert record.getMessage() == "heartbeat of instance a failed: FleetAPIError"
    assert record.levelno == (logging.DEBUG if released else logging.WARNING)
