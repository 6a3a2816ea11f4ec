"""What a ``fleetroll`` process loads before it does anything (start-up cost, issue 14)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetroll._internal.pydantic_plugins import skip_unused_pydantic_plugins

PROBE = """
import json, os, sys
from fleetroll.cli.main import main
try:
    main([*sys.argv[1:]], standalone_mode=False)
except Exception as exc:
    print(type(exc).__name__, file=sys.stderr)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("logfire", "mcp", "fleet", "uvicorn"))
print(json.dumps({"plugins": os.environ.get("PYDANTIC_DISABLE_PLUGINS"), "loaded": loaded}))
"""


def probe(*args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_logfires_pydantic_plugin_stays_unloaded_unless_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYDANTIC_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("LOGFIRE_PYDANTIC_PLUGIN_RECORD", raising=False)
    skip_unused_pydantic_plugins(os.environ)
    assert os.environ["PYDANTIC_DISABLE_PLUGINS"] == "logfire-plugin"

    monkeypatch.delenv("PYDANTIC_DISABLE_PLUGINS")
    monkeypatch.setenv("LOGFIRE_PYDANTIC_PLUGIN_RECORD", "all")  # the user wants it: it loads
    skip_unused_pydantic_plugins(os.environ)
    assert "PYDANTIC_DISABLE_PLUGINS" not in os.environ

    monkeypatch.delenv("LOGFIRE_PYDANTIC_PLUGIN_RECORD")
    monkeypatch.setenv("PYDANTIC_DISABLE_PLUGINS", "__all__")  # the user's own choice stays
    skip_unused_pydantic_plugins(os.environ)
    assert os.environ["PYDANTIC_DISABLE_PLUGINS"] == "__all__"


def test_a_run_on_a_missing_task_file_loads_neither_mcp_the_sdk_nor_logfire(
    tmp_path: Path,
) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYDANTIC_DISABLE_PLUGINS", "LOGFIRE_PYDANTIC_PLUGIN_RECORD")
    }
    found = probe("run", str(tmp_path / "missing.jsonl"), env=env)
    assert found == {"plugins": "logfire-plugin", "loaded": []}


def test_a_run_refused_for_its_journal_or_its_key_loads_neither_mcp_the_sdk_nor_logfire(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "FLEETROLL_"))}
    tasks = Path(__file__).parents[2] / "config" / "tasks" / "ledger.jsonl"
    journal = tmp_path / "results.jsonl"
    journal.write_text('{"not": "ours"}\n')
    for args, extra in (
        (["--out", str(journal)], {}),  # it exists, and no --resume
        (["--out", "/dev/zero", "--resume"], {}),  # not a regular file
        ([], {"FLEET_BASE_URL": "http://127.0.0.1:9"}),  # a Fleet without its key
    ):
        found = probe("run", str(tasks), *args, env=env | extra)
        assert found["loaded"] == [], (args, found)
