"""One token sequence per rollout, stitched from its turns, and the rows a trainer reads.

A rollout's turns are its policy calls, each with the prompt's and the
completion's token ids as the server returned them. Stitching them into one
sequence is only right when every turn's prompt ids *extend* the previous
turn's prompt and completion ids (the "exact prefix" or "extension" property
of prime-rl and verifiers): the next prompt then holds everything the model
saw and said, plus the new observation. A chat template that renders earlier
turns differently (thinking stripped, spaces merged) breaks it; then the
trajectory is split into segments that each hold it, never spliced wrongly
(prime-rl's best-effort interleaving does the same).

Pure functions over plain data: no tokenizer, no deep-learning dependency.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetroll.results import RolloutResult, RoutedExperts, Trajectory, TrajectorySegment, Turn
from fleetroll.training.groups import Group

__all__ = ["routed_experts_list", "stitch", "training_rows"]

#: Added to a group's reward standard deviation, so a uniform group's
#: advantages are 0 rather than a division by zero.
ADVANTAGE_EPS = 1e-6


@dataclass(slots=True)
class _Building:
    """A segment being stitched (mutable, unlike the result's)."""

    first_turn: int
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    policy_versions: list[int | None] = field(default_factory=list)
    last_turn: int = 0

    def extend(self, ids: Sequence[int]) -> None:
        """Tokens the model did not produce (prompt, observation): masked out."""
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [None] * len(ids)
        self.policy_versions += [None] * len(ids)

    def generated(self, turn: Turn, ids: Sequence[int]) -> None:
        """The model's tokens of ``turn``: in the loss, with their logprobs and version."""
        logprobs: Sequence[float | None] = turn.logprobs or ()
        if len(logprobs) != len(ids):  # not returned (or unusable): null, not misaligned
            logprobs = [None] * len(ids)
        self.input_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.policy_versions += [turn.policy_version] * len(ids)
        self.last_turn = turn.index

    def done(self) -> TrajectorySegment:
        return TrajectorySegment(
            first_turn=self.first_turn,
            last_turn=self.last_turn,
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            policy_versions=self.policy_versions,
        )


def stitch(turns: Sequence[Turn]) -> Trajectory | None:
    """The rollout's token sequence, from its ``turns``.

    Each turn whose prompt ids start with everything stitched so far (the
    previous prompt and completion) adds what is new in its prompt (the
    observation, masked out) and its completion (in the loss). A turn whose
    prompt does not starts a new segment: ``drift`` is true and
    ``drift_turn`` is the first such turn's index.

    A call that asked for several choices (``n`` > 1: sibling turns, ``choice``
    1, 2, … after the first) adds one of them: the choice the next call's prompt
    continues, else its first. The others are in ``turns``, not in the
    trajectory.

    Returns None when there are no turns or a turn lacks its token ids (the
    server did not return them, or ``policy.return_token_ids`` is off).
    """
    if not turns or any(
        turn.prompt_token_ids is None or turn.completion_token_ids is None for turn in turns
    ):
        return None
    turns = _followed(turns)
    segments: list[TrajectorySegment] = []
    current: _Building | None = None
    drift_turn: int | None = None
    for turn in turns:
        prompt = turn.prompt_token_ids or []
        completion = turn.completion_token_ids or []
        if current is not None and prompt[: len(current.input_ids)] != current.input_ids:
            if drift_turn is None:
                drift_turn = turn.index
            segments.append(current.done())
            current = None
        if current is None:
            current = _Building(first_turn=turn.index)
            current.extend(prompt)
        else:
            current.extend(prompt[len(current.input_ids) :])
        current.generated(turn, completion)
    assert current is not None, "there is at least one turn"
    segments.append(current.done())
    first = segments[0]
    return _with_experts(
        turns,
        Trajectory(
            input_ids=first.input_ids,
            loss_mask=first.loss_mask,
            logprobs=first.logprobs,
            policy_versions=first.policy_versions,
            drift=drift_turn is not None,
            drift_turn=drift_turn,
            segments=segments if drift_turn is not None else [],
        ),
    )


def _with_experts(turns: Sequence[Turn], trajectory: Trajectory) -> Trajectory:
    """``trajectory`` with its tokens' routed experts, when some turn has them.

    Each token's row comes from the turn that added it to the sequence (its
    prompt's new part, from that turn's prefill; its completion, from its
    decoding), as stitching takes the ids; -1 rows for a turn without experts.
    """
    trajectory = _with_images(turns, trajectory)
    routed = [turn.routed_experts for turn in turns if turn.routed_experts is not None]
    if not routed:
        return trajectory
    layers, top_k = routed[0].layers, routed[0].top_k
    if any((r.layers, r.top_k) != (layers, top_k) for r in routed):
        return trajectory  # a model change mid-rollout: no one shape to give
    spans = [(s.first_turn, s.last_turn, len(s.input_ids)) for s in trajectory.segments]
    if not spans:
        spans = [(turns[0].index, turns[-1].index, len(trajectory.input_ids))]
    done = [
        _segment_experts([t for t in turns if first <= t.index <= last], length, layers, top_k)
        for first, last, length in spans
    ]
    if trajectory.segments:
        return trajectory.model_copy(
            update={
                "routed_experts": done[0],
                "segments": [
                    s.model_copy(update={"routed_experts": e})
                    for s, e in zip(trajectory.segments, done, strict=True)
                ],
            }
        )
    return trajectory.model_copy(update={"routed_experts": done[0]})


def _with_images(turns: Sequence[Turn], trajectory: Trajectory) -> Trajectory:
    """``trajectory`` (and each segment) with the images of its last turn's prompt:
    that prompt starts its ``input_ids``, so the spans hold there as they are."""
    if all(turn.images is None for turn in turns):
        return trajectory
    by_index = {turn.index: turn.images for turn in turns}
    if not trajectory.segments:
        return trajectory.model_copy(update={"images": by_index.get(turns[-1].index)})
    segments = [
        s.model_copy(update={"images": by_index.get(s.last_turn)}) for s in trajectory.segments
    ]
    return trajectory.model_copy(update={"images": segments[0].images, "segments": segments})


def _segment_experts(turns: Sequence[Turn], length: int, layers: int, top_k: int) -> RoutedExperts:
    """The rows of a segment's ``length`` tokens, stitched from its ``turns``."""
    stride = 2 * layers * top_k
    out = bytearray()
    for turn in turns:
        size = len(turn.prompt_token_ids or ()) + len(turn.completion_token_ids or ())
        raw = turn.routed_experts.raw() if turn.routed_experts is not None else b""
        if len(raw) != size * stride:
            raw = b"\xff" * (size * stride)  # no (usable) rows: -1
        # Rows the segment already has (the turn's prompt repeats them) are skipped.
        out += raw[len(out) :]
    out = out[: length * stride]
    return RoutedExperts.from_raw(bytes(out), layers=layers, top_k=top_k)


def routed_experts_list(value: RoutedExperts | dict[str, Any]) -> list[list[list[int]]]:
    """Routed experts (a row's ``routed_experts``, a turn's or a trajectory's) as
    nested lists ``[tokens][layers][top_k]``, -1 where the server returned none."""
    experts = value if isinstance(value, RoutedExperts) else RoutedExperts(**value)
    return experts.rows()


def _followed(turns: Sequence[Turn]) -> Sequence[Turn]:
    """One turn per call: of sibling choices, the one the next call's prompt extends
    (else the first). Turns as they are when no call has siblings."""
    if all(turn.choice == 0 for turn in turns):
        return turns
    calls: list[list[Turn]] = []
    for turn in turns:
        if turn.choice and calls:
            calls[-1].append(turn)
        else:
            calls.append([turn])
    followed: list[Turn] = []
    for number, siblings in enumerate(calls):
        chosen = siblings[0]
        if len(siblings) > 1 and number + 1 < len(calls):
            after = calls[number + 1][0].prompt_token_ids or []
            for turn in siblings:
                done = (turn.prompt_token_ids or []) + (turn.completion_token_ids or [])
                if after[: len(done)] == done:
                    chosen = turn
                    break
        followed.append(chosen)
    return followed


def training_rows(
    groups: Iterable[Group | Sequence[RolloutResult]], *, eps: float = ADVANTAGE_EPS
) -> list[dict[str, Any]]:
    """The rows a trainer consumes: one per scored rollout (one per segment when
    its chat template drifted), with its group-normalised advantage.

    ``advantage = (reward - mean) / (std + eps)`` over the group's rewards
    (population standard deviation, as :class:`~fleetroll.Group` reports it).
    Rollouts without a reward (infrastructure failures) or without token ids
    are left out; the others' trajectory is the result's ``trajectory``, or
    stitched from its ``turns`` when the setting was off.

    Each row is a plain dict: ``rollout_id``, ``group_id``, ``task_key``,
    ``segment`` (0 unless the template drifted), ``input_ids``, ``loss_mask``,
    ``logprobs`` (null where masked or not returned), ``policy_versions``,
    ``reward`` and ``advantage``; with a mixture-of-experts server that returned
    them, ``routed_experts`` too (:class:`~fleetroll.results.RoutedExperts` as a
    dict, aligned with ``input_ids``: decode with :func:`routed_experts_list`);
    with images (``policy.image_max_pixels``), ``images``: each image as the
    model saw it (:class:`~fleetroll.results.TurnImage` as a dict) with its
    placeholder span in ``input_ids``.

    Args:
        groups: :class:`~fleetroll.Group` objects (``batch.groups()``) or lists of results.
        eps: added to the standard deviation.
    """
    rows: list[dict[str, Any]] = []
    for group in groups:
        results = group.results if isinstance(group, Group) else list(group)
        scored = [r for r in results if r.reward is not None and math.isfinite(r.reward)]
        if not scored:
            continue
        rewards = [float(r.reward) for r in scored if r.reward is not None]
        mean = statistics.fmean(rewards)
        std = statistics.pstdev(rewards)
        for result, reward in zip(scored, rewards, strict=True):
            trajectory = result.trajectory or stitch(result.turns)
            if trajectory is None:
                continue
            parts: Sequence[TrajectorySegment | Trajectory] = trajectory.segments or [trajectory]
            for number, segment in enumerate(parts):
                rows.append(
                    {
                        "rollout_id": result.rollout_id,
                        "group_id": result.group_id,
                        "task_key": result.task_key,
                        "segment": number,
                        "input_ids": list(segment.input_ids),
                        "loss_mask": list(segment.loss_mask),
                        "logprobs": list(segment.logprobs),
                        "policy_versions": list(segment.policy_versions),
                        "reward": reward,
                        "advantage": (reward - mean) / (std + eps),
                    }
                )
                if segment.images is not None:
                    # Each image (base64 PNG, as the model saw it) and its span in input_ids.
                    rows[-1]["images"] = [image.model_dump() for image in segment.images]
                if segment.routed_experts is not None:
                    # Compact (base64 int16 [tokens, layers, top_k]): routed_experts_list
                    # or numpy.frombuffer decodes it; absent without experts.
                    rows[-1]["routed_experts"] = segment.routed_experts.model_dump()
    return rows
