"""The result of one rollout: the output contract (docs/results.md).

One :class:`RolloutResult` per rollout, on every path. An infrastructure
failure never yields a fabricated zero: ``reward`` is None with a
``failure_reason``, so a trainer can drop the sample instead of learning from
a fake signal.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
from array import array
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    model_serializer,
    model_validator,
)

from fleetroll._internal.utf8 import utf8_safe

__all__ = [
    "REWARD_ERROR_SEPARATOR",
    "Cost",
    "FailureReason",
    "Outcome",
    "RolloutResult",
    "RoutedExperts",
    "Timings",
    "Trajectory",
    "TrajectorySegment",
    "Turn",
    "TurnImage",
    "VerifierOutcome",
    "map_images",
    "writable_result",
]

#: Between a rollout's own error and why its reward could not be computed,
#: when it had ended otherwise than well (``fleetroll rescore`` splits there).
REWARD_ERROR_SEPARATOR = "; not scored: "


class FailureReason(StrEnum):
    """Why a rollout did not complete normally (``null`` when it did)."""

    INIT_ERROR = "init_error"
    TOOLS_ERROR = "tools_error"
    COMPUTER_TOOL_MISSING = "computer_tool_missing"
    INSTANCE_LOST = "instance_lost"
    #: The rollout's deadline (``timeouts.rollout_s``) passed while the policy
    #: had the turn (a policy call, or fleetroll's own work between calls): scored.
    TIMEOUT = "timeout"
    #: The rollout's deadline passed while fleetroll waited on the platform (a
    #: reset, the MCP connect, the tool listing, a tool call): the time was not
    #: the policy's, so the rollout is not scored; ``error`` names the wait.
    PLATFORM_TIMEOUT = "platform_timeout"
    POLICY_ERROR = "policy_error"
    VERIFIER_ERROR = "verifier_error"
    MAX_STEPS = "max_steps"
    ABANDONED = "abandoned"
    CANCELLED = "cancelled"
    #: A tool call failed for infrastructure reasons (timeout, transport
    #: error), with ``pool.on_tool_failure = "fail"`` (the default).
    TOOL_FAILURE = "tool_failure"
    #: The next prompt would pass ``policy.max_context_tokens``, or the model's
    #: server answered that the prompt is longer than its context.
    CONTEXT_OVERFLOW = "context_overflow"
    #: The rollout's first policy call was more than ``pool.max_staleness``
    #: policy versions behind when it ended (still scored).
    STALE = "stale"
    #: An oversampled rollout stopped because its group was complete.
    SUPERSEDED = "superseded"
    #: The environment version's circuit breaker was open (too many
    #: infrastructure failures) and ``admission.breaker.on_open = "fail"``.
    ENV_UNAVAILABLE = "env_unavailable"
    #: The environment's reset failed where only the reset makes its state the
    #: task's start (a shared ``environment.url`` server): not scored.
    RESET_FAILED = "reset_failed"
    #: A component of the task's ``rewards`` other than the verifier (a judge)
    #: could not be computed: not scored; ``error`` names the component.
    REWARD_ERROR = "reward_error"
    #: The rollout's result could not be written as JSON (a string holding a
    #: lone surrogate, which UTF-8 cannot encode): journaled and streamed as
    #: this failure instead, not scored; ``error`` names the field.
    RESULT_ERROR = "result_error"
    #: A branch of a rollout tree (``RolloutPool.run_tree``): replaying the
    #: shared prefix's tool calls on its instance, the environment answered
    #: otherwise than it had for the prefix (a nondeterministic environment, or
    #: a reset that did not restore the state): not scored; ``error`` names the
    #: step and the first answer that differed.
    REPLAY_DIVERGED = "replay_diverged"


#: How a rollout ended, as every count of rollouts splits them: ``cancelled``
#: (a cancel, Ctrl-C, an early stop: it was not let finish) is neither
#: completed nor failed, and failure rates leave it out.
Outcome = Literal["completed", "failed", "cancelled"]


#: Reasons after which the verifier still scores the rollout (docs/results.md);
#: for every other reason the reward is None.
SCORED_REASONS = frozenset(
    {
        FailureReason.TIMEOUT,
        FailureReason.MAX_STEPS,
        FailureReason.ABANDONED,
        FailureReason.CONTEXT_OVERFLOW,
        FailureReason.STALE,
    }
)


class Timings(BaseModel):
    """Seconds spent per phase. ``total_s`` runs from the rollout's start to its
    result, and is the sum of the others (``other_s`` is what no phase claims)."""

    model_config = ConfigDict(extra="forbid")

    provision_s: float = 0.0
    slot_wait_s: float = 0.0
    reset_s: float = 0.0
    connect_s: float = 0.0
    tools_s: float = 0.0
    policy_s: float = 0.0
    paused_s: float = 0.0
    verify_s: float = 0.0
    release_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0

    def close(self, total_s: float) -> None:
        """Set ``total_s`` and make ``other_s`` the seconds no other field accounts for."""
        self.total_s = total_s
        self.other_s = 0.0
        parts = sum(getattr(self, name) for name in type(self).model_fields if name != "total_s")
        self.other_s = max(0.0, total_s - parts)


class VerifierOutcome(BaseModel):
    """What the verifier said, kept whole for debugging."""

    model_config = ConfigDict(extra="forbid")

    success: bool
    execution_id: str | None = None
    stdout: str = ""
    error: str | None = None


class RoutedExperts(BaseModel):
    """The experts a mixture-of-experts model routed each token to, compactly.

    ``data`` is the base64 of a little-endian int16 array of shape
    ``[tokens, layers, top_k]`` (row-major): row ``i`` is token ``i``'s experts
    at every MoE layer, in the router's order (highest weight first), -1 where
    the server returned none for that token. In a turn, the rows are aligned
    with ``prompt_token_ids + completion_token_ids``; in a trajectory, with
    ``input_ids``. Decode it with
    ``numpy.frombuffer(base64.b64decode(data), "<i2").reshape(tokens, layers, top_k)``
    or :func:`fleetroll.training.trajectory.routed_experts_list`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int
    layers: int
    top_k: int
    data: str

    @classmethod
    def from_raw(cls, raw: bytes, *, layers: int, top_k: int) -> Self:
        """From the little-endian int16 bytes of ``[tokens, layers, top_k]``."""
        stride = 2 * layers * top_k
        if stride == 0 or len(raw) % stride:
            raise ValueError(f"{len(raw)} bytes are no whole rows of {layers}x{top_k} experts")
        return cls(
            tokens=len(raw) // stride,
            layers=layers,
            top_k=top_k,
            data=base64.b64encode(raw).decode("ascii"),
        )

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Sequence[int]]], *, layers: int, top_k: int) -> Self:
        """From nested lists ``[tokens][layers][top_k]`` (vLLM's JSON shape).

        Raises:
            ValueError: a row is not ``layers`` x ``top_k`` ints in int16's range.
        """
        values = array("h")
        for row in rows:
            if len(row) != layers or any(len(experts) != top_k for experts in row):
                raise ValueError(f"a token's experts are not {layers} layers x {top_k}")
            for experts in row:
                try:
                    values.extend(experts)
                except (TypeError, OverflowError):
                    raise ValueError(f"expert ids must be small ints, not {experts!r}") from None
        if sys.byteorder != "little":
            values.byteswap()
        return cls.from_raw(values.tobytes(), layers=layers, top_k=top_k)

    def raw(self) -> bytes:
        """The little-endian int16 bytes of ``[tokens, layers, top_k]``."""
        return base64.b64decode(self.data)

    def rows(self) -> list[list[list[int]]]:
        """The experts as nested lists ``[tokens][layers][top_k]``."""
        values = array("h")
        values.frombytes(self.raw())
        if sys.byteorder != "little":
            values.byteswap()
        flat = values.tolist()
        k, per_token = self.top_k, self.layers * self.top_k
        return [
            [flat[t + layer * k : t + (layer + 1) * k] for layer in range(self.layers)]
            for t in range(0, len(flat), per_token)
        ]


class TurnImage(BaseModel):
    """An image the model saw, as it saw it, and where its placeholder tokens sit.

    ``start``/``end`` (end excluded) index the placeholder tokens (Qwen2-VL's
    ``<|image_pad|>`` run, one per 28x28 block) in the turn's
    ``prompt_token_ids``, or in a trajectory's ``input_ids``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: int
    end: int
    #: The size after the resize (``policy.image_max_pixels``): what the model saw.
    width: int
    height: int
    #: The SHA-256 of the PNG (``data`` decoded, or the file at ``path``).
    sha256: str
    #: The PNG, base64 (``policy.image_store = "inline"``); the key is absent
    #: when the image is a file (``path``).
    data: str | None = None
    #: With ``policy.image_store = "files"``, in a journal: the PNG's file,
    #: relative to the journal's folder (``<journal>.images/<sha256>.png``, one
    #: file per distinct image), and its length in bytes; the keys are absent
    #: when the image is inline (``data``).
    path: str | None = None
    nbytes: int | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.data is None) == (self.path is None):
            raise ValueError("an image has either its bytes (data) or its file (path), not both")
        return self

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any, info: SerializationInfo) -> Any:
        return _drop_absent(self, handler, info, ("data", "path", "nbytes"))

    def png(self, root: str | os.PathLike[str] | None = None) -> bytes:
        """The PNG's bytes: ``data`` decoded, or the file at ``path`` under
        ``root`` (the journal's folder), checked against ``sha256``.

        Raises:
            ValueError: the image is a file and ``root`` is None, or the file's
                bytes are not the image's (a different SHA-256).
            OSError: the file cannot be read.
        """
        if self.data is not None:
            return base64.b64decode(self.data)
        if root is None:
            raise ValueError(
                f"the image {self.path} is a file beside its journal: say where the journal's"
                " folder is (root)"
            )
        where = Path(root, str(self.path))
        data = where.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"{where}: its bytes are not the image's (SHA-256 {self.sha256})")
        return data

    def inline(self, root: str | os.PathLike[str] | None = None) -> TurnImage:
        """This image with its bytes in ``data`` (itself when they already are).

        Raises:
            ValueError, OSError: as :meth:`png`.
        """
        if self.data is not None:
            return self
        data = base64.b64encode(self.png(root)).decode("ascii")
        return self.model_copy(update={"data": data, "path": None, "nbytes": None})


def _drop_absent(
    model: BaseModel, handler: Any, info: SerializationInfo, names: tuple[str, ...]
) -> Any:
    """The model dumped without ``names`` where they are None: a field a server
    may never return adds no key to results that lack it."""
    dumped = handler(model)
    if isinstance(dumped, dict):
        for name in names:
            if name in dumped and dumped[name] is None:
                del dumped[name]
    return dumped


class Turn(BaseModel):
    """One policy call: what a trainer needs to compute a loss without re-tokenising.

    Fields the server did not return are None (token ids and logprobs are
    only asked for with ``policy.return_token_ids`` / ``policy.logprobs``).
    """

    model_config = ConfigDict(extra="forbid")

    index: int
    model: str | None = None
    policy_version: int | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    #: The sampled token's logprob, one per completion token.
    logprobs: list[float] | None = None
    #: With ``policy.top_logprobs``: per completion token, the alternatives
    #: as ``[token, logprob]`` pairs, most likely first.
    top_logprobs: list[list[tuple[str, float]]] | None = None
    usage: dict[str, int] | None = None
    latency_s: float = 0.0
    #: Why this turn's token ids / logprobs are unusable for training (NaN or
    #: infinite logprobs, which are then dropped; lists of different lengths;
    #: negative token ids); None when they are fine or were not asked for.
    training_data_error: str | None = None
    #: The policy server that answered this call (its API root, without
    #: credentials), with many servers (``policy.base_urls``); null with one.
    server: str | None = None
    #: Which of its call's choices this turn is: 0, unless the call asked for
    #: ``n`` > 1 choices (an agent of its own may): then each choice is a turn,
    #: in order, the same call's siblings sharing its prompt.
    choice: int = 0
    #: The policy version of the weights that produced each completion token
    #: (``policy.weight_update``): the server's own per-token report when it
    #: gives one, else the call's version where no update can have happened
    #: during it; null where it cannot be proven (``token_versions_note`` says why).
    token_versions: list[int | None] | None = None
    #: Why ``token_versions`` holds nulls (or what was resumed after an abort).
    token_versions_note: str | None = None
    #: With a mixture-of-experts policy whose server returns them (vLLM's
    #: ``--enable-return-routed-experts``): the experts each token of
    #: ``prompt_token_ids + completion_token_ids`` was routed to. The key is
    #: absent when the server returned none.
    routed_experts: RoutedExperts | None = None
    #: With ``policy.image_max_pixels``: the images of the prompt, in order, with
    #: their placeholder spans in ``prompt_token_ids`` (the key is absent otherwise).
    images: list[TurnImage] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any, info: SerializationInfo) -> Any:
        return _drop_absent(self, handler, info, ("routed_experts", "images"))


class TrajectorySegment(BaseModel):
    """Consecutive turns whose prompts extend one another, as one token sequence.

    The four lists are aligned, one entry per token.
    """

    model_config = ConfigDict(extra="forbid")

    #: The indexes (in ``turns``) of the segment's first and last turn.
    first_turn: int
    last_turn: int
    input_ids: list[int]
    #: 1 exactly on the tokens the model produced (completions), 0 on the
    #: prompt and the observations fleetroll added.
    loss_mask: list[int]
    #: The sampled token's logprob where the mask is 1 and the server returned
    #: it; null elsewhere.
    logprobs: list[float | None]
    #: The policy version of the call that produced the token; null where masked.
    policy_versions: list[int | None]
    #: The version of the weights that produced each token (a call's tokens may
    #: span an update with ``policy.weight_update``); null where masked or unproven.
    token_versions: list[int | None] = Field(default_factory=list)
    #: The routed experts of every token (aligned with ``input_ids``), when the
    #: server returned them; the key is absent otherwise.
    routed_experts: RoutedExperts | None = None
    #: With ``policy.image_max_pixels``: the images of the prompt, in order, with
    #: their placeholder spans in ``prompt_token_ids`` (the key is absent otherwise).
    images: list[TurnImage] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any, info: SerializationInfo) -> Any:
        return _drop_absent(self, handler, info, ("routed_experts", "images"))


class Trajectory(BaseModel):
    """A rollout's turns stitched into one token sequence (``policy.trajectory``).

    ``input_ids``, ``loss_mask``, ``logprobs`` and ``policy_versions`` are
    aligned. Without drift they are the whole rollout: the last turn's prompt
    and completion ids. With drift they are the first segment, and
    ``segments`` holds every segment (the first included).
    """

    model_config = ConfigDict(extra="forbid")

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    policy_versions: list[int | None]
    #: As the segment's: the version that produced each token; null where masked or unproven.
    token_versions: list[int | None] = Field(default_factory=list)
    #: False when every turn's prompt ids extend the previous turn's prompt and
    #: completion ids; true when a chat template re-rendered the history.
    drift: bool = False
    #: The first turn (its index in ``turns``) whose prompt did not extend the previous.
    drift_turn: int | None = None
    #: With drift: the consistent segments, in order. Empty without drift.
    segments: list[TrajectorySegment] = Field(default_factory=list)
    #: The routed experts of every token (aligned with ``input_ids``), when the
    #: server returned them for some turn; the key is absent otherwise.
    routed_experts: RoutedExperts | None = None
    #: With ``policy.image_max_pixels``: the images of the prompt, in order, with
    #: their placeholder spans in ``prompt_token_ids`` (the key is absent otherwise).
    images: list[TurnImage] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any, info: SerializationInfo) -> Any:
        return _drop_absent(self, handler, info, ("routed_experts", "images"))


class Cost(BaseModel):
    """What one rollout consumed."""

    model_config = ConfigDict(extra="forbid")

    #: Seconds from the instance being provisioned to it being released.
    instance_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    policy_calls: int = 0
    tool_calls: int = 0
    #: Judge calls answered for the task's ``rewards`` (answers from the cache not counted).
    judge_calls: int = 0
    judge_prompt_tokens: int = 0
    judge_completion_tokens: int = 0


class RolloutResult(BaseModel):
    """One rollout's outcome, written as soon as the rollout ends."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    batch_id: str
    task_key: str
    sample_index: int = 0
    group_id: str | None = None
    policy_version: int | None = Field(
        default=None,
        description="The policy version its batch was started for (an evaluation's tag); else null",
    )
    step: int | None = Field(
        default=None,
        description="The sampling step that drew its task (fleetroll run --steps), from 0",
    )
    env_key: str
    env_version: str | None = None
    modality: str
    instance_id: str | None = None
    instance_uses: int | None = Field(
        default=None,
        description="Rollouts its instance served, this one counted (1: made for it)",
    )
    status: Literal["completed", "failed"]
    failure_reason: FailureReason | None = None
    error: str | None = Field(default=None, description="What went wrong, for people")
    reward: float | None = None
    rewards: dict[str, float | None] | None = Field(
        default=None,
        description="Each component of the task's rewards by name (null without rewards)",
    )
    steps: int = 0
    tool_errors: int = Field(
        default=0, description="Errors the environment answered (feedback for the agent)"
    )
    tool_failures: int = Field(
        default=0,
        description="Tool calls that failed for infrastructure reasons (timeout, transport)",
    )
    final_answer: str | None = None
    timings: Timings = Field(default_factory=Timings)
    verifier: VerifierOutcome | None = None
    system_prompt: str | None = Field(
        default=None,
        description="The system message the model's first call was sent; null: none, or no call",
    )
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        description="The tools as the model's first call was sent them (OpenAI's tools list)",
    )
    transcript: list[dict[str, Any]] = Field(default_factory=list)
    turns: list[Turn] = Field(
        default_factory=list,
        description="One entry per policy call; empty for the scripted policy",
    )
    cost: Cost = Field(default_factory=Cost)
    trajectory: Trajectory | None = Field(
        default=None,
        description="The turns as one token sequence, with policy.trajectory; else null",
    )
    parent_rollout_id: str | None = Field(
        default=None,
        description="A branch of a rollout tree: the rollout whose prefix it replayed; else null",
    )
    branch_step: int | None = Field(
        default=None,
        description="A branch: the prefix steps it replayed before sampling; else null",
    )
    prefix_messages: int | None = Field(
        default=None,
        description="A branch: how many transcript messages the shared prefix is; else null",
    )
    prefix_tokens: int | None = Field(
        default=None,
        description=(
            "A branch: the token ids of the shared prefix (its first own turn's prompt,"
            " masked out of its trajectory); null without token ids"
        ),
    )

    @property
    def outcome(self) -> Outcome:
        """``cancelled`` when its failure reason is, else its ``status``: what counts
        (batch counts, ``/metrics``, the dashboard, ``stats``) count it as."""
        if self.failure_reason is FailureReason.CANCELLED:
            return "cancelled"
        return self.status


def map_images(result: RolloutResult, change: Callable[[TurnImage], TurnImage]) -> RolloutResult:
    """``result`` with ``change`` applied to every image of its turns and its
    trajectory (segments included); ``result`` itself when it has none."""

    def each(images: list[TurnImage] | None) -> list[TurnImage] | None:
        return None if images is None else [change(image) for image in images]

    turns = result.turns
    if any(turn.images for turn in turns):
        turns = [
            turn.model_copy(update={"images": each(turn.images)}) if turn.images else turn
            for turn in turns
        ]
    trajectory = result.trajectory
    if trajectory is not None and (
        trajectory.images or any(segment.images for segment in trajectory.segments)
    ):
        segments = [s.model_copy(update={"images": each(s.images)}) for s in trajectory.segments]
        trajectory = trajectory.model_copy(
            update={"images": each(trajectory.images), "segments": segments}
        )
    if turns is result.turns and trajectory is result.trajectory:
        return result
    return result.model_copy(update={"turns": turns, "trajectory": trajectory})


def writable_result(result: RolloutResult) -> RolloutResult:
    """``result``, or its stand-in when it cannot be written as JSON.

    A string holding a lone surrogate (a model's text, a tool's answer naming
    a file whose name is not UTF-8), which UTF-8 cannot encode, or a value
    JSON has no form for, would crash every view that serialises the result
    (the journal, the results stream, the events' ``end``, the dashboard).
    Its stand-in is its rollout's failure, ``result_error`` with reward null,
    its ids, counts, timings and costs kept, ``error`` naming the field and
    what the rollout had ended as; its transcript, turns, verifier output,
    system prompt and tools are left out. A rollout's machine keeps this as
    its result, so every view serves what the journal holds.
    """
    try:
        result.model_dump_json()
    except (ValueError, TypeError) as exc:  # pydantic's serialisation error is a ValueError
        where = _unwritable(result.model_dump(), "") or utf8_safe(" ".join(str(exc).split())[:200])
    else:
        return result
    ended = result.status if result.failure_reason is None else result.failure_reason.value
    error = (
        f"its result could not be written as JSON: {where}; it had ended {utf8_safe(ended)}"
        + (f" with reward {result.reward:g}" if result.reward is not None else "")
        + " (its transcript, turns, verifier output, system prompt and tools are left out)"
    )
    return RolloutResult(
        rollout_id=utf8_safe(result.rollout_id),
        batch_id=utf8_safe(result.batch_id),
        task_key=utf8_safe(result.task_key),
        sample_index=result.sample_index,
        group_id=None if result.group_id is None else utf8_safe(result.group_id),
        policy_version=result.policy_version,
        step=result.step,
        env_key=utf8_safe(result.env_key),
        env_version=None if result.env_version is None else utf8_safe(result.env_version),
        modality=utf8_safe(result.modality),
        instance_id=None if result.instance_id is None else utf8_safe(result.instance_id),
        instance_uses=result.instance_uses,
        status="failed",
        failure_reason=FailureReason.RESULT_ERROR,
        error=error,
        reward=None,
        steps=result.steps,
        tool_errors=result.tool_errors,
        tool_failures=result.tool_failures,
        parent_rollout_id=result.parent_rollout_id,
        branch_step=result.branch_step,
        prefix_messages=result.prefix_messages,
        timings=Timings.model_validate(result.timings.model_dump()),
        cost=Cost.model_validate(result.cost.model_dump()),
    )


def _unwritable(value: object, path: str) -> str | None:
    """Where in ``value`` (a result's fields, as Python values) JSON cannot go, and why."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            code = ord(value[exc.start])
            where = path or "a field"
            return f"{where} holds a lone surrogate (U+{code:04X}), which UTF-8 cannot encode"
        return None
    if value is None or isinstance(value, bool | int | float):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = utf8_safe(str(key))
            where = f"{path}.{name}" if path else name
            if isinstance(key, str) and (
                found := _unwritable(key, f"a key of {path or 'the result'}")
            ):
                return found
            if found := _unwritable(item, where):
                return found
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if found := _unwritable(item, f"{path}[{i}]"):
                return found
        return None
    return f"{path or 'a field'} holds a {type(value).__name__}, which JSON cannot hold"
