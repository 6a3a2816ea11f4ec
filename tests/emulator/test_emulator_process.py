"""EmulatorProcess: ``fleetroll emulator`` in a process of its own, forked from a warm one."""

from __future__ import annotations

import os

import anyio
import httpx
import pytest

from fleetroll.emulator import FaultProfile
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.errors import EmulatorError

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


async def test_emulators_run_side_by_side_each_in_its_own_process_and_stop_with_their_block() -> (
    None
):
    with anyio.fail_after(60):
        async with (
            EmulatorProcess() as first,
            EmulatorProcess(FaultProfile(seed=7)) as second,
        ):
            assert len({os.getpid(), first.pid, second.pid}) == 3
            assert first.base_url != second.base_url and first.api_key != second.api_key
            assert (await first.ledger())["running"] == 0
            assert (await second.ledger())["running"] == 0
            async with httpx.AsyncClient(timeout=10) as http:
                # Each holds its own key: the other's is refused.
                refused = await http.get(
                    f"{first.base_url}/_emulator/ledger",
                    headers={"Authorization": f"Bearer {second.api_key}"},
                )
                assert refused.status_code == 401
    async with httpx.AsyncClient(timeout=10) as http:
        for stopped in (first, second):
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{stopped.base_url}/_emulator/ledger")


async def test_an_emulator_that_cannot_start_is_an_emulator_error_that_shows_its_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The child takes this process's environment as it is when it starts, as a new process would.
    monkeypatch.setenv("FLEETROLL_EMULATOR__VERIFIER_MAX_PARALLEL", "0")
    with anyio.fail_after(60), pytest.raises(EmulatorError) as caught:
        async with EmulatorProcess():
            pass
    message = str(caught.value)
    assert "did not start" in message and "emulator.verifier_max_parallel" in message, message
