"""The model's chat template, rendered on fleetroll's side (``policy.token_in = "completions"``).

:class:`ChatTemplate` holds the model's own Hugging Face tokenizer
(``policy.tokenizer``: a local directory or a hub name), loaded once per
process (a Ray actor loads its own) in a worker thread, and renders a
conversation to token ids as vLLM's chat route would: messages prepared as
vLLM prepares them (tool calls' JSON arguments as objects, content parts
joined), the template applied as text, then encoded without special tokens
added.

Needs ``transformers`` (the ``train`` extra); without it, or with a path that
holds no tokenizer, loading raises one :class:`~fleetroll.errors.PolicyError`
line saying so.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio.to_thread

from fleetroll.errors import PolicyError
from fleetroll.policies.chat_http import OPERATION
from fleetroll.policies.turns import Message

__all__ = ["ChatTemplate", "load_template"]

_LOCK = threading.Lock()
_LOADED: dict[str, ChatTemplate] = {}


class ChatTemplate:
    """A tokenizer with a chat template, and what the template ends a message with.

    Args:
        tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
        name: where it was loaded from (named in errors).
    """

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        #: Where a completion stops: the tokenizer's end of sequence and, when
        #: the vocabulary has it, ChatML's end of message ``<|im_end|>``.
        ends = {tokenizer.eos_token_id}
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if im_end != tokenizer.unk_token_id:
            ends.add(im_end)
        self.stop_ids = tuple(sorted(i for i in ends if isinstance(i, int)))

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        generation: bool,
    ) -> list[int]:
        """``messages`` (and ``tools``, OpenAI's shape) as the template renders
        them, in token ids; with ``generation``, the assistant's prompt after.

        Raises:
            PolicyError: the template failed on these messages (not transient).
        """
        try:
            text = self.tokenizer.apply_chat_template(
                _template_messages(messages),
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=generation,
            )
        except Exception as exc:  # jinja's errors have no common base
            raise PolicyError(
                f"the chat template of policy.tokenizer {self.name!r} failed: {exc}",
                operation=OPERATION,
                transient=False,
            ) from None
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids, special tokens (the end of message) left out."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


async def load_template(name: str) -> ChatTemplate:
    """The tokenizer ``name`` (a directory or a hub name), loaded once per
    process in a worker thread.

    Raises:
        PolicyError: transformers is not installed, or ``name`` holds no
            tokenizer with a chat template (not transient; one line).
    """
    loaded = _LOADED.get(name)
    if loaded is not None:
        return loaded
    return await anyio.to_thread.run_sync(_load, name)


def _load(name: str) -> ChatTemplate:
    with _LOCK:
        loaded = _LOADED.get(name)
        if loaded is not None:
            return loaded
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise PolicyError(
                'policy.token_in = "completions" renders the chat template with the'
                " model's tokenizer, which needs transformers: pip install"
                " 'fleetroll[train]' (or transformers)",
                operation=OPERATION,
                transient=False,
            ) from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as exc:  # OSError, ValueError, hub errors: all say "not there"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PolicyError(
                f"policy.tokenizer {name!r} could not be loaded ({first}): give the"
                " directory of the model's tokenizer (save_pretrained) or its hub name",
                operation=OPERATION,
                transient=False,
            ) from None
        if not getattr(tokenizer, "chat_template", None):
            raise PolicyError(
                f"policy.tokenizer {name!r} has no chat template: token-in renders"
                " the conversation with the model's own template",
                operation=OPERATION,
                transient=False,
            )
        made = _LOADED[name] = ChatTemplate(tokenizer, name)
        return made


def _template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as a Hugging Face template takes them (as vLLM prepares them):
    tool calls' JSON ``arguments`` decoded to objects, content parts joined."""
    prepared = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(
                str(part.get("text", "")) for part in content if isinstance(part, Mapping)
            )
        calls = []
        for call in message.get("tool_calls") or ():
            call = json.loads(json.dumps(call, default=dict))
            function = call.get("function") or {}
            if isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError):  # else rendered as the string it is
                    function["arguments"] = json.loads(function["arguments"])
            calls.append(call)
        if calls:
            message["tool_calls"] = calls
        prepared.append(message)
    return prepared
