"""The service under test: uvicorn on 127.0.0.1:0, one pool, an in-process emulator."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from service_helpers import Running, running_service

from fleetroll.emulator import Emulator


@pytest.fixture(scope="module")
async def served(emulator: Emulator) -> AsyncIterator[Running]:
    """The service with default settings, shared by the tests of one module."""
    async with running_service(emulator) as running:
        yield running
