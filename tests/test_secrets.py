"""Every secret setting is listed once and redacted by every redactor built from the settings."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import get_args

import pytest
from pydantic import SecretStr

from fleetroll.pool.assembly import rollout_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.service.app import Service
from fleetroll.settings import Settings, load_settings
from fleetroll.telemetry import Events, MemorySink, Redactor, Telemetry
from fleetroll.testing.fake_provider import FakeProvider


def _secret_fields() -> list[str]:
    """Every top-level ``SecretStr`` field of the settings, read from the model, not by hand."""
    return sorted(
        name
        for name, field in Settings.model_fields.items()
        if field.annotation is SecretStr or SecretStr in get_args(field.annotation)
    )


def _settings_with_every_secret() -> tuple[Settings, dict[str, str]]:
    # Values no pattern would catch: only the list of known secrets can hide them.
    values = {name: f"q{n}w7f3a9c0d{n}" for n, name in enumerate(_secret_fields())}
    settings = load_settings(telemetry={"db_path": os.devnull, "send_to_logfire": False}, **values)
    return settings, values


def _telemetry_event(settings: Settings) -> Callable[[str], str]:
    def redact(text: str) -> str:
        sink = MemorySink()
        with Telemetry(
            settings.telemetry,
            secrets=settings.secrets(),
            logfire_token=settings.logfire_token,
            extra_sinks=[sink],
        ) as telemetry:
            telemetry.events.emit("fleet_tool_call_failed", level="debug", error_message=text)
        return str(sink.named("fleet_tool_call_failed")[0].attributes["error_message"])

    return redact


def _service_error(settings: Settings) -> Callable[[str], str]:
    return Service(RolloutPool(settings, api_key="unused"), settings).redact


def _result(settings: Settings) -> Callable[[str], str]:
    return RolloutEngine(
        rollout_config(settings),
        FakeProvider(settings.modalities, timeouts=settings.timeouts),
        Events(),
    ).redactor


def test_the_settings_know_each_of_their_secret_fields() -> None:
    settings, values = _settings_with_every_secret()
    assert "emulator_api_key" in values and "service_token" in values
    assert sorted(settings.secrets()) == sorted(values.values())


@pytest.mark.parametrize("redactor", [_telemetry_event, _service_error, _result])
def test_every_secret_field_is_redacted_by_each_redactor(
    redactor: Callable[[Settings], Callable[[str], str]],
) -> None:
    settings, values = _settings_with_every_secret()
    redact = redactor(settings)
    for name, value in values.items():
        assert Redactor()(value) == value
        assert value not in redact(f"the upstream said: got {value} here"), name
