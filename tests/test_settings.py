"""Settings: shipped defaults, user TOML, environment and explicit values, in that order."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetroll.errors import ConfigError
from fleetroll.settings import load_settings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("FLEETROLL_") or name in (
            "FLEET_API_KEY",
            "FLEET_BASE_URL",
            "LOGFIRE_TOKEN",
        ):
            monkeypatch.delenv(name)


def test_shipped_defaults_load_with_the_modality_table() -> None:
    settings = load_settings()
    assert settings.timeouts.call_tool_s == 60.0 and settings.timeouts.reset_s == 10.0
    assert settings.modalities["tool_use"].endpoint == "{root}mcp"
    computer = settings.modalities["computer_use"]
    assert computer.endpoint == "{root}api/v1/mcp" and computer.image_type == "mcp"
    assert computer.ttl_s == 1800 and computer.tools == "computer"
    assert settings.uses_emulator


def test_a_user_file_is_deep_merged_over_the_defaults(tmp_path: Path) -> None:
    user = tmp_path / "mine.toml"
    user.write_text("[timeouts]\ncall_tool_s = 5\n[modalities.tool_use]\nttl_s = 60\n")
    settings = load_settings(user)
    assert settings.timeouts.call_tool_s == 5.0
    assert settings.timeouts.reset_s == 10.0  # the rest of the table survives
    assert settings.modalities["tool_use"].ttl_s == 60
    assert settings.modalities["tool_use"].endpoint == "{root}mcp"


def test_environment_wins_over_files_and_explicit_values_win_over_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = tmp_path / "mine.toml"
    user.write_text("[pool]\nconcurrency = 7\nmax_steps = 3\n")
    monkeypatch.setenv("FLEETROLL_POOL__CONCURRENCY", "9")
    assert load_settings(user).pool.concurrency == 9
    assert load_settings(user).pool.max_steps == 3
    assert load_settings(user, pool={"concurrency": 11}).pool.concurrency == 11


def test_fleet_credentials_come_from_their_usual_variables_and_stay_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_API_KEY", "sk-very-secret-value")
    monkeypatch.setenv("FLEET_BASE_URL", "http://127.0.0.1:9")
    settings = load_settings()
    assert settings.fleet_api_key is not None
    assert settings.fleet_api_key.get_secret_value() == "sk-very-secret-value"
    assert not settings.uses_emulator
    assert "sk-very-secret-value" not in repr(settings)
    assert "sk-very-secret-value" not in settings.model_dump_json()


def test_a_missing_config_file_is_an_error_not_silently_skipped(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(tmp_path / "nope.toml")


def test_a_broken_toml_file_is_reported_with_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[timeouts\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not a valid TOML file"):
        load_settings(bad)


def test_an_invalid_value_names_the_field_and_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[timeouts]\ncall_tool_s = -1\n[pool]\nconcurrenci = 3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(bad)
    message = str(err.value)
    assert "timeouts.call_tool_s" in message and "greater than 0" in message
    assert "pool.concurrenci" in message and "bad.toml" in message


def test_an_unknown_fault_profile_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="known profiles: chaos, clean, realistic"):
        load_settings().emulator.fault_profile("nope")
