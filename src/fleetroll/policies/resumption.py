"""An aborted generation's parts joined into one turn (``policy.weight_update = "abort"``).

A weight update that aborts a generation on the server leaves a partial
answer (``finish_reason: "abort"``); the policy resumes it on the new weights
from the tokens kept (:meth:`~fleetroll.policies.openai.OpenAIChatPolicy.act`),
maybe more than once. :func:`part_versions` says which weights produced each
part's tokens, and :func:`joined` makes the parts one turn, each token with
its version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleetroll.policies.turns import AssistantTurn, TurnData

__all__ = ["joined", "part_versions"]


def part_versions(data: TurnData, version: int | None) -> list[int | None]:
    """The versions of a part's tokens: the server's when it says, else the
    version the part started on (an abort lands before any update applies)."""
    ids = data.completion_token_ids or ()
    if data.token_versions is not None:
        return list(data.token_versions)
    return [version] * len(ids)


def joined(
    parts: Sequence[AssistantTurn],
    versions: Sequence[Sequence[int | None]],
    prompt: tuple[int, ...],
    note: str | None,
    ended: str | None,
) -> AssistantTurn:
    """One turn of an aborted call's parts: their tokens, logprobs and versions in
    order, the text joined, the tool calls of every part, the last part's ending
    (``ended`` instead, when given) and routed experts (when they cover the turn)."""
    datas = [part.data for part in parts if part.data is not None]
    last = datas[-1] if datas else None

    def chained(name: str) -> tuple[Any, ...] | None:
        values = [getattr(data, name) for data in datas]
        if any(value is None for value in values):
            return None
        return tuple(item for value in values for item in value)

    usage: dict[str, int] = {}
    for part in parts:
        for key, value in (part.usage or {}).items():
            usage[key] = usage.get(key, 0) + value
    if parts and parts[0].usage and "prompt_tokens" in parts[0].usage:
        usage["prompt_tokens"] = len(prompt)
    content = "".join(part.content or "" for part in parts) or None
    completion = chained("completion_token_ids")
    # The last part's prompt is the whole prompt and the tokens kept, so its
    # routed experts cover the joined turn (the kept tokens' rows as the
    # resumption's prefill routed them).
    experts = last.routed_experts if last else None
    if experts is not None and experts.tokens != len(prompt) + len(completion or ()):
        experts = None
    data = TurnData(
        model=last.model if last else None,
        finish_reason=ended or (last.finish_reason if last else None),
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=chained("logprobs"),
        top_logprobs=chained("top_logprobs"),
        training_data_error="; ".join(d.training_data_error for d in datas if d.training_data_error)
        or None,
        token_versions=tuple(v for vs in versions for v in vs),
        token_versions_note=note,
        routed_experts=experts,
    )
    return AssistantTurn(
        content=content,
        tool_calls=tuple(call for part in parts for call in part.tool_calls),
        usage=usage or None,
        data=data,
    )
