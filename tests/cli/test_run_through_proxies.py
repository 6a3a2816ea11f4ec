"""`fleetroll run` behind a corporate proxy: a TLS Fleet reached only through the proxy.

A real forward proxy (squid) on loopback is ``HTTPS_PROXY``; Fleet is the
emulator behind a real TLS front end (nginx) with a certificate of a CA made for
the test, which ``fleetroll run`` trusts through ``SSL_CERT_FILE``. The emulator
hands out its instances' URLs on the front end (``public_url``), so MCP goes
there too. Every request the front end answered came from the forward proxy's
address, and every request the emulator recorded was forwarded by the front end
for it: nothing went around the proxy, in the default modes (direct control
client, thin MCP client) and in the SDK modes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.pool.journal import read_journal
from fleetroll.settings import config_dir
from wire_infra import PROXY_SOURCE, forward_proxy, make_ca, tls_front_end

pytestmark = pytest.mark.slow

LEDGER = config_dir() / "tasks" / "ledger.jsonl"
TASKS = 3
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


def run_env(**extra: str) -> dict[str, str]:
    """The test's environment without fleetroll's, Fleet's or any proxy variable, plus ``extra``."""
    dropped = {*PROXY_VARIABLES, *(v.lower() for v in PROXY_VARIABLES)}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_", "SSL_CERT_"))
        and k not in dropped
    }
    env["FLEETROLL_TELEMETRY__DB_PATH"] = os.devnull
    return env | extra


@pytest.mark.parametrize(
    ("control_client", "mcp_client"), [("direct", "thin"), ("sdk", "sdk")], ids=["direct", "sdk"]
)
async def test_a_batch_reaches_a_tls_fleet_only_through_the_https_proxy(
    tmp_path: Path, control_client: str, mcp_client: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(LEDGER.read_text().splitlines()[:TASKS]) + "\n")
    out = tmp_path / "results.jsonl"
    ca = make_ca(tmp_path / "ca")
    async with (
        Emulator(record_requests=10_000) as emu,
        forward_proxy(tmp_path / "squid") as proxy,
        tls_front_end(tmp_path / "nginx", emu.base_url.removeprefix("http://"), ca) as front,
    ):
        emu.public_url = front.url  # instances' MCP URLs are on the front end too
        env = run_env(
            FLEET_BASE_URL=front.url,
            FLEET_API_KEY=emu.api_key,
            HTTPS_PROXY=proxy.url,
            SSL_CERT_FILE=str(ca.ca_file),
            FLEETROLL_PROVISIONING__CONTROL_CLIENT=control_client,
            FLEETROLL_POOL__MCP_CLIENT=mcp_client,
        )
        command = [sys.executable, "-m", "fleetroll", "run", str(tasks), "--out", str(out)]
        with anyio.fail_after(180):
            done = await anyio.run_process(
                command, cwd=tmp_path, env=env, check=False, stdin=subprocess.DEVNULL
            )
        stderr = done.stderr.decode(errors="replace")
        assert done.returncode == 0, stderr
        results = read_journal(out)
        assert len(results) == TASKS and all(r.reward == 1.0 for r in results), stderr

        # The front end: the control plane and MCP, every request from the proxy.
        answered = front.entries
        assert any("/v1/env/instances" in e.request for e in answered)
        assert any("/mcp" in e.request for e in answered)
        around = [e.request for e in answered if e.peer != PROXY_SOURCE]
        assert not around, f"{len(around)} of {len(answered)} went around the proxy: {around[:5]}"
        # The emulator: every request it recorded was the front end's, for the proxy.
        recorded = emu.requests
        assert recorded and {r.headers.get("x-forwarded-for") for r in recorded} == {PROXY_SOURCE}
        # The proxy: tunnels (CONNECT) to the front end and nowhere else; each is
        # logged when it closes, and the run has ended, so every one is closed.
        tunnel = f"127.0.0.1:{front.port}"
        await proxy.log.wait_for(lambda _: any(e.method == "CONNECT" for e in proxy.entries))
        assert {(e.method, e.target) for e in proxy.entries} == {("CONNECT", tunnel)}
