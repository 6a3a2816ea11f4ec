"""`fleetroll stats --check` on a real `fleetroll run`: while it runs, `--live` passes
(its rollouts are running); once it is killed with -9, its rollouts are lost,
grouped by batch with the command that resumes them, and that command runs them.

Real processes, on an in-process emulator (a real HTTP server on loopback)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner
from test_cli import clean_env, ledger_part, run_args, started

from fleetroll.cli.main import main
from fleetroll.emulator import Emulator
from fleetroll.pool.journal import read_journal
from ledger_watch import Changes

pytestmark = pytest.mark.slow

TASKS, SAMPLES = 2, 2
ROLLOUTS = TASKS * SAMPLES
#: Slow enough turns that every rollout is still acting when the run is killed.
CONFIG = f"[policy]\nthink_time_s = 1.0\n[pool]\nconcurrency = {ROLLOUTS}\n"


def check(db: Path, *args: str) -> tuple[int, str]:
    done = CliRunner().invoke(main, ["stats", "--check", "--db", str(db), *args])
    return done.exit_code, done.output


async def test_a_live_run_passes_check_live_and_a_killed_one_says_how_to_resume(
    tmp_path: Path,
) -> None:
    out, db, config = tmp_path / "results.jsonl", tmp_path / "telemetry.db", tmp_path / "c.toml"
    config.write_text(CONFIG)
    tasks = ledger_part(tmp_path, TASKS)
    args = run_args(
        tasks.relative_to(tmp_path),
        out.relative_to(tmp_path),
        "--config",
        "c.toml",
        samples=SAMPLES,
    )
    async with Emulator() as emu:
        changes = Changes(emu.ledger)
        env = clean_env() | {
            "FLEET_BASE_URL": emu.base_url,
            "FLEET_API_KEY": emu.api_key,
            "FLEETROLL_TELEMETRY__DB_PATH": str(db),
        }
        async with started(tmp_path, args, env) as (child, _):

            async def all_acting() -> bool:
                return emu.ledger.running == ROLLOUTS

            with anyio.fail_after(60):
                await changes.until(all_acting)
                # Its store is another process's: read it until the starts are flushed.
                while (live := check(db, "--live"))[1].count("running") == 0:
                    await anyio.sleep(0.1)
            # Alive, its rollouts are running: a health probe passes; the plain check does not.
            code, said = live
            assert code == 0, said
            assert said.startswith(f"ok: {ROLLOUTS} rollouts") and f"{ROLLOUTS} running" in said
            assert check(db)[0] == 1
            # Running for longer than the bound allows is an offence, even alive.
            code, said = check(db, "--live", "--max-age", "0.001")
            assert code == 1 and "started over 0.001 s ago" in said, said
            child.kill()  # SIGKILL, to this child only
            with anyio.fail_after(30):
                await child.wait()

        code, said = check(db)
        assert code == 0, said
        lines = said.splitlines()
        [group] = [line for line in lines if "lost in batch" in line]
        assert group.startswith(f"  {ROLLOUTS} lost in batch "), said
        [resume] = [line.strip().removeprefix("resume: ") for line in lines if "resume:" in line]
        command = shlex.split(resume)
        assert command[:2] == ["fleetroll", "run"] and command[-1] == "--resume", resume
        # Paths absolute: it runs from anywhere.
        assert str(tasks) in command and str(out) in command and str(config) in command
        answer = json.loads(check(db, "--json")[1])
        [batch] = answer["lost_batches"]
        assert batch["rollouts"] == ROLLOUTS and batch["resume"] == resume

        # The command it gives runs the lost rollouts: then none is lost, each re-run once.
        with anyio.fail_after(120):
            done = await anyio.run_process(
                [sys.executable, "-m", "fleetroll", *command[1:]], cwd="/", env=env, check=False
            )
        assert done.returncode == 0, done.stderr.decode()
    assert len(read_journal(out)) == ROLLOUTS
    answer = json.loads(check(db, "--json")[1])
    assert answer["ok"] and answer["lost"] == [] and answer["rerun"] == ROLLOUTS, answer
