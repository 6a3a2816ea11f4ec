"""Unit tests of the mcp provider's guards: what it deletes, how it reads a reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetroll.mcp_process import reward_number
from fleetroll.mcp_provider import WORKDIR_PREFIX, McpProvider
from fleetroll.settings import load_settings
from fleetroll.telemetry import Events


@pytest.mark.parametrize("name", ["precious", f"{WORKDIR_PREFIX}elsewhere"])
def test_release_refuses_to_delete_a_folder_it_did_not_make(tmp_path: Path, name: str) -> None:
    root = tmp_path / "workdirs"
    root.mkdir()
    outside = (tmp_path if name.startswith(WORKDIR_PREFIX) else root) / name
    (outside / "work").mkdir(parents=True)
    provider = McpProvider(load_settings(mcp={"workdir_root": str(root)}), Events())

    with pytest.raises(OSError, match="not a folder fleetroll made"):
        provider._remove(outside)

    assert (outside / "work").is_dir()


@pytest.mark.parametrize(
    ("line", "reward"),
    [("1", 1.0), (" 0.25 \n", 0.25), ("-1e0", -1.0), ("nan", None), ("inf", None), ("ok", None)],
)
def test_a_reward_line_is_a_finite_number_or_nothing(line: str, reward: float | None) -> None:
    assert reward_number(line) == reward
