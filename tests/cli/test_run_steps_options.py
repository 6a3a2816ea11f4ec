"""`fleetroll run --steps`: a user's mistakes are one line and exit code 2, before anything
runs; a resume finds the sampler it saved, or says why not."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from fleetroll.cli.main import main
from fleetroll.errors import ConfigError
from fleetroll.jobs.steps import open_sampler
from fleetroll.pool.journal import write_sampler_state
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.training.sampler import SamplerConfig, TaskSampler

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


def test_a_resume_restores_the_saved_sampler_or_says_why_it_cannot(tmp_path: Path) -> None:
    tasks = load_tasks(LEDGER, modalities=load_settings().modalities)
    out = tmp_path / "steps.jsonl"
    config = SamplerConfig(batch_tasks=3, seed=1)
    with pytest.raises(ConfigError, match=r"steps.jsonl.sampler.json is missing"):
        open_sampler(tasks, config, out)
    sampler = TaskSampler(tasks, config)
    sampler.draw()
    write_sampler_state(out, sampler.state())
    restored = open_sampler(tasks, config, out)
    assert restored.step == 1 and restored.draw() == sampler.draw()
    with pytest.raises(ConfigError, match=r"cannot resume .*steps.jsonl: .*\(changed: seed\)"):
        open_sampler(tasks, SamplerConfig(batch_tasks=3, seed=2), out)
