from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from fleetroll.emulator import Emulator


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """One backend for the whole run, so module-scoped async fixtures can exist."""
    return "asyncio"


@pytest.fixture(scope="module")
async def emulator() -> AsyncIterator[Emulator]:
    """An emulator with no faults, shared by the tests of one module."""
    async with Emulator() as emu:
        yield emu
