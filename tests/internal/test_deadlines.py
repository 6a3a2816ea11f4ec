"""fleetroll's fail_after keeps anyio.fail_after's contract (each case runs on both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from fleetroll._internal.deadlines import fail_after

BOTH = pytest.mark.parametrize("deadline", [fail_after, anyio.fail_after], ids=["ours", "anyio"])
Deadline = Callable[[float | None], Any]


@BOTH
async def test_a_block_past_its_deadline_raises_timeout_error(deadline: Deadline) -> None:
    with pytest.raises(TimeoutError), deadline(0.05):
        await anyio.sleep(5)


@BOTH
async def test_a_block_in_time_or_without_a_deadline_runs_to_its_end(deadline: Deadline) -> None:
    done = []
    with deadline(5):
        await anyio.sleep(0)
        done.append(1)
    with deadline(None) as scope:
        await anyio.sleep(0.01)
        done.append(2)
    assert done == [1, 2] and scope.deadline == float("inf")


@BOTH
async def test_a_cancellation_from_outside_passes_through_as_itself(deadline: Deadline) -> None:
    with anyio.move_on_after(0.05) as outer:
        with deadline(5):
            await anyio.sleep(5)
    assert outer.cancelled_caught
    # The inner deadline passes first: only it raises.
    with anyio.CancelScope(deadline=anyio.current_time() + 5) as outer:
        with pytest.raises(TimeoutError), deadline(0.05):
            await anyio.sleep(5)
    assert not outer.cancelled_caught


@BOTH
async def test_an_error_in_the_block_propagates_unchanged(deadline: Deadline) -> None:
    with pytest.raises(KeyError, match="boom"), deadline(5):
        await anyio.sleep(0)
        raise KeyError("boom")


@BOTH
async def test_a_deadline_moved_in_the_block_is_the_one_kept(deadline: Deadline) -> None:
    began = anyio.current_time()
    with pytest.raises(TimeoutError), deadline(5) as scope:
        scope.deadline = anyio.current_time() + 0.05
        await anyio.sleep(5)
    assert anyio.current_time() - began < 4


async def test_now_reads_anyio_s_clock() -> None:
    from fleetroll._internal.deadlines import now

    before = anyio.current_time()
    mine = now()
    after = anyio.current_time()
    assert before <= mine <= after
