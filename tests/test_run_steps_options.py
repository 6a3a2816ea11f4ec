"""`fleetroll run --steps`: a user's mistakes are one line and exit code 2, before anything runs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fleetroll.cli.main import main
from fleetroll.settings import config_dir

LEDGER = str(config_dir() / "tasks" / "ledger.jsonl")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--steps", "2"], {}, "--steps and --batch-tasks go together"),
        (["--batch-tasks", "2"], {}, "--steps and --batch-tasks go together"),
        (["--steps", "2", "--batch-tasks", "26"], {}, "--batch-tasks 26 is more than the 25"),
        (
            ["--steps", "2", "--batch-tasks", "2"],
            {"FLEETROLL_SAMPLING__WEIGHTS": '{"ledgr": 1}'},
            "sampling.weights names environment 'ledgr', which no task has",
        ),
        (
            ["--steps", "2", "--batch-tasks", "2"],
            {"FLEETROLL_SAMPLING__MINIMUMS": '{"ledger": 3}'},
            "sampling.minimums add up to 3, more than a batch of 2",
        ),
    ],
)
def test_a_run_of_steps_it_cannot_draw_is_refused_in_one_line(
    args: list[str], env: dict[str, str], message: str
) -> None:
    done = CliRunner().invoke(main, ["run", LEDGER, *args], env=env)
    assert done.exit_code == 2, done.output
    assert message in done.output
    assert "Traceback" not in done.output
