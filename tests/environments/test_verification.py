"""Verification: rewards from each task's own verifier, bad verifiers as verifier_error.

Integration tests run rollouts on the emulator (real SDK, real verifier
execution); the unit tests check the parser's guard directly.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.environments.fleet import verification
from fleetroll.environments.fleet.verification import verifier_signature
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASK = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)[0]
#: ~10 KB of nested unary minus: ast.parse raises MemoryError on it.
DEEP = "def verify(env):\n return " + "-" * 10000 + "1"


def scoring(score: float, task: TaskSpec = TASK) -> TaskSpec:
    """``task`` (same key) with a verifier that always returns ``score``."""
    code = f"def verify(env, final_answer=None):\n    return {score}\n"
    return task.model_copy(update={"verifier_func": code})


async def run_batches(
    emu: Emulator, *batches: Sequence[TaskSpec], samples: int = 1, **overrides: Any
) -> list[list[RolloutResult]]:
    """Run ``batches`` one after the other in one pool; their results, in order."""
    settings = load_settings(**overrides)
    out: list[list[RolloutResult]] = []
    async with RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool:
        for tasks in batches:
            with anyio.fail_after(60):
                batch = pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=samples)
                out.append([r async for r in batch])
    assert emu.ledger.running == 0
    return out


async def test_batches_reusing_a_task_key_are_each_scored_by_their_own_verifier(
    emulator: Emulator,
) -> None:
    quarter, whole, again = await run_batches(
        emulator, [scoring(0.25)], [scoring(1.0)], [scoring(0.25)]
    )
    assert [r.reward for r in quarter] == [0.25]
    assert [r.reward for r in whole] == [1.0]
    assert [r.reward for r in again] == [0.25]


async def test_a_verifier_nested_too_deeply_to_parse_is_verifier_error_not_a_crash(
    emulator: Emulator,
) -> None:
    [[result]] = await run_batches(emulator, [TASK.model_copy(update={"verifier_func": DEEP})])
    assert result.failure_reason is FailureReason.VERIFIER_ERROR and result.reward is None
    assert "nested too deeply for Python's parser" in (result.error or "")
    assert "unexpected error" not in (result.error or "")


async def test_a_verifier_over_the_size_limit_is_verifier_error_naming_the_setting(
    emulator: Emulator,
) -> None:
    code = "def verify(env, final_answer=None):\n    return 1.0\n" + "# padding\n" * 200
    task = TASK.model_copy(update={"verifier_func": code})
    [[result]] = await run_batches(emulator, [task], pool={"max_verifier_bytes": 1000})
    assert result.failure_reason is FailureReason.VERIFIER_ERROR and result.reward is None
    assert "over the limit of 1,000 (pool.max_verifier_bytes)" in (result.error or "")


async def test_a_verifier_is_parsed_once_per_content_and_off_the_event_loop(
    emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed_on: list[int] = []
    real = verification.verifier_signature

    def spy(code: str) -> tuple[str, bool]:
        parsed_on.append(threading.get_ident())
        return real(code)

    monkeypatch.setattr(verification, "verifier_signature", spy)
    [results] = await run_batches(emulator, [scoring(0.5)], samples=4)
    assert [r.reward for r in results] == [0.5] * 4
    assert len(parsed_on) == 1 and parsed_on[0] != threading.get_ident()


def test_the_parsers_own_limits_become_a_value_error_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        verifier_signature(DEEP)
    with pytest.raises(ValueError, match=r"not valid Python: .* at line 1"):
        verifier_signature("def verify(env:\n")
    with pytest.raises(ValueError, match="defines no function"):
        verifier_signature("x = 1\n")
    assert verifier_signature("def check(env, final_answer=None):\n    return 1\n") == (
        "check",
        True,
    )


def test_the_signature_is_read_without_building_ast_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPython 3.11 (gh-106905): two threads building AST objects at once can fail with
    SystemError. Seen in Ray runs as a verifier_error and an init_error (a traceback
    formatted on the event loop met a verifier parsed on a worker thread)."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise SystemError("AST constructor recursion depth mismatch (before=21, after=53)")

    monkeypatch.setattr(ast, "parse", broken)
    assert verifier_signature("def check(env):\n    return 1\n") == ("check", False)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (
            "x = lambda env: 0\nclass K:\n    def m(self): ...\ndef v(env):\n    return 1\n",
            ("v", False),
        ),
        ("if True:\n    def hidden(env, final_answer): ...\ndef v(env): ...\n", ("v", False)),
        (
            "import functools\n@functools.cache\ndef v(env, *, final_answer=None): ...\n",
            ("v", True),
        ),
        ("async def v(env, **extra):\n    return 1\n", ("v", True)),
        ("def v(env, final_answer, /): ...\n", ("v", False)),  # not by keyword
        ("def v(env, final_answer=None):\n    def inner(): ...\n    return 1\n", ("v", True)),
    ],
)
def test_the_first_top_level_function_is_the_verifier(
    code: str, expected: tuple[str, bool]
) -> None:
    assert verifier_signature(code) == expected
