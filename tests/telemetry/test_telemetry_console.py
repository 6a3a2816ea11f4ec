"""The console: failed rollouts summed up on a terminal, short elsewhere; library logs at debug."""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterator

import pytest

from fleetroll.telemetry import console
from fleetroll.telemetry.console import configure_console_logging
from fleetroll.telemetry.events import Event
from fleetroll.telemetry.sinks import LINE_CHARS, ConsoleSink

LONG_ERROR = "ToolsError: MCP session set-up failed: " + "the server went away; " * 20  # ~480


def failed(n: int, reason: str = "tools_error", error: str = LONG_ERROR) -> Event:
    return Event(
        "fleet_rollout_completed",
        "warn",
        {
            "batch_id": "b",
            "rollout_id": f"b:ledger-{n}:0",
            "task_key": f"ledger-{n}",
            "sample_index": 0,
            "env_key": "ledger",
            "status": "failed",
            "failure_reason": reason,
            "error_message": error,
        },
    )


def lines(out: io.StringIO) -> list[str]:
    """The console lines without their ``HH:MM:SS [level    ]`` prefix."""
    return [re.sub(r"^\d\d:\d\d:\d\d \[\w+ *\] ", "", line) for line in out.getvalue().splitlines()]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_on_a_terminal_failures_are_one_short_line_per_reason_with_a_count() -> None:
    out, clock = io.StringIO(), Clock()
    sink = ConsoleSink(file=out, summarize=True, repeat_s=10.0, clock=clock)
    for n in range(12):  # one every 2 s: shown at 0 s, then again once 10 s have passed
        sink.emit(failed(n))
        clock.now += 2.0
    sink.emit(failed(99, "init_error", "provisioning failed after 5 attempts"))
    sink.emit(failed(100, "tools_error"))  # inside the quiet period: counted, not shown
    assert lines(out) == [
        f"1× tools_error: {LONG_ERROR[:99]}…",
        f"6× tools_error: {LONG_ERROR[:99]}…",
        f"11× tools_error: {LONG_ERROR[:99]}…",
        "1× init_error: provisioning failed after 5 attempts",
    ]
    sink.emit(Event("fleet_batch_completed", "info", {"batch_id": "b", "rollouts": 14}))
    assert lines(out)[4:] == [
        f"13× tools_error: {LONG_ERROR[:99]}…",  # the counts not shown yet, then the batch
        "fleet_batch_completed        batch_id=b rollouts=14",
    ]
    assert all(len(line) < 140 for line in out.getvalue().splitlines())


def test_off_a_terminal_each_failure_is_one_line_cut_to_160_characters() -> None:
    out = io.StringIO()
    sink = ConsoleSink(file=out)  # a StringIO is not a terminal
    assert not sink.summarize
    sink.emit(failed(1))
    sink.emit(failed(2, "init_error", "provisioning failed after 5 attempts"))
    first, second = out.getvalue().splitlines()
    assert len(first) == LINE_CHARS and first.endswith("…")
    assert "failure_reason=tools_error task_key=ledger-1 sample_index=0" in first
    assert "error_message='ToolsError: MCP session set-up failed" in first
    assert "fleet_rollout_completed failure_reason=init_error task_key=ledger-2" in second
    assert "error_message='provisioning failed after 5 attempts'" in second
    assert len(second) <= LINE_CHARS


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The root and fleetroll loggers as they were, after the test."""
    root, ours = logging.getLogger(), logging.getLogger("fleetroll")
    handlers, levels = list(root.handlers), (root.level, ours.level)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(levels[0])
        ours.setLevel(levels[1])


def sse_error() -> None:
    """What the mcp client logs when a stream is cut under faults."""
    try:
        raise RuntimeError("ClosedResourceError")
    except RuntimeError:
        logging.getLogger("mcp.client.streamable_http").exception("Error parsing SSE message")


def test_library_records_show_only_at_debug_and_ours_in_one_line_on_the_current_stderr(
    root_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure_console_logging("info")
    live = io.StringIO()  # a live display swaps sys.stderr after logging is set up
    monkeypatch.setattr(sys, "stderr", live)
    sse_error()
    logging.getLogger("httpx").info("HTTP Request: POST http://127.0.0.1/v1/env")
    logging.getLogger("fleetroll.settings").warning("FLEETROLL_X is not a fleetroll setting")
    logging.getLogger("fleetroll.telemetry.retries").debug("retry 1")
    try:
        raise OSError("disk full")
    except OSError:
        logging.getLogger("fleetroll.telemetry.store").exception("records lost")
    assert live.getvalue().splitlines() == [
        "warning: FLEETROLL_X is not a fleetroll setting",
        "error: records lost: OSError: disk full",
    ]
    configure_console_logging("debug")
    live.truncate(0)
    live.seek(0)
    sse_error()
    text = live.getvalue()
    assert text.startswith("error mcp.client.streamable_http: Error parsing SSE message\n")
    assert "Traceback" in text and "RuntimeError: ClosedResourceError" in text
    ours = [h for h in logging.getLogger().handlers if type(h).__module__ == console.__name__]
    assert len(ours) == 1  # configuring again replaced the handler
