"""One rollout's mutable state, and the result built from it.

Only the rollout's own task touches a :class:`Progress`. The first failure
recorded wins (cancellation overrides); :meth:`Progress.result` turns the
state into the :class:`~fleetroll.results.RolloutResult`, redacting every
string that came from outside.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fleetroll._internal.deadlines import now
from fleetroll.policies import AssistantTurn
from fleetroll.policies.turns import TurnData
from fleetroll.results import (
    REWARD_ERROR_SEPARATOR,
    SCORED_REASONS,
    Cost,
    FailureReason,
    RolloutResult,
    Timings,
    Turn,
    VerifierOutcome,
)
from fleetroll.rollout.branching import Prefix
from fleetroll.rollout.transcript import CHARS_PER_TOKEN, Transcript
from fleetroll.tasks import TaskSpec
from fleetroll.training.trajectory import stitch

__all__ = ["Progress", "RolloutIds"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RolloutIds:
    batch_id: str
    rollout_id: str
    sample_index: int = 0
    group_id: str | None = None


@dataclass
class Progress:
    """The mutable state of one rollout (only its own task touches it)."""

    reason: FailureReason | None = None
    error: str | None = None
    steps: int = 0
    tool_errors: int = 0
    tool_failures: int = 0
    final_answer: str | None = None
    finished: bool = False  # the episode ended on its own (no more tool calls / answer)
    scored: bool = False
    reward: float | None = None
    #: The components of the task's ``rewards`` by name (None: the task has none).
    rewards: dict[str, float | None] | None = None
    verifier: VerifierOutcome | None = None
    timings: Timings = field(default_factory=Timings)
    transcript: Transcript = field(default_factory=Transcript)
    #: One per policy call answered by a model server (see :meth:`record_turn`).
    turns: list[Turn] = field(default_factory=list)
    cost: Cost = field(default_factory=Cost)
    #: The policy version of the first policy call (staleness is measured from
    #: it), for every policy: the scripted one records no ``turns``.
    first_policy_version: int | None = None
    #: What the first recorded call showed the model besides the transcript:
    #: its system message and its tools as sent (``TurnData``); None until then.
    shown: tuple[str | None, tuple[Mapping[str, Any], ...] | None] | None = None
    #: The prompt+completion tokens of the last turn, as the server counted them,
    #: and the transcript's length once that turn was added (context estimate).
    _context_tokens: int = 0
    _context_at: int = 0
    #: When the rollout's clock (``timeouts.rollout_s``) runs out, in
    #: ``anyio.current_time()`` terms; set once the instance is ready.
    deadline: float = math.inf
    #: The wait on the platform during which :attr:`deadline` passed, and how
    #: far into it (s): see :meth:`platform_wait`.
    overrun: tuple[str, float] | None = None
    #: A branch of a rollout tree: the prefix it replayed (:mod:`fleetroll.rollout.branching`).
    branch: Prefix | None = None

    @contextmanager
    def platform_wait(self, what: str) -> Iterator[None]:
        """Mark the block as a wait on the platform (``what``: a reset, a connect, a tool call).

        If :attr:`deadline` passes during it, it is the platform's wait that
        ran over, not the policy's time (:attr:`overrun`): the rollout ends
        as ``platform_timeout``, not ``timeout``. Judged by the clock, not by
        where the deadline's cancellation lands, which may be a later await.
        """
        began = now()
        try:
            yield
        finally:
            if self.overrun is None and began < self.deadline <= now():
                self.overrun = (what, self.deadline - began)

    def record_turn(
        self,
        turn: AssistantTurn,
        *,
        policy_version: int,
        latency_s: float,
        choice: int = 0,
        proven: bool = True,
    ) -> None:
        """Count a policy call and keep its training data; call before adding the turn.

        ``choice`` > 0: another choice of the call just recorded (``n`` > 1), kept
        as a turn of its own; the call is not counted again. ``proven``: no weight
        update can have applied during the call, so a server that reports no
        per-token versions produced every token with ``policy_version``; else
        those tokens' versions are null (with a note).
        """
        if not choice:
            self.cost.policy_calls += 1
        usage = dict(turn.usage) if turn.usage is not None else None
        if usage is not None:
            self.cost.prompt_tokens += usage.get("prompt_tokens", 0)
            self.cost.completion_tokens += usage.get("completion_tokens", 0)
            if "prompt_tokens" in usage:
                self._context_tokens = usage["prompt_tokens"] + usage.get("completion_tokens", 0)
                self._context_at = len(self.transcript) + 1  # the turn's own message is counted
        data = turn.data
        if data is None:  # not a model server's answer (the scripted policy)
            return
        if self.shown is None:
            self.shown = (data.system_prompt, data.tools)
        self.turns.append(
            Turn(
                index=len(self.turns),
                model=data.model,
                policy_version=policy_version,
                finish_reason=data.finish_reason,
                prompt_token_ids=_list(data.prompt_token_ids),
                completion_token_ids=_list(data.completion_token_ids),
                logprobs=_list(data.logprobs),
                top_logprobs=None
                if data.top_logprobs is None
                else [list(alternatives) for alternatives in data.top_logprobs],
                usage=usage,
                latency_s=latency_s,
                training_data_error=data.training_data_error,
                server=data.server,
                choice=choice,
                **_token_versions(data, policy_version, proven),
                routed_experts=data.routed_experts,
                images=None if data.images is None else list(data.images),
            )
        )

    def context_estimate(self) -> int:
        """About how many tokens the next prompt holds: the server's count of the last
        prompt and completion, plus the text added since (images not counted)."""
        added = self.transcript.text_chars(self._context_at)
        return self._context_tokens + -(-added // CHARS_PER_TOKEN)

    @property
    def to_score(self) -> bool:
        """The outcome calls for a reward, and the verifier has not run yet."""
        return not self.scored and (self.reason is None or self.reason in SCORED_REASONS)

    def fail(self, reason: FailureReason, error: str, *, force: bool = False) -> None:
        """Record the first failure (``force``: cancellation overrides)."""
        if self.reason is None or force:
            self.reason = reason
            self.error = error
            if reason not in SCORED_REASONS:
                self.reward = None

    def reward_failed(self, error: str) -> None:
        """A component of the task's ``rewards`` could not be computed: no reward.

        A rollout that had ended well is ``reward_error``; one that had ended
        otherwise keeps its reason (``max_steps``...), ``error`` saying both.
        """
        self.reward = None
        if self.reason is None:
            self.fail(FailureReason.REWARD_ERROR, error)
        else:
            self.error = f"{self.error}{REWARD_ERROR_SEPARATOR}{error}" if self.error else error

    def result(
        self,
        ids: RolloutIds,
        task: TaskSpec,
        instance_id: str | None,
        *,
        instance_uses: int | None = None,
        redact: Callable[[str], str],
        keep_images: bool,
        trajectory: bool = False,
    ) -> RolloutResult:
        """The result so far; every string from outside goes through ``redact``.

        ``trajectory``: stitch the turns into one token sequence (``policy.trajectory``).
        """
        if self.reason is None and self.reward is None:
            # A completed rollout always has a reward; if a path ever skips
            # scoring, say so rather than report "completed" without one.
            self.reason = FailureReason.VERIFIER_ERROR if self.scored else FailureReason.TOOLS_ERROR
            self.error = self.error or "the rollout ended without being scored (a fleetroll bug)"
        reward = self.reward if (self.reason is None or self.reason in SCORED_REASONS) else None
        verifier = self.verifier
        if verifier is not None:
            verifier = verifier.model_copy(
                update={
                    "stdout": redact(verifier.stdout),
                    "error": None if verifier.error is None else redact(verifier.error),
                }
            )
        system_prompt, tools = self.shown or (None, None)
        return RolloutResult(
            rollout_id=ids.rollout_id,
            batch_id=ids.batch_id,
            task_key=task.key,
            sample_index=ids.sample_index,
            group_id=ids.group_id,
            env_key=task.env_key,
            env_version=task.env_version,
            modality=task.modality,
            instance_id=instance_id,
            instance_uses=instance_uses,
            status="completed" if self.reason is None else "failed",
            failure_reason=self.reason,
            error=None if self.error is None else redact(self.error),
            reward=reward,
            rewards=None if self.rewards is None else dict(self.rewards),
            steps=self.steps,
            tool_errors=self.tool_errors,
            tool_failures=self.tool_failures,
            final_answer=None if self.final_answer is None else redact(self.final_answer),
            timings=self.timings.model_copy(),
            verifier=verifier,
            system_prompt=None if system_prompt is None else redact(system_prompt),
            tools=None if tools is None else [_plain(tool, redact) for tool in tools],
            transcript=self.transcript.export(redact, keep_images=keep_images),
            turns=[
                turn
                if turn.model is None
                else turn.model_copy(update={"model": redact(turn.model)})
                for turn in self.turns
            ],
            cost=self.cost.model_copy(),
            trajectory=stitch(self.turns) if trajectory else None,
            **self._branch_fields(),
        )

    def _branch_fields(self) -> dict[str, int | str | None]:
        """A branch's place in its tree (none for other rollouts)."""
        prefix = self.branch
        if prefix is None:
            return {}
        first = self.turns[0].prompt_token_ids if self.turns else None
        return {
            "parent_rollout_id": prefix.parent_rollout_id,
            "branch_step": prefix.steps,
            "prefix_messages": prefix.messages,
            "prefix_tokens": None if first is None else len(first),
        }


def _list(values: tuple[T, ...] | None) -> list[T] | None:
    return None if values is None else list(values)


def _plain(value: Any, redact: Callable[[str], str]) -> Any:
    """``value`` (a tool as sent: JSON's types, mappings and sequences of any
    kind) as plain dicts and lists, each string value redacted (keys kept).

    A dict or list in which nothing changed is ``value`` itself, not a copy:
    the rollouts of one environment share its listed schemas
    (:mod:`fleetroll.tools.mcp_common`), and so do their results.
    """
    if isinstance(value, str):
        clean = redact(value)
        return value if clean == value else clean
    if isinstance(value, Mapping):
        items = {str(key): _plain(item, redact) for key, item in value.items()}
        if type(value) is dict and all(items[k] is v for k, v in value.items()):
            return value
        return items
    if isinstance(value, list | tuple):
        elements = [_plain(item, redact) for item in value]
        if type(value) is list and all(a is b for a, b in zip(elements, value, strict=True)):
            return value
        return elements
    return value


def _token_versions(data: TurnData, policy_version: int, proven: bool) -> dict[str, Any]:
    """A turn's ``token_versions`` and their note: the server's (or the policy's,
    after an abort) when given, else ``policy_version`` where proven, else null."""
    versions = data.token_versions
    note = data.token_versions_note
    ids = data.completion_token_ids
    if versions is None and ids is not None:
        if proven:
            versions = (policy_version,) * len(ids)
        else:
            versions = (None,) * len(ids)
            note = (
                "the weights were updated during the call (policy.weight_update = in_flight)"
                " and the server reports no token_versions: which version produced each token"
                " is unknown"
            )
    return {"token_versions": _list(versions), "token_versions_note": note}
