"""Every command runs on uvloop where it is installed, on asyncio when asked."""

from __future__ import annotations

import asyncio

import pytest

from fleetroll._eventloop import loop_name, run


async def _running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_commands_run_on_uvloop_when_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv("FLEETROLL_EVENT_LOOP", raising=False)
    assert loop_name() == "uvloop"
    assert run(_running_loop_module).startswith("uvloop")


def test_the_plain_asyncio_loop_can_be_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETROLL_EVENT_LOOP", "asyncio")
    assert loop_name() == "asyncio"
    assert run(_running_loop_module).startswith("asyncio")
