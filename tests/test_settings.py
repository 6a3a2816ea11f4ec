"""Settings: shipped defaults, user TOML, environment and explicit values, in that order."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import fleetroll.settings
from fleetroll.cli.main import main
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
    bad.write_text("[timeouts]\ncall_tool_s = -1\n[pool]\nconcurrency = 3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(bad)
    message = str(err.value)
    assert "timeouts.call_tool_s" in message and "greater than 0" in message
    assert "bad.toml" in message


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        (
            "[timeouts]\ncall_tool_s = -1\n[pool]\nconcurrenci = 3\n",
            "unknown key 'pool.concurrenci' (did you mean 'pool.concurrency'?)",
        ),
        ("[pol]\nkind = 'openai'\n", "unknown key 'pol' (did you mean 'pool'?)"),
        (
            "[modalities.tool_use]\nttl = 60\n",
            "unknown key 'modalities.tool_use.ttl' (did you mean 'modalities.tool_use.ttl_s'?)",
        ),
        ("[telemetry]\nzzz = 1\n", "unknown key 'telemetry.zzz'"),
    ],
)
def test_an_unknown_key_in_a_file_is_one_line_with_the_file_the_key_path_and_a_guess(
    tmp_path: Path, toml: str, said: str
) -> None:
    bad = tmp_path / "mine.toml"
    bad.write_text(toml)

    with pytest.raises(ConfigError) as err:
        load_settings(bad)

    assert str(err.value) == f"{bad}: {said}"
    result = CliRunner().invoke(main, ["stats", "--config", str(bad)])
    assert result.exit_code == 2
    assert result.stderr == f"Error: {bad}: {said}\n"


def test_an_unknown_fault_profile_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="known profiles: chaos, clean, create-queue, realistic"):
        load_settings().emulator.fault_profile("nope")


def test_a_variable_holding_malformed_json_is_one_line_naming_it_and_the_json_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETROLL_POOL", '{"concurrency": 2')
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert str(caught.value) == (
        "FLEETROLL_POOL is not valid JSON: Expecting ',' delimiter: line 1 column 18 (char 17)"
    )
    result = CliRunner().invoke(main, ["stats"])
    assert result.exit_code == 2
    assert result.stderr == f"Error: {caught.value}\n"
    monkeypatch.setenv("FLEETROLL_POOL", '{"concurrency": 2}')
    assert load_settings().pool.concurrency == 2


def test_unknown_variables_are_ignored_with_one_warning_each_and_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fleetroll.settings, "_warned", set())  # warned: once per process
    for name in (
        "FLEETROLL_POOL__CONCURENCY",
        "FLEETROLL_TIMEOUT__CALL_TOOL_S",
        "FLEETROLL_MODALITIES__TOOL_USE__TTL_SS",
        "FLEETROLL_NOTHING_LIKE_IT",
    ):
        monkeypatch.setenv(name, "5")
    monkeypatch.setenv("FLEETROLL_POOL__MAX_STEPS", "4")  # known: no warning
    monkeypatch.setenv("FLEETROLL_POLICY__EXTRA_BODY__TOP_K", "3")  # any key of a dict
    monkeypatch.setenv("FLEETROLL_SERVICE_TOKEN", "a-token-of-sixteen-or-more")
    with caplog.at_level(logging.WARNING, logger="fleetroll.settings"):
        settings = load_settings()
        load_settings()
    assert settings.pool.concurrency == 128 and settings.pool.max_steps == 4
    assert settings.policy.extra_body == {"top_k": "3"}
    assert settings.service_token is not None
    assert sorted(r.getMessage() for r in caplog.records) == [
        "FLEETROLL_MODALITIES__TOOL_USE__TTL_SS is not a fleetroll setting and is ignored;"
        " did you mean FLEETROLL_MODALITIES__TOOL_USE__TTL_S?",
        "FLEETROLL_NOTHING_LIKE_IT is not a fleetroll setting and is ignored",
        "FLEETROLL_POOL__CONCURENCY is not a fleetroll setting and is ignored;"
        " did you mean FLEETROLL_POOL__CONCURRENCY?",
        "FLEETROLL_TIMEOUT__CALL_TOOL_S is not a fleetroll setting and is ignored;"
        " did you mean FLEETROLL_TIMEOUTS__CALL_TOOL_S?",
    ]


def test_importing_the_settings_loads_nothing_of_the_emulator() -> None:
    """The emulator sits above the settings: it reads them, they never need it."""
    probe = (
        "import sys, fleetroll.settings;"
        "print(sorted(m for m in sys.modules if m.startswith('fleetroll.emulator')))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert ran.stdout.strip() == "[]"
