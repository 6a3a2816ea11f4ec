"""Branches of a rollout tree: a recorded prefix replayed, then sampling goes on.

A rollout tree (:meth:`fleetroll.pool.rollout_pool.RolloutPool.run_tree`) is a
root rollout cut at its branch point (its first ``k`` steps are the shared
prefix) and ``width`` branches. Each branch is an ordinary rollout on a fresh
or reset instance whose policy is a :class:`BranchPolicy`: the rollout's
machine first *replays* the prefix (each recorded assistant turn applied as
it was, its tool calls run against the branch's instance) and checks that the
environment answers exactly what it answered the root; then the wrapped
policy samples on from the prefix's conversation (the assistant turns keep
their token ids, so a token-in policy continues from the prefix's tokens).

An answer that differs ends the branch as ``replay_diverged``, never scored:
a branch whose environment is not in the prefix's state would otherwise be
credited (or blamed) for a state it did not reach. Answers are compared as a
result records them (redacted, and images as their size unless
``pool.transcript_images`` keeps them).

Replayed turns are not policy calls of the branch: they are not in its
``turns`` nor its costs. Its first own turn's prompt is the whole prefix, so
its trajectory is the prefix (masked out) followed by its own tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetroll.policies import AssistantTurn, Policy, ToolCall, ToolSpec, TurnData
from fleetroll.results import RolloutResult, Turn
from fleetroll.tasks import TaskSpec

__all__ = ["BranchPolicy", "Prefix", "first_difference", "prefix_of"]

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Prefix:
    """The shared prefix of a tree, as its root recorded it."""

    #: The rollout it was recorded by.
    parent_rollout_id: str
    #: Its steps (the branch point ``k``).
    steps: int
    #: One per step: the assistant turn, to apply again.
    turns: tuple[AssistantTurn, ...]
    #: One per step: the messages the environment answered after the turn (as
    #: a result records them), which the replay must see again.
    answers: tuple[tuple[Message, ...], ...]
    #: The prefix's messages in all (the prompt, the turns, the answers).
    messages: int


@dataclass(frozen=True, slots=True)
class BranchPolicy:
    """A branch's policy: the rollout replays ``prefix`` first, then ``policy`` acts.

    Picklable when ``policy`` is (a Ray actor runs it as it is).
    """

    prefix: Prefix
    policy: Policy

    async def act(
        self, task: TaskSpec, messages: Sequence[Mapping[str, Any]], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The wrapped policy's turn (asked only once the prefix was replayed)."""
        return await self.policy.act(task, messages, tools)

    async def aclose(self) -> None:
        """Nothing of its own: the wrapped policy is its caller's to close."""


def prefix_of(root: RolloutResult, steps: int) -> Prefix:
    """The first ``steps`` steps of ``root``'s transcript, to replay.

    The assistant turns get the token ids ``root.turns`` recorded for them
    (when every assistant message has its turn: a model server's policy), so
    a branch continues from the prefix's very tokens.

    Raises:
        ValueError: ``root`` has fewer than ``steps`` steps in its transcript.
    """
    transcript = root.transcript
    starts = [i for i, m in enumerate(transcript) if m.get("role") == "assistant"]
    if len(starts) < steps or steps < 1:
        raise ValueError(
            f"rollout {root.rollout_id} has {len(starts)} assistant turns; a prefix of"
            f" {steps} steps needs at least that many"
        )
    own = [t for t in root.turns if t.choice == 0]
    data = own if len(own) == len(starts) else None
    turns, answers = [], []
    for number in range(steps):
        at = starts[number]
        end = starts[number + 1] if number + 1 < len(starts) else len(transcript)
        turn_data = None if data is None else _data(data[number])
        turns.append(_turn(transcript[at], turn_data))
        answers.append(tuple(transcript[at + 1 : end]))
    last = starts[steps] if steps < len(starts) else len(transcript)
    return Prefix(
        parent_rollout_id=root.rollout_id,
        steps=steps,
        turns=tuple(turns),
        answers=tuple(answers),
        messages=last,
    )


def _turn(message: Mapping[str, Any], data: TurnData | None) -> AssistantTurn:
    """The assistant turn a transcript's ``message`` records."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        raw = function.get("arguments")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) and raw else {}
        except ValueError:
            arguments = {}
        calls.append(
            ToolCall(
                id=call.get("id", ""),
                name=function.get("name", ""),
                arguments=arguments if isinstance(arguments, dict) else {},
                raw_arguments=raw if isinstance(raw, str) else None,
            )
        )
    content = message.get("content")
    return AssistantTurn(
        content=content if isinstance(content, str) else None,
        tool_calls=tuple(calls),
        data=data,
    )


def _data(turn: Turn) -> TurnData:
    return TurnData(
        model=turn.model,
        finish_reason=turn.finish_reason,
        prompt_token_ids=None if turn.prompt_token_ids is None else tuple(turn.prompt_token_ids),
        completion_token_ids=None
        if turn.completion_token_ids is None
        else tuple(turn.completion_token_ids),
    )


def first_difference(got: Sequence[Message], want: Sequence[Message]) -> str | None:
    """Where ``got`` (the replay's answers to a step) differs from ``want`` (the
    prefix's), for people; None when they are equal."""
    if list(got) == list(want):
        return None
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"answer {index + 1} was {_excerpt(a)} where the prefix had {_excerpt(b)}"
    return f"{len(got)} answer messages where the prefix had {len(want)}"


def _excerpt(message: Message, limit: int = 160) -> str:
    text = json.dumps(message.get("content"), ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"
