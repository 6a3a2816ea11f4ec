"""``policy.token_in = "completions"`` without a server: the hermes tool parser,
the setting's values, and prompts rendered with the tiny model's own template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetroll.errors import ConfigError, PolicyError
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.policies.tool_parsers import parse_hermes
from fleetroll.policies.turns import TokenTurn
from fleetroll.settings import load_settings


def hermes(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_valid_call_is_parsed_with_its_arguments_as_json() -> None:
    content, calls = parse_hermes(hermes("get_balance", {"account": "Checking"}))
    assert content is None
    [only] = calls
    assert (only.name, dict(only.arguments)) == ("get_balance", {"account": "Checking"})
    assert only.raw_arguments == '{"account": "Checking"}' and only.arguments_error is None
    assert only.id.startswith("call_")


def test_several_calls_and_the_text_before_them() -> None:
    text = "Checking first.\n" + hermes("a", {"x": 1}) + "\n" + hermes("b", {})
    content, calls = parse_hermes(text)
    assert content == "Checking first.\n"
    assert [(c.name, dict(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert len({c.id for c in calls}) == 2


def test_an_unclosed_last_call_still_counts() -> None:
    _, calls = parse_hermes('<tool_call>\n{"name": "a", "arguments": {"k": "v"}}')
    assert [(c.name, dict(c.arguments)) for c in calls] == [("a", {"k": "v"})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "a", "arguments": {"k": }\n</tool_call>',  # bad JSON
        '<tool_call>\n["a"]\n</tool_call>',  # not an object
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        hermes("a", {}) + '<tool_call>{"name": "b", "arg',  # one good, one cut
    ],
    ids=["malformed_json", "not_an_object", "no_name", "one_bad_of_two"],
)
def test_a_malformed_call_leaves_the_whole_text_as_content_as_vllm_does(text: str) -> None:
    assert parse_hermes(text) == (text, ())


def test_text_without_calls_is_content_and_empty_text_none() -> None:
    assert parse_hermes("done") == ("done", ())
    assert parse_hermes("") == (None, ())


def test_arguments_that_are_no_object_are_flagged_as_on_the_chat_route() -> None:
    _, [only] = parse_hermes(hermes("a", [1, 2]))
    assert only.arguments == {} and only.arguments_error is not None
    assert "not a JSON object" in only.arguments_error


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("completions", "completions"), ("true", True), ("0", False)],
)
def test_token_in_takes_booleans_and_completions(value: object, expected: object) -> None:
    assert load_settings(policy={"token_in": value}).policy.token_in == expected


def test_any_other_token_in_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r'policy\.token_in must be true, false or "completions"'):
        load_settings(policy={"token_in": "tokens"})


def test_completions_without_max_tokens_or_with_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs policy\.max_tokens"):
        OpenAIChatPolicy(base_url="http://127.0.0.1:9/v1", model="m", token_in="completions")
    with pytest.raises(ValueError, match="no tool parser 'mistral'"):
        OpenAIChatPolicy(base_url="http://127.0.0.1:9/v1", model="m", tool_parser="mistral")


# -- rendering with the tiny model's template (needs transformers)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from fleetroll.testing.tiny_model import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny") / "tiny-qwen2"
    build_tiny_tokenizer().save_pretrained(path)  # the tokenizer alone: no model to build
    return path


async def test_the_next_prompt_is_the_ids_sent_and_generated_then_the_tool_answers(
    model_dir: Path,
) -> None:
    from fleetroll.policies.chat_template import load_template
    from fleetroll.policies.token_in import local_prompt

    template = await load_template(str(model_dir))
    assert await load_template(str(model_dir)) is template  # once per process
    tools = [{"type": "function", "function": {"name": "a", "parameters": {}}}]
    user = {"role": "user", "content": "hi"}
    body = {"model": "m", "messages": [user], "tools": tools}
    first = local_prompt(template, body, None, added=0)
    tokenizer = template.tokenizer
    expected = tokenizer.apply_chat_template(
        [user], tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert first.ids == tokenizer.encode(expected, add_special_tokens=False)
    # What the model "generated": not what the template would render (two spaces).
    generated = tokenizer.encode(
        '<tool_call>\n{"name":  "a", "arguments": {}}\n</tool_call><|im_end|>',
        add_special_tokens=False,
    )
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "a", "arguments": "{}"}}
        ],
    }
    answer = {"role": "tool", "tool_call_id": "c", "content": "42"}
    body["messages"] = [user, assistant, answer]
    history = TokenTurn(
        index=1,
        prompt_token_ids=tuple(first.ids),
        completion_token_ids=tuple(generated),
        finish_reason="stop",
    )
    second = local_prompt(template, body, history, added=0)
    rest = tokenizer.encode(
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    assert second.ids == [*first.ids, *generated, *rest] and not second.rerendered


async def test_a_tokenizer_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from fleetroll.policies.chat_template import load_template

    with pytest.raises(PolicyError) as caught:
        await load_template(str(tmp_path / "nowhere"))
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"policy.tokenizer {str(tmp_path / 'nowhere')!r}")


#: A template that strips an earlier assistant message's reasoning (as Qwen3's
#: does), so the history renders differently once new messages follow it.
STRIPPING = (
    "{%- for message in messages %}{%- set content = message.content or '' %}"
    "{%- if message.role == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_rerenders_history_keeps_the_ids_sent_and_says_so(
    model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    from fleetroll.policies.chat_template import ChatTemplate
    from fleetroll.policies.token_in import local_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = STRIPPING
    template = ChatTemplate(tokenizer, "stripping")
    user = {"role": "user", "content": "hi"}
    first = local_prompt(template, {"model": "m", "messages": [user]}, None, added=0)
    generated = tokenizer.encode("<think>hmm</think>ok<|im_end|>", add_special_tokens=False)
    assistant = {"role": "assistant", "content": "<think>hmm</think>ok"}
    body = {"model": "m", "messages": [user, assistant, {"role": "tool", "content": "42"}]}
    history = TokenTurn(
        index=1,
        prompt_token_ids=tuple(first.ids),
        completion_token_ids=tuple(generated),
        finish_reason="stop",
    )
    second = local_prompt(template, body, history, added=0)
    rest = tokenizer.encode(
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert second.rerendered
    assert second.ids == [*first.ids, *generated, *rest]
