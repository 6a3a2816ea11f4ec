"""Rewards from the task's verifier, through the SDK's remote verify API.

The verifier's code is sent to Fleet (or the emulator) exactly as the SDK
sends it (``AsyncVerifierFunction.remote_with_response``: bundle check,
upload, execute), and it runs there. It never runs in this process: the
function's name is read with ``ast``, not by executing the code (the SDK's
``Task.verify_detailed_async`` would ``exec`` it here to find that name).

A verifier that cannot run gives ``reward=None`` and an error, never 0.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any

import anyio
import stamina
from fleet._async import exceptions as fleet_errors
from fleet._async.verifiers.verifier import AsyncVerifierFunction

from fleetroll.results import VerifierOutcome
from fleetroll.tasks import TaskSpec

__all__ = ["Verdict", "Verifier", "verifier_signature"]

_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Verdict:
    """A reward, or why there is none."""

    reward: float | None
    outcome: VerifierOutcome
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.reward is not None


def verifier_signature(code: str) -> tuple[str, bool]:
    """The verifier function's name, and whether it takes ``final_answer``.

    The first top-level function is the verifier (as Fleet's runner takes it).

    Raises:
        ValueError: the code does not parse, or defines no function.
    """
    tree = ast.parse(code)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            names = {a.arg for a in args.args + args.kwonlyargs}
            return node.name, "final_answer" in names or args.kwarg is not None
    raise ValueError("the verifier code defines no function")


def _reward(result: Any) -> float | None:
    """A finite float from what a verifier returned, or None."""
    if isinstance(result, dict):
        result = result.get("score")
    if isinstance(result, bool):
        return float(result)
    if isinstance(result, int | float) and math.isfinite(result):
        return float(result)
    return None


def _transient(exc: BaseException) -> bool:
    if isinstance(
        exc, TimeoutError | fleet_errors.FleetTimeoutError | fleet_errors.FleetRateLimitError
    ):
        return True
    if isinstance(exc, fleet_errors.FleetAPIError):
        status = exc.status_code
        return status is None or status >= 500
    return False


class Verifier:
    """Scores rollouts; one bundle per task, built once."""

    def __init__(self, *, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._functions: dict[str, tuple[AsyncVerifierFunction, bool]] = {}

    def _function(self, task: TaskSpec) -> tuple[AsyncVerifierFunction, bool]:
        cached = self._functions.get(task.key)
        if cached is None:
            assert task.verifier_func is not None
            name, takes_answer = verifier_signature(task.verifier_func)

            def remote_only(env: Any, *args: Any, **kwargs: Any) -> float:
                raise RuntimeError("this verifier runs remotely only")

            remote_only.__name__ = remote_only.__qualname__ = name
            function = AsyncVerifierFunction(
                remote_only, task.key, verifier_id=task.key, raw_code=task.verifier_func
            )
            cached = self._functions[task.key] = (function, takes_answer)
        return cached

    async def verify(self, task: TaskSpec, env: Any, final_answer: str | None) -> Verdict:
        """Run the task's verifier against the instance behind ``env``.

        Transient platform failures are retried (3 attempts) inside the
        verifier deadline. Never raises for verifier problems: they come back
        as a Verdict without a reward.
        """
        if not task.verifier_func:
            return Verdict(
                None, VerifierOutcome(success=False, error="the task has no verifier"), "NoVerifier"
            )
        try:
            function, takes_answer = self._function(task)
        except (ValueError, SyntaxError) as exc:
            return Verdict(
                None,
                VerifierOutcome(success=False, error=f"bad verifier: {exc}"),
                type(exc).__name__,
            )
        kwargs = {"final_answer": final_answer} if takes_answer else {}
        try:
            with anyio.fail_after(self._timeout_s):
                async for attempt in stamina.retry_context(
                    on=_transient,
                    attempts=_ATTEMPTS,
                    timeout=None,
                    wait_initial=0.2,
                    wait_max=2.0,
                ):
                    with attempt:
                        response = await function.remote_with_response(env, **kwargs)
        except TimeoutError:
            message = f"the verifier took over {self._timeout_s:g} s"
            return Verdict(None, VerifierOutcome(success=False, error=message), "TimeoutError")
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"[:1000]
            return Verdict(None, VerifierOutcome(success=False, error=message), type(exc).__name__)
        error = None
        if not response.success:
            info = response.error or {}
            error = f"{info.get('type', 'Error')}: {info.get('message', 'verifier failed')}"
        outcome = VerifierOutcome(
            success=bool(response.success),
            execution_id=response.execution_id,
            stdout=(response.stdout or "")[:4000],
            error=error,
        )
        if not response.success:
            return Verdict(None, outcome, (response.error or {}).get("type", "VerifierFailed"))
        reward = _reward(response.result)
        if reward is None:
            outcome = outcome.model_copy(
                update={
                    "success": False,
                    "error": f"the verifier returned {response.result!r}, not a score",
                }
            )
            return Verdict(None, outcome, "BadScore")
        return Verdict(reward, outcome)
