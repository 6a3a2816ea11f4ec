"""A real MCP client against both endpoints of an instance."""

from __future__ import annotations

import base64
import io

import pytest
from mcp import Client
from PIL import Image

from fleetroll.emulator import Emulator

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


async def test_the_per_env_endpoint_serves_api_tools_and_never_computer(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", data_key="seed")
        async with Client(env.mcp.url) as session:
            names = {t.name for t in (await session.list_tools()).tools}
            assert "computer" not in names and len(names) >= 6
            result = await session.call_tool("get_balance", {"account": "Checking"})
            assert not result.is_error and result.structured_content is not None
        await env.close()


async def test_the_aggregator_serves_api_tools_plus_computer_with_real_pngs(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", image_type="mcp")
        async with Client(f"{env.urls.root}api/v1/mcp") as session:
            names = {t.name for t in (await session.list_tools()).tools}
            assert "computer" in names and "get_balance" in names
            shot = await session.call_tool("computer", {"action": "screenshot"})
        await env.close()
    assert not shot.is_error
    image = next(c for c in shot.content if c.type == "image")
    assert image.mime_type == "image/png"
    png = Image.open(io.BytesIO(base64.b64decode(image.data)))
    assert png.format == "PNG" and png.size == (1024, 768)


async def test_bad_arguments_answer_tool_errors_that_say_what_is_wrong(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", data_key="seed")
        async with Client(env.mcp.url) as session:
            unknown = await session.call_tool("get_balance", {"account": "Nope"})
            negative = await session.call_tool(
                "record_transaction",
                {
                    "from_account": "Checking",
                    "to_account": "Rent",
                    "amount": -5,
                    "description": "x",
                },
            )
            bad_date = await session.call_tool(
                "create_invoice", {"customer": "A", "amount": 10, "due_date": "tomorrow"}
            )
        async with Client(f"{env.urls.root}api/v1/mcp") as session:
            off_screen = await session.call_tool("computer", {"action": "click", "x": 5000, "y": 1})
        await env.close()
    assert unknown.is_error and "unknown account 'Nope'" in unknown.content[0].text
    assert negative.is_error and "positive" in negative.content[0].text
    assert bad_date.is_error and "YYYY-MM-DD" in bad_date.content[0].text
    assert off_screen.is_error and "off the screen" in off_screen.content[0].text


async def test_tool_calls_change_the_instance_state_and_reset_restores_it(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", data_key="seed")
        async with Client(env.mcp.url) as session:
            await session.call_tool(
                "record_transaction",
                {
                    "from_account": "Checking",
                    "to_account": "Rent",
                    "amount": 100,
                    "description": "rent",
                },
            )
            after = await session.call_tool("get_balance", {"account": "Rent"})
            assert after.structured_content["balance"] == 100.0
            await env.reset()
            reset = await session.call_tool("get_balance", {"account": "Rent"})
            assert reset.structured_content["balance"] == 0.0
        await env.close()


async def test_instances_do_not_share_state(sdk) -> None:
    async with Emulator() as emu:
        fleet = sdk(emu)
        a, b = await fleet.make("ledger"), await fleet.make("ledger")
        async with Client(a.mcp.url) as session:
            await session.call_tool("add_account", {"name": "Only In A", "kind": "asset"})
        async with Client(b.mcp.url) as session:
            missing = await session.call_tool("get_balance", {"account": "Only In A"})
        assert missing.is_error
        await a.close()
        await b.close()


def test_the_emulators_mcp_servers_run_without_the_sdks_tracing_middleware(tmp_path) -> None:
    # No tracer is configured in the emulator: the SDK's middleware only cost CPU.
    from mcp.server._otel import OpenTelemetryMiddleware

    from fleetroll.emulator.envs import default_envs
    from fleetroll.emulator.faults import FaultInjector
    from fleetroll.emulator.instances import InstanceStore
    from fleetroll.emulator.ledger import Ledger
    from fleetroll.emulator.mcp_routing import McpRouter
    from fleetroll.settings.fault_profiles import FaultProfile

    ledger = Ledger()
    store = InstanceStore(tmp_path, ledger)
    router = McpRouter(default_envs(), store, FaultInjector(FaultProfile()), ledger)
    middleware = [m for server in router._servers for m in server.middleware]
    assert middleware  # the SDK's own RequestStateBoundary stays
    assert not [m for m in middleware if isinstance(m, OpenTelemetryMiddleware)]
