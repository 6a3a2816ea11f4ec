"""`fleetroll run --branch-at K --width W`: a tree per task, its results journaled;
options it does not take are one line and exit code 2, before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fleetroll.cli.main import main
from fleetroll.settings import config_dir

LEDGER = config_dir() / "tasks" / "ledger.jsonl"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--width", "2"], "--width is the branches of --branch-at K"),
        (["--branch-at", "1", "--samples", "2"], "does not take --samples"),
        (["--branch-at", "1", "--resume", "--out", "x.jsonl"], "does not take --resume"),
        (["--branch-at", "0"], "0 is not in the range x>=1"),
    ],
)
def test_tree_options_it_cannot_run_are_refused_in_one_line(args: list[str], message: str) -> None:
    done = CliRunner().invoke(main, ["run", str(LEDGER), *args])
    assert done.exit_code == 2, done.output
    assert message in done.output
    assert "Traceback" not in done.output


@pytest.mark.slow
def test_run_branch_at_journals_each_root_then_its_branches(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    line = next(t for t in LEDGER.read_text().splitlines() if '"ledger-010"' in t)
    tasks.write_text(line + "\n")
    out = tmp_path / "tree.jsonl"
    done = CliRunner().invoke(
        main, ["run", str(tasks), "--branch-at", "1", "--width", "3", "--out", str(out)]
    )
    assert done.exit_code == 0, done.output
    root, *branches = [json.loads(line) for line in out.read_text().splitlines()]
    assert root["failure_reason"] == "max_steps" and root["parent_rollout_id"] is None
    assert len(branches) == 3
    for branch in branches:
        assert branch["parent_rollout_id"] == root["rollout_id"] and branch["branch_step"] == 1
        assert branch["status"] == "completed" and branch["reward"] == 1.0
        assert branch["transcript"][: branch["prefix_messages"]] == root["transcript"]
    assert "1 trees (1 reached step 1 and branched), 4 results" in done.output
