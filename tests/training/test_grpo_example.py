"""examples/grpo_loop.py runs as documented: groups, advantages, token data, versions."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_loop.py"
#: The README runs the example with these arguments and shows what it prints.
README_ARGS = ["--steps", "2", "--tasks", "2", "--samples", "3", "--oversample", "1"]


def readme_output() -> list[str]:
    """The lines of the ``text`` block that follows the README's command."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    command = "python examples/grpo_loop.py " + " ".join(README_ARGS) + "\n```\n\n```text\n"
    assert command in text, "the README no longer runs the example with README_ARGS"
    return text.split(command, 1)[1].split("```", 1)[0].splitlines()


def load_example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "grpo_loop", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_the_grpo_example_trains_on_groups_with_token_data_and_bumps_the_version(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_example(monkeypatch)
    steps = example.main(README_ARGS)
    printed = capsys.readouterr().out.splitlines()

    assert [s.step for s in steps] == [s.policy_version for s in steps] == [0, 1]
    first = steps[0]
    # Of the 3 attempts at each task that answer, 1 solves it: every group has
    # both rewards, so none is skipped. The 4th is refused (no reward) and the
    # extra stands in for it or is it; or, when the three below it scored before
    # it started (creates are paced), the extra is not needed and ends superseded:
    # at most one per group, and never one of the samples trained on.
    assert first.groups == 2 and first.uniform == 0 and first.samples == 2 * 3
    for s in steps:
        assert s.groups == 2 and s.superseded <= s.groups
        # Every turn trained on was produced by the weights of its step.
        assert s.turn_versions <= {s.step}
        assert s.samples == 0 or (len(s.data) >= s.samples and s.completion_tokens > 0)
        # Each turn carries the server's token ids and one logprob per completion token.
        assert all(
            t.prompt_token_ids and len(t.logprobs) == len(t.completion_token_ids) for t in s.data
        )
        for advantages in s.advantages:
            assert math.isclose(sum(advantages), 0.0, abs_tol=1e-6)
            assert max(advantages) > 0 > min(advantages)
    assert [line.split("  ")[:2] for line in printed] == [
        ["step 0", "version 0"],
        ["step 1", "version 1"],
    ]


@pytest.mark.timeout(240)
def test_the_grpo_example_prints_exactly_what_the_readme_shows(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_example(monkeypatch)
    example.main(README_ARGS)

    assert capsys.readouterr().out.splitlines() == readme_output()
