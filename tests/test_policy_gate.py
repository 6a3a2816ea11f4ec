from __future__ import annotations

import anyio
import pytest

from fleetroll.policy_gate import PolicyGate

pytestmark = pytest.mark.anyio


async def test_an_open_gate_admits_at_once_with_the_current_version() -> None:
    gate = PolicyGate(version=3)
    gate.version = 7
    assert await gate.admit() == (7, 0.0)


async def test_a_pause_holds_new_calls_until_it_ends_and_they_get_the_new_version() -> None:
    gate = PolicyGate()
    admitted: list[int] = []

    async def call() -> None:
        version, _ = await gate.admit()
        admitted.append(version)

    async with anyio.create_task_group() as tg, gate.paused_calls():
        tg.start_soon(call)
        tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert admitted == []
        gate.version = 1
        # The pause is over: both waiting calls go on, with the new version.
    assert admitted == [1, 1]
    assert not gate.paused


async def test_nested_pauses_hold_calls_until_the_last_one_ends() -> None:
    gate = PolicyGate()
    admitted = anyio.Event()

    async def call() -> None:
        await gate.admit()
        admitted.set()

    async with anyio.create_task_group() as tg, gate.paused_calls():
        async with gate.paused_calls():
            tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert gate.paused
        assert not admitted.is_set()
    assert admitted.is_set()


async def test_a_pause_whose_block_raises_still_ends() -> None:
    gate = PolicyGate()
    with pytest.raises(RuntimeError):
        async with gate.paused_calls():
            raise RuntimeError("the weight sync failed")
    assert not gate.paused
    assert (await gate.admit())[0] == 0


def test_a_version_must_be_an_int() -> None:
    gate = PolicyGate()
    with pytest.raises(TypeError, match="not str"):
        gate.version = "2"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="not bool"):
        gate.version = True
