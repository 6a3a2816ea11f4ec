"""Rewards from the task's verifier, through the SDK's remote verify API.

The verifier's code is sent to Fleet (or the emulator) exactly as the SDK
sends it (``AsyncVerifierFunction.remote_with_response``: bundle check,
upload, execute), and it runs there; the bundle check is asked once per
content per process (:class:`_KnownBundle`). It never runs in this process: the
function's name is read from the compiled code, never by executing it (the SDK's
``Task.verify_detailed_async`` would ``exec`` it here to find that name).

Everything cached here is keyed by the verifier's content (the sha256 of its
code), never by a name a caller chooses: two tasks (or two batches) that use
one key with different verifiers are each scored by their own. The code is
parsed once per content, in a worker thread (a large or hostile source must
not stall the event loop), and only up to ``pool.max_verifier_bytes``.

A verifier that cannot run gives ``reward=None`` and an error, never 0; what
one returns is read by :func:`fleetroll.tasks.verifier_results.verifier_reward`
(a number as it is, a boolean, a dict's ``score``, ``reward`` or ``value``).
"""

from __future__ import annotations

import hashlib
import inspect
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import anyio
from fleet._async import exceptions as fleet_errors
from fleet._async.verifiers.verifier import AsyncVerifierFunction

import fleetroll._internal.retrying as retrying
from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.retrying import Decision, decide
from fleetroll.environments.provider import Verdict
from fleetroll.results import VerifierOutcome
from fleetroll.tasks import TaskSpec
from fleetroll.tasks.verifier_results import verifier_reward

__all__ = ["Verifier", "verifier_signature"]

#: Verifiers remembered (by content) per engine; the oldest is forgotten first.
_CACHE_MAX = 1024


def verifier_signature(code: str) -> tuple[str, bool]:
    """The verifier function's name, and whether it takes ``final_answer``.

    The first top-level function is the verifier (as Fleet's runner takes it).
    Blocking (it compiles): call it from a worker thread for anything large.

    The code is compiled, never turned into :mod:`ast` objects: CPython 3.11
    keeps the state of its AST constructor per interpreter, not per thread
    (gh-106905), so an ``ast.parse`` on a worker thread failed now and then
    with "AST constructor recursion depth mismatch", here or in whatever the
    event loop was parsing at that moment (a traceback being formatted).
    Compiling has no such state. Nothing in the code runs.

    Raises:
        ValueError: the code does not compile (including code nested too deeply
            for Python's parser), or defines no function.
    """
    try:
        module = compile(code, "<verifier_func>", "exec", dont_inherit=True)
    except SyntaxError as exc:
        at = f" at line {exc.lineno}" if exc.lineno else ""
        raise ValueError(f"the verifier is not valid Python: {exc.msg}{at}") from None
    except (MemoryError, RecursionError):
        # The parser's own limit on nesting (e.g. thousands of unary minuses).
        raise ValueError(
            "the verifier is nested too deeply for Python's parser to read it"
        ) from None
    except ValueError as exc:  # null bytes
        raise ValueError(f"the verifier is not valid Python: {exc}") from None
    lines = code.splitlines()
    # The module's functions, in the order they are defined: those at the top
    # level start (their first decorator, or `def`) in the first column; one
    # under an `if` or a `try` is indented.
    for const in module.co_consts:
        if not isinstance(const, types.CodeType) or not const.co_flags & inspect.CO_NEWLOCALS:
            continue  # a class body, or not code
        if const.co_name.startswith("<"):  # a lambda or a comprehension
            continue
        first = lines[const.co_firstlineno - 1] if const.co_firstlineno <= len(lines) else ""
        if first[:1].isspace():
            continue
        named = const.co_varnames[
            const.co_posonlyargcount : const.co_argcount + const.co_kwonlyargcount
        ]
        keywords = bool(const.co_flags & inspect.CO_VARKEYWORDS)
        return const.co_name, "final_answer" in named or keywords
    raise ValueError("the verifier code defines no function")


class _KnownBundle(AsyncVerifierFunction):  # type: ignore[misc]  # the SDK is untyped
    """The SDK's verifier function, minus the bundle check once the bundle is known.

    The SDK asks ``GET /v1/verifiers/check`` before every execution. Once an
    execution of this content has gone through (uploaded or found), the
    control plane has the bundle, so later executions go straight to
    ``execute``; should it have forgotten it since, the SDK's own fallback
    (a "bundle not found" answer) uploads it with a second execute. While the
    first execution runs, the others wait for it (within their own deadline)
    rather than each checking and uploading the same bundle.
    """

    _known = False
    _first: anyio.Event | None = None

    async def _check_bundle_status(self, env: Any) -> tuple[str, bool]:
        if self._known:
            return str(self._get_or_create_bundle()[1]), False
        sha, needs_upload = await super()._check_bundle_status(env)
        return str(sha), bool(needs_upload)

    async def remote_with_response(self, env: Any, *args: Any, **kwargs: Any) -> Any:
        first = self._first
        if first is None:
            first = self._first = anyio.Event()
            try:
                response = await super().remote_with_response(env, *args, **kwargs)
                self._known = True
            finally:
                first.set()
            return response
        await first.wait()
        response = await super().remote_with_response(env, *args, **kwargs)
        self._known = True
        return response


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A verifier, ready to send, or why it cannot be."""

    function: AsyncVerifierFunction | None
    takes_answer: bool = False
    error: str | None = None


def _compile(code: str, sha256: str) -> _Compiled:
    """Compile ``code`` (blocking) and wrap it for the SDK's remote execution."""
    try:
        name, takes_answer = verifier_signature(code)
    except ValueError as exc:
        return _Compiled(None, error=f"bad verifier: {exc}")

    def remote_only(env: Any, *args: Any, **kwargs: Any) -> float:
        raise RuntimeError("this verifier runs remotely only")

    remote_only.__name__ = remote_only.__qualname__ = name
    # Key and id are the content's, never a task's key: Fleet sees one
    # verifier per content, and the SDK's bundle sha is of the content too.
    function = _KnownBundle(
        remote_only, f"fleetroll-{sha256[:32]}", verifier_id=sha256, raw_code=code
    )
    return _Compiled(function, takes_answer)


def _decision(exc: BaseException) -> Decision:
    """The SDK's types first (its wrapper of transport errors has no status), then the table."""
    if isinstance(exc, fleet_errors.FleetTimeoutError | fleet_errors.FleetRateLimitError):
        return Decision(True, getattr(exc, "status_code", None))
    if isinstance(exc, fleet_errors.FleetAPIError) and exc.status_code is None:
        return Decision(True)
    return decide(exc)


class Verifier:
    """Scores rollouts; each verifier content is parsed and bundled once."""

    def __init__(
        self,
        *,
        timeout_s: float,
        max_source_bytes: int,
        budget: retrying.Budget,
        report: retrying.Report | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._max_source_bytes = max_source_bytes
        self._budget = budget
        self._report = report
        self._compiled: OrderedDict[str, _Compiled] = OrderedDict()
        self._compiling: dict[str, anyio.Event] = {}
        self._parsing: anyio.CapacityLimiter | None = None

    async def _function(self, code: str) -> _Compiled:
        """The compiled verifier for ``code``, parsed once per content."""
        limit = self._max_source_bytes
        # Checked before any work: each character is at least one byte.
        data = b"" if len(code) > limit else code.encode("utf-8", "surrogatepass")
        if len(code) > limit or len(data) > limit:
            size = f"over {len(code):,}" if len(code) > limit else f"{len(data):,}"
            return _Compiled(
                None,
                error=(
                    f"bad verifier: its code is {size} bytes, over the limit of {limit:,} "
                    "(pool.max_verifier_bytes)"
                ),
            )
        sha256 = hashlib.sha256(data).hexdigest()
        while True:
            cached = self._compiled.get(sha256)
            if cached is not None:
                self._compiled.move_to_end(sha256)
                return cached
            pending = self._compiling.get(sha256)
            if pending is None:
                break
            await pending.wait()  # another rollout is parsing the same code
        done = self._compiling[sha256] = anyio.Event()
        try:
            if self._parsing is None:
                self._parsing = anyio.CapacityLimiter(1)
            compiled = await anyio.to_thread.run_sync(_compile, code, sha256, limiter=self._parsing)
            self._compiled[sha256] = compiled
            while len(self._compiled) > _CACHE_MAX:
                self._compiled.popitem(last=False)
        finally:
            del self._compiling[sha256]
            done.set()
        return compiled

    async def verify(self, task: TaskSpec, env: Any, final_answer: str | None) -> Verdict:
        """Run the task's verifier against the instance behind ``env``.

        Transient platform failures are retried (``retries.verifier_*``) inside the
        verifier deadline. Never raises for verifier problems: they come back
        as a Verdict without a reward.
        """
        if not task.verifier_func:
            return Verdict(
                None, VerifierOutcome(success=False, error="the task has no verifier"), "NoVerifier"
            )
        compiled = await self._function(task.verifier_func)
        function = compiled.function
        if function is None:
            outcome = VerifierOutcome(success=False, error=compiled.error)
            return Verdict(None, outcome, "BadVerifier")
        kwargs = {"final_answer": final_answer} if compiled.takes_answer else {}
        try:
            with fail_after(self._timeout_s) as scope:
                async for attempt in retrying.attempts(
                    "verify",
                    self._budget,
                    deadline=scope.deadline,
                    classify=_decision,
                    report=self._report,
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
        try:
            reward = verifier_reward(response.result)
        except ValueError as exc:
            outcome = outcome.model_copy(update={"success": False, "error": str(exc)})
            return Verdict(None, outcome, "BadScore")
        return Verdict(reward, outcome)
