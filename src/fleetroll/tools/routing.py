"""Routing by modality: which MCP endpoint, which tools the agent sees.

The table lives in config (``[modalities.*]``, docs/configuration.md), not in code
branches: a modality names an endpoint template over the instance's
``urls.root`` and a tool filter. A synthetic ``submit_final_answer`` tool is
offered when the task asks for a final answer, its verifier takes a
``final_answer`` parameter, or its prompt names the tool (as Fleet's reference
does); the rollout handles it locally.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

from fleetroll.errors import ComputerToolMissing, ToolsError
from fleetroll.policies import ToolSpec
from fleetroll.settings import ModalitySettings

__all__ = [
    "COMPUTER_TOOL",
    "SUBMIT_FINAL_ANSWER",
    "ComputerToolMissing",
    "Route",
    "route",
    "wants_final_answer",
]

COMPUTER_TOOL = "computer"

SUBMIT_FINAL_ANSWER = ToolSpec(
    name="submit_final_answer",
    description=(
        "Submit your final answer to the task. This ends the episode; "
        "call it once, when you are done."
    ),
    input_schema={
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "Your final answer."}},
        "required": ["answer"],
    },
)


#: Whether a verifier's source takes ``final_answer``, by source (bounded).
_TAKES_ANSWER: dict[str, bool] = {}
_TAKES_ANSWER_MAX = 1024


def _verifier_takes_answer(code: str) -> bool:
    """Whether the verifier (the first top-level function) has a ``final_answer``
    parameter, read from its syntax tree: the code is never run."""
    if "final_answer" not in code:  # the common case costs no parse
        return False
    known = _TAKES_ANSWER.get(code)
    if known is not None:
        return known
    takes = False
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        tree = None  # the verifier reports it when it runs
    for node in tree.body if tree else ():
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            takes = any(p.arg == "final_answer" for p in a.posonlyargs + a.args + a.kwonlyargs)
            break
    if len(_TAKES_ANSWER) >= _TAKES_ANSWER_MAX:
        _TAKES_ANSWER.clear()
    _TAKES_ANSWER[code] = takes
    return takes


def wants_final_answer(*, requires: bool, verifier: str | None, prompt: str) -> bool:
    """Whether a task's rollouts are offered ``submit_final_answer``: the task asks
    for it, its verifier takes ``final_answer``, or its prompt names the tool."""
    return (
        requires
        or SUBMIT_FINAL_ANSWER.name in prompt
        or (verifier is not None and _verifier_takes_answer(verifier))
    )


@dataclass(frozen=True, slots=True)
class Route:
    """Where one rollout's tool calls go, and what the agent may call."""

    modality: str
    url: str
    tools: str  # "api" or "computer"
    offers_final_answer: bool

    def select(self, available: Sequence[ToolSpec]) -> list[ToolSpec]:
        """The tools the agent sees, in the endpoint's order.

        Raises:
            ComputerToolMissing: the modality needs ``computer`` and there is none.
            ToolsError: no usable tool at all.
        """
        if self.tools == "computer":
            chosen = [t for t in available if t.name == COMPUTER_TOOL]
            if not chosen:
                names = ", ".join(t.name for t in available) or "none"
                raise ComputerToolMissing(
                    f"{self.modality} needs a {COMPUTER_TOOL!r} tool at {self.url}; "
                    f"it offers: {names}",
                    operation="list_tools",
                )
        else:
            chosen = [t for t in available if t.name != COMPUTER_TOOL]
            if not chosen:
                raise ToolsError(f"no tools at {self.url}", operation="list_tools")
        if self.offers_final_answer:
            chosen.append(SUBMIT_FINAL_ANSWER)
        return chosen


def route(
    modality: str, table: dict[str, ModalitySettings], root_url: str, *, final_answer: bool
) -> Route:
    """The route of a rollout of ``modality`` on an instance at ``root_url``.

    Raises:
        KeyError: the modality is not in the table (tasks are validated
            against it when loaded, so this is a programming error).
    """
    row = table[modality]
    return Route(
        modality=modality,
        url=row.endpoint.format(root=root_url),
        tools=row.tools,
        offers_final_answer=final_answer,
    )
