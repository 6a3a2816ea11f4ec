"""`fleetroll eval` as a user runs it: a real process on the embedded emulator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import LEDGER, fleetroll

from fleetroll.pool.journal import read_journal

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


def task_file(path: Path, solved: set[int] | None = None) -> tuple[Path, set[str]]:
    """The shipped ledger tasks; those not in ``solved`` (indices) lose their solution.

    The scripted policy plays a task's solution, so it solves exactly the
    tasks that keep one; with ``solution: []`` it answers at once, and the
    verifier gives the undone task 0.0.
    """
    lines = [json.loads(line) for line in LEDGER.read_text().splitlines() if line.strip()]
    keys = set()
    for i, task in enumerate(lines):
        if solved is None or i in solved:
            keys.add(task["key"])
        else:
            task["solution"] = []
    path.write_text("".join(json.dumps(t) + "\n" for t in lines))
    return path, keys


def eval_json(*args: str, tmp_path: Path) -> dict[str, Any]:
    done = fleetroll("eval", *args, "--json", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    record: dict[str, Any] = json.loads(done.stdout)
    return record


def test_eval_of_a_policy_solving_a_known_subset_prints_exactly_that_subset(
    tmp_path: Path,
) -> None:
    tasks, solved = task_file(tmp_path / "tasks.jsonl", solved={0, 3, 4, 9, 17})
    out = tmp_path / "results.jsonl"

    record = eval_json(
        str(tasks), "--k", "3", "--out", str(out), "--policy-version", "5", tmp_path=tmp_path
    )

    assert {key for key, t in record["tasks"].items() if t["successes"]} == solved
    for key, t in record["tasks"].items():
        expected = 1.0 if key in solved else 0.0
        assert [t["pass@1"], t["pass@2"], t["pass@3"]] == [expected] * 3
        assert (t["task_key"], t["samples"], t["scored"], t["unscored"]) == (key, 3, 3, 0)
    assert record["overall"]["pass@1"] == pytest.approx(len(solved) / len(record["tasks"]))
    assert record["k"] == 3 and record["policy_version"] == 5
    results = read_journal(out)
    assert len(results) == 3 * len(record["tasks"])  # K samples each, none extra
    assert {r.policy_version for r in results} == {5}

    # The Markdown table says the same, task by task.
    done = fleetroll("eval", str(tasks), "--k", "1", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ledger-")]
    assert {row.split(" | ")[0].removeprefix("| ") for row in rows if "| 1/1 |" in row} == solved
    assert len(rows) == len(record["tasks"])


@pytest.mark.timeout(300)
def test_compare_flags_a_large_real_difference_and_not_a_rerun_of_the_same_policy(
    tmp_path: Path,
) -> None:
    all_solved, _ = task_file(tmp_path / "all.jsonl")
    half, _ = task_file(tmp_path / "half.jsonl", solved=set(range(0, 25, 2)))
    runs = {}
    for name, tasks in (("a", all_solved), ("a_again", all_solved), ("b", half)):
        runs[name] = tmp_path / f"{name}.jsonl"
        done = fleetroll(
            "eval", str(tasks), "--k", "2", "--out", str(runs[name]), tmp_path=tmp_path
        )
        assert done.returncode == 0, done.stderr

    worse = eval_json("--compare", str(runs["a"]), str(runs["b"]), tmp_path=tmp_path)
    same = eval_json("--compare", str(runs["a"]), str(runs["a_again"]), tmp_path=tmp_path)

    assert worse["overall"]["difference"] == pytest.approx(-12 / 25)
    assert worse["overall"]["significant"] and worse["overall"]["p_value"] < 0.05
    assert same["overall"]["difference"] == 0.0 and not same["overall"]["significant"]
    assert not any(t["significant"] for t in same["tasks"].values())
    done = fleetroll("eval", "--compare", str(runs["a"]), str(runs["b"]), tmp_path=tmp_path)
    assert done.returncode == 0 and "| **overall** |" in done.stdout and "**yes**" in done.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "give TASKS to evaluate"),
        (("--compare", "missing-a.jsonl", "missing-b.jsonl"), "no such results file"),
        (("tasks.jsonl", "--compare", "a.jsonl", "b.jsonl"), "--compare reads two results files"),
        (("--compare", "not-results.jsonl", "not-results.jsonl"), "not a rollout result"),
        (("--compare", "empty.jsonl", "empty.jsonl"), "no results in it"),
        (("--compare", "one.jsonl", "one.jsonl", "--k", "2"), "no task in one.jsonl has more"),
        (("--compare", "two.jsonl", "two.jsonl", "--k", "2"), "no task has pass@2 in both"),
        (("missing-tasks.jsonl", "--k", "2"), "missing-tasks.jsonl"),
        (("tasks.jsonl", "--profile", "no-such-profile"), "no-such-profile"),
    ],
)
def test_eval_errors_are_one_line_and_exit_code_2(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    task_file(tmp_path / "tasks.jsonl")
    (tmp_path / "not-results.jsonl").write_text('{"hello": 1}\n')
    (tmp_path / "empty.jsonl").write_text("")
    one = {
        "rollout_id": "r",
        "batch_id": "b",
        "task_key": "t",
        "env_key": "ledger",
        "modality": "tool_use",
        "status": "completed",
        "reward": 1.0,
    }
    (tmp_path / "one.jsonl").write_text(json.dumps(one) + "\n")
    # Two samples of one task, one of them unscored: no pass@2 to compare.
    lost = {**one, "rollout_id": "r2", "status": "failed", "reward": None}
    lost["failure_reason"] = "init_error"
    (tmp_path / "two.jsonl").write_text(json.dumps(one) + "\n" + json.dumps(lost) + "\n")

    done = fleetroll("eval", *args, tmp_path=tmp_path)

    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.strip()]) == 1


def test_rescore_of_a_results_file_with_a_line_that_is_not_a_result_writes_nothing(
    tmp_path: Path,
) -> None:
    """A journal resumes past a corrupt line (its rollout runs again), but rescore
    read as leniently would write --out without that line: a result lost unseen.
    It is one error line naming the file and line, and no --out."""
    tasks, _ = task_file(tmp_path / "tasks.jsonl")
    one = {
        "rollout_id": "r",
        "batch_id": "b",
        "task_key": "ledger-001",
        "env_key": "ledger",
        "modality": "tool_use",
        "status": "completed",
        "reward": 1.0,
    }
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(one) + "\n" + '{"rollout_id": "r2", "cut short\n')
    out = tmp_path / "rescored.jsonl"

    done = fleetroll(
        "rescore", str(results), "--tasks", str(tasks), "--out", str(out), tmp_path=tmp_path
    )

    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{results}:2: not a rollout result" in lines[0], lines
    assert not out.exists()
