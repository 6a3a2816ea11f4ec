"""Standard exports: OTLP/HTTP with only ``OTEL_EXPORTER_OTLP_ENDPOINT`` set (no
Logfire account), and a console of JSON lines (``telemetry.console = "json"``).

The OTLP receiver is a small HTTP server on loopback that decodes what it gets
with the opentelemetry-proto package, as a collector would. ``fleetroll run``
runs as a real process against its embedded emulator.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from telemetry_helpers import local_settings

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import open_telemetry

pytestmark = pytest.mark.slow


class Receiver:
    """What an OTLP/HTTP collector got: span names and log bodies, with their rollout ids."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str | None]] = []
        self.logs: list[tuple[str, str | None]] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()


def _attribute(attributes: object, key: str) -> str | None:
    for kv in attributes:  # type: ignore[attr-defined]
        if kv.key == key:
            return str(kv.value.string_value)
    return None


@pytest.fixture
def receiver() -> Iterator[tuple[str, Receiver]]:
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            answer: bytes
            with got.lock:
                got.paths.append(self.path)
                if self.path == "/v1/traces":
                    traces = ExportTraceServiceRequest.FromString(body)
                    for rs in traces.resource_spans:
                        for ss in rs.scope_spans:
                            for span in ss.spans:
                                rollout = _attribute(span.attributes, "rollout_id")
                                got.spans.append((span.name, rollout))
                    answer = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/logs":
                    logs = ExportLogsServiceRequest.FromString(body)
                    for rl in logs.resource_logs:
                        for sl in rl.scope_logs:
                            for record in sl.log_records:
                                rollout = _attribute(record.attributes, "rollout_id")
                                got.logs.append((record.body.string_value, rollout))
                    answer = ExportLogsServiceResponse().SerializeToString()
                else:
                    answer = b""
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()


async def test_rollout_spans_and_logs_reach_an_otlp_receiver_with_only_its_endpoint_set(
    tmp_path: Path,
    receiver: tuple[str, Receiver],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    url, got = receiver
    for name in list(os.environ):
        if name.startswith(("OTEL_", "LOGFIRE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    settings = local_settings(tmp_path / "telemetry.db")
    ledger = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    async with (
        open_telemetry(settings.telemetry, logfire_token=settings.logfire_token) as events,
        Emulator() as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as pool,
    ):
        with anyio.fail_after(120):
            results = await pool.run_batch(ledger[:2], ScriptedPolicy(), batch_id="otlp").results()
    # Closing telemetry flushed both exporters.
    ids = {r.rollout_id for r in results}
    assert len(ids) == 2
    for kind in (got.spans, got.logs):
        for name in ("fleet_rollout_started", "fleet_tool_call", "fleet_rollout_completed"):
            assert {rollout for n, rollout in kind if n == name} == ids, (name, kind)
    assert {"/v1/traces", "/v1/logs"} <= set(got.paths)
    said = capfd.readouterr()
    assert "Logfire" not in said.err + said.out


async def test_every_stderr_line_of_fleetroll_run_is_json_with_a_json_console(
    tmp_path: Path,
) -> None:
    config = tmp_path / "fleetroll.toml"
    config.write_text(
        '[telemetry]\nconsole = "json"\nconsole_level = "debug"\n'
        f'db_path = "{tmp_path / "telemetry.db"}"\n'
        # Failures too, so that warnings (and their summaries) are lines as well.
        "[emulator.profiles.faulty]\np_tool_error = 0.3\np_verifier_error = 0.3\n"
    )
    tasks = config_dir() / "tasks" / "ledger.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOGFIRE_", "OTEL_"))}
    command = [
        sys.executable, "-m", "fleetroll", "run", str(tasks), "--config", str(config),
        "--profile", "faulty", "--samples", "2", "--out", str(tmp_path / "results.jsonl"),
    ]  # fmt: skip
    with anyio.fail_after(240):
        done = await anyio.run_process(command, cwd=tmp_path, env=env, check=False)
    lines = done.stderr.decode().splitlines()
    assert done.returncode in (0, 1), done.stderr.decode()[-2000:]
    assert len(lines) > 20
    parsed = []
    for line in lines:
        record = json.loads(line)  # every line, or this fails naming it
        assert isinstance(record, dict) and {"timestamp", "level", "event"} <= set(record), line
        parsed.append(record)
    events = {r["event"] for r in parsed}
    assert {"fleet_batch_started", "fleet_rollout_completed", "fleet_batch_completed"} <= events
    assert any(str(r["event"]).startswith("batch ") for r in parsed)  # the closing summary
