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
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from fleetroll.results import (
    FailureReason,
    RolloutResult,
    RoutedExperts,
    Trajectory,
    TrajectorySegment,
    Turn,
    TurnImage,
)
from fleetroll.training.groups import Group

__all__ = [
    "DRIFT_POLICIES",
    "ROW_STATUSES",
    "Drift",
    "RowStatus",
    "routed_experts_list",
    "row_images",
    "stitch",
    "training_rows",
]

#: Added to a group's reward standard deviation, so a uniform group's
#: advantages are 0 rather than a division by zero.
ADVANTAGE_EPS = 1e-6

#: What :func:`training_rows` with ``group_size`` makes of a drifted rollout.
Drift = Literal["drop", "first_segment", "last_turn"]
DRIFT_POLICIES: tuple[str, ...] = get_args(Drift)

#: A row's ``status`` (:func:`training_rows` with ``group_size``): ``scored``
#: (trained on: its model tokens under the mask), ``failed`` (no reward: an
#: infrastructure failure), ``padding`` (no rollout: the group had fewer
#: results than rows), and scored rollouts whose row has no completion:
#: ``drift_dropped`` (``drift="drop"``), ``no_token_ids`` (the server returned
#: none), ``unusable`` (a turn's ``training_data_error``).
RowStatus = Literal["scored", "failed", "padding", "drift_dropped", "no_token_ids", "unusable"]
ROW_STATUSES: tuple[str, ...] = get_args(RowStatus)


@dataclass(slots=True)
class _Building:
    """A segment being stitched (mutable, unlike the result's)."""

    first_turn: int
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    policy_versions: list[int | None] = field(default_factory=list)
    token_versions: list[int | None] = field(default_factory=list)
    last_turn: int = 0

    def extend(self, ids: Sequence[int]) -> None:
        """Tokens the model did not produce (prompt, observation): masked out."""
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [None] * len(ids)
        self.policy_versions += [None] * len(ids)
        self.token_versions += [None] * len(ids)

    def generated(self, turn: Turn, ids: Sequence[int]) -> None:
        """The model's tokens of ``turn``: in the loss, with their logprobs and version."""
        logprobs: Sequence[float | None] = turn.logprobs or ()
        if len(logprobs) != len(ids):  # not returned (or unusable): null, not misaligned
            logprobs = [None] * len(ids)
        self.input_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.policy_versions += [turn.policy_version] * len(ids)
        versions: Sequence[int | None] = turn.token_versions or ()
        if len(versions) != len(ids):  # not recorded: null, never guessed
            versions = [None] * len(ids)
        self.token_versions += versions
        self.last_turn = turn.index

    def done(self) -> TrajectorySegment:
        return TrajectorySegment(
            first_turn=self.first_turn,
            last_turn=self.last_turn,
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            policy_versions=self.policy_versions,
            token_versions=self.token_versions,
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
            token_versions=first.token_versions,
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
    groups: Iterable[Group | Sequence[RolloutResult]],
    *,
    eps: float = ADVANTAGE_EPS,
    group_size: int | None = None,
    drift: Drift = "first_segment",
) -> list[dict[str, Any]]:
    """The rows a trainer consumes, with group-normalised advantages.

    ``advantage = (reward - mean) / (std + eps)`` over the group's scored
    rewards (population standard deviation, as :class:`~fleetroll.Group`
    reports it). A result's sequence is its ``trajectory``, or stitched from
    its ``turns`` when ``policy.trajectory`` was off.

    **With** ``group_size=G`` (the trainer's shape, e.g. TRL's
    ``num_generations``): exactly G rows per group, in ``sample_index`` order,
    one sequence per rollout, split into the prompt (the ids before the first
    generated token: turn 0's prompt) and the completion (the rest: the
    model's tokens under ``completion_mask`` 1, tool answers and template
    tokens under 0). A group's rows are its scored results (the G
    lowest-ranked, as the group keeps them; ``superseded`` results never
    appear), then, to fill G, its unscored ones (infrastructure failures,
    lowest-ranked first) as rows with reward None, advantage 0.0 and no
    completion, then ``padding`` rows when fewer than G results remain (a
    :class:`~fleetroll.Group` holds only its scored results: pass the group's
    results instead to have each failure's row carry its rollout). ``drift``
    says what to do with a rollout whose chat template re-rendered its
    history (``trajectory.drift``; ``policy.token_in`` avoids it):

    - ``"drop"``: the rollout's row has no completion (status ``drift_dropped``);
    - ``"first_segment"``: the first consistent segment (the later model
      tokens are dropped and counted);
    - ``"last_turn"``: the last turn alone, its prompt ids and completion.

    Each row is a plain dict: ``rollout_id``, ``group_id``, ``task_key``,
    ``sample_index``, ``prompt_ids``, ``completion_ids``, ``completion_mask``,
    ``completion_logprobs`` (None where masked or not returned),
    ``completion_policy_versions`` (None where masked),
    ``completion_token_versions`` (the version of the weights that produced
    each token, None where masked or unproven), ``reward`` (None
    unless scored), ``advantage``, ``status`` (:data:`ROW_STATUSES`),
    ``failure_reason``, ``dropped_tokens`` (the rollout's model tokens not
    under this row's mask) and ``drift`` (None, or the drift turn, the number
    of segments, the policy applied and the model tokens it dropped). The
    lists are aligned, one entry per completion token. With a
    mixture-of-experts server that returned them, ``routed_experts`` too
    (:class:`~fleetroll.results.RoutedExperts` as a dict, aligned with
    ``prompt_ids + completion_ids``: decode with :func:`routed_experts_list`);
    with images (``policy.image_max_pixels``), ``images``: each image as the
    model saw it (:class:`~fleetroll.results.TurnImage` as a dict) with its
    placeholder span in ``prompt_ids + completion_ids`` (its PNG inline, or,
    read from a ``policy.image_store = "files"`` journal, a file beside it:
    :func:`row_images` gives the bytes either way). Both keys are absent
    otherwise.

    **Without** ``group_size`` (the rows of earlier versions): one row per
    scored rollout with token ids, one per segment when it drifted, with
    ``segment``, ``input_ids``, ``loss_mask``, ``logprobs``,
    ``policy_versions``, ``token_versions`` (the version that produced each
    token, None where masked or unproven), ``reward`` and ``advantage`` (and
    ``routed_experts`` and ``images`` as above, aligned with ``input_ids``);
    unscored rollouts are left out (``drift`` is not used).

    Args:
        groups: :class:`~fleetroll.Group` objects (``batch.groups()``) or
            lists of one group's results (with ``group_size``, all of them:
            failures and ``superseded`` ones included).
        eps: added to the standard deviation.
        group_size: the rows each group must give (G >= 1); None: the rows above.
        drift: what a drifted rollout's row holds (with ``group_size``).

    Raises:
        ValueError: ``group_size`` < 1, an unknown ``drift``, or a list whose
            results belong to different groups.
    """
    if drift not in DRIFT_POLICIES:
        raise ValueError(
            f"drift must be one of {', '.join(map(repr, DRIFT_POLICIES))}, not {drift!r}"
        )
    if group_size is None:
        return _segment_rows(groups, eps)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"group_size must be an integer >= 1 (the rows per group), not {group_size!r}"
        )
    rows: list[dict[str, Any]] = []
    for group in groups:
        rows += _group_rows(group, group_size, drift, eps)
    return rows


def _scored(result: RolloutResult) -> bool:
    return result.reward is not None and math.isfinite(result.reward)


def _group_rows(
    group: Group | Sequence[RolloutResult], size: int, drift: Drift, eps: float
) -> list[dict[str, Any]]:
    """Exactly ``size`` rows for one group, in sample order (padding last)."""
    if isinstance(group, Group):
        results = list(group.results)
        group_id: str | None = group.group_id
        task_key: str | None = group.task_key
    else:
        results = list(group)
        owners = {(r.group_id, r.task_key) for r in results}
        if len(owners) > 1:
            keys = ", ".join(sorted({repr(key) for _, key in owners}))
            raise ValueError(
                f"a group's results must be of one group (one task of one batch), not of {keys}:"
                " pass one list per group"
            )
        group_id, task_key = next(iter(owners), (None, None))
    live = [r for r in results if r.failure_reason is not FailureReason.SUPERSEDED]
    scored = sorted((r for r in live if _scored(r)), key=lambda r: r.sample_index)[:size]
    failed = sorted((r for r in live if not _scored(r)), key=lambda r: r.sample_index)
    kept = sorted(scored + failed[: size - len(scored)], key=lambda r: r.sample_index)
    rewards = [float(r.reward) for r in scored if r.reward is not None]
    mean = statistics.fmean(rewards) if rewards else 0.0
    std = statistics.pstdev(rewards) if rewards else 0.0
    rows = []
    for result in kept:
        row = _rollout_row(result, drift)
        if _scored(result):
            reward = float(result.reward or 0.0)
            row["reward"] = reward
            row["advantage"] = (reward - mean) / (std + eps)
        rows.append(row)
    rows += [_padding_row(group_id, task_key) for _ in range(size - len(kept))]
    return rows


def _row(
    result: RolloutResult | None,
    status: RowStatus,
    prompt: Sequence[int] = (),
    completion: TrajectorySegment | None = None,
) -> dict[str, Any]:
    """A row of ``result`` (None: padding): ``completion``, a sequence, split at
    its first model token into the prompt and the completion; without one,
    ``prompt`` and no completion. Reward None and advantage 0.0 until scored."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float | None] = []
    versions: list[int | None] = []
    token_versions: list[int | None] = []
    if completion is not None:
        start = next(
            (i for i, m in enumerate(completion.loss_mask) if m), len(completion.input_ids)
        )
        prompt = completion.input_ids[:start]
        ids = completion.input_ids[start:]
        mask = completion.loss_mask[start:]
        logprobs = completion.logprobs[start:]
        versions = completion.policy_versions[start:]
        token_versions = completion.token_versions[start:]
        if len(completion.token_versions) != len(completion.input_ids):  # none recorded
            token_versions = [None] * len(ids)
    row: dict[str, Any] = {
        "rollout_id": None if result is None else result.rollout_id,
        "group_id": None if result is None else result.group_id,
        "task_key": None if result is None else result.task_key,
        "sample_index": None if result is None else result.sample_index,
        "prompt_ids": list(prompt),
        "completion_ids": list(ids),
        "completion_mask": list(mask),
        "completion_logprobs": list(logprobs),
        "completion_policy_versions": list(versions),
        "completion_token_versions": list(token_versions),
        "reward": None,
        "advantage": 0.0,
        "status": status,
        "failure_reason": (
            None if result is None or result.failure_reason is None else result.failure_reason.value
        ),
        "dropped_tokens": 0,
        "drift": None,
    }
    if completion is not None and completion.routed_experts is not None:
        # Compact (base64 int16 [tokens, layers, top_k]), aligned with
        # prompt_ids + completion_ids; absent without experts.
        row["routed_experts"] = completion.routed_experts.model_dump()
    if completion is not None and completion.images is not None:
        # Each image (base64 PNG, or its file: row_images), its span in prompt_ids + completion_ids.
        row["images"] = [image.model_dump() for image in completion.images]
    return row


def _padding_row(group_id: str | None, task_key: str | None) -> dict[str, Any]:
    row = _row(None, "padding")
    row.update(group_id=group_id, task_key=task_key)
    return row


def _rollout_row(result: RolloutResult, drift: Drift) -> dict[str, Any]:
    """One rollout's row, reward and advantage left to the group."""
    turns = _followed(result.turns) if result.turns else []
    first_prompt = (turns[0].prompt_token_ids or []) if turns else []
    generated = sum(len(turn.completion_token_ids or ()) for turn in turns)
    if not _scored(result):
        row = _row(result, "failed", first_prompt)
    else:
        trajectory = result.trajectory or stitch(result.turns)
        if trajectory is None:
            row = _row(result, "no_token_ids", first_prompt)
        elif any(turn.training_data_error is not None for turn in turns):
            row = _row(result, "unusable", first_prompt)
        elif not trajectory.drift:
            row = _row(result, "scored", completion=_whole(trajectory))
        else:
            if drift == "drop":
                row = _row(result, "drift_dropped", first_prompt)
            elif drift == "first_segment":
                row = _row(result, "scored", completion=_whole(trajectory))
            else:
                last = _Building(first_turn=turns[-1].index)
                last.extend(turns[-1].prompt_token_ids or [])
                last.generated(turns[-1], turns[-1].completion_token_ids or [])
                alone = last.done().model_copy(
                    update={"routed_experts": turns[-1].routed_experts, "images": turns[-1].images}
                )
                row = _row(result, "scored", completion=alone)
            row["drift"] = {
                "turn": trajectory.drift_turn,
                "segments": len(trajectory.segments),
                "policy": drift,
                "dropped_tokens": generated - sum(row["completion_mask"]),
            }
    row["dropped_tokens"] = generated - sum(row["completion_mask"])
    return row


def _whole(trajectory: Trajectory) -> TrajectorySegment:
    """A trajectory's top-level sequence (its first segment, with drift) as a segment."""
    return TrajectorySegment(
        first_turn=0,
        last_turn=0,
        input_ids=trajectory.input_ids,
        loss_mask=trajectory.loss_mask,
        logprobs=trajectory.logprobs,
        policy_versions=trajectory.policy_versions,
        token_versions=trajectory.token_versions,
        routed_experts=trajectory.routed_experts,
        images=trajectory.images,
    )


def _segment_rows(
    groups: Iterable[Group | Sequence[RolloutResult]], eps: float
) -> list[dict[str, Any]]:
    """``training_rows`` without ``group_size``: one row per scored segment."""
    rows: list[dict[str, Any]] = []
    for group in groups:
        results = group.results if isinstance(group, Group) else list(group)
        scored = [r for r in results if _scored(r)]
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
                        "token_versions": list(segment.token_versions),
                        "reward": reward,
                        "advantage": (reward - mean) / (std + eps),
                    }
                )
                if segment.images is not None:
                    # Each image (base64 PNG, or its file: row_images) and its span in input_ids.
                    rows[-1]["images"] = [image.model_dump() for image in segment.images]
                if segment.routed_experts is not None:
                    # Compact (base64 int16 [tokens, layers, top_k]): routed_experts_list
                    # or numpy.frombuffer decodes it; absent without experts.
                    rows[-1]["routed_experts"] = segment.routed_experts.model_dump()
    return rows


def row_images(
    row: Mapping[str, Any], *, journal: str | os.PathLike[str] | None = None
) -> list[bytes]:
    """The PNG bytes of a training row's images (its ``images``), in order, as
    the model saw them: decoded when inline, read from their files beside
    ``journal`` (the results file the row's rollout was read from) when the
    journal keeps them as files (``policy.image_store = "files"``), each
    checked against its SHA-256. Empty when the row has no images.

    Raises:
        ValueError: an image is a file and ``journal`` is None, or a file's
            bytes are not its image's.
        OSError: a file cannot be read.
    """
    root = None if journal is None else Path(journal).parent
    return [TurnImage.model_validate(image).png(root) for image in row.get("images") or ()]
