from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from fleet._async.client import AsyncFleet

from fleetroll.emulator import Emulator


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[[Emulator], AsyncFleet]]:
    """Makes the real SDK client for an emulator, with the SDK's own retries off.

    The SDK never closes its HTTP client, so each one gets ours, closed here.
    """
    clients: list[httpx.AsyncClient] = []

    def make(emu: Emulator) -> AsyncFleet:
        client = httpx.AsyncClient(timeout=60)
        clients.append(client)
        return AsyncFleet(
            api_key=emu.api_key, base_url=emu.base_url, max_retries=0, httpx_client=client
        )

    yield make
    for client in clients:
        await client.aclose()
