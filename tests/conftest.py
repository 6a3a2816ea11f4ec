from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from fleetroll.emulator import Emulator


@pytest.fixture(scope="session", autouse=True)
def _outside_the_repository(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run every test, and whatever it starts, in a scratch folder, never in the checkout.

    A test (or a server or worker it starts) that writes or deletes in its working directory
    then touches only a folder made for this run.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """One backend for the whole run, so module-scoped async fixtures can exist."""
    return "asyncio"


@pytest.fixture(scope="module")
async def emulator() -> AsyncIterator[Emulator]:
    """An emulator with no faults, shared by the tests of one module."""
    async with Emulator() as emu:
        yield emu
