"""Reward components: the weighted sum, the checks, and the judge over real HTTP (fake judge)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from pydantic import SecretStr

from fleetroll._internal.retrying import Budget
from fleetroll.errors import JudgeError
from fleetroll.scoring import Judge, JudgeConfig, ScoreInputs, Scorer, combine
from fleetroll.scoring.checks import check, render, target_text
from fleetroll.scoring.judge import SYSTEM_PROMPT, judge_messages, parse_score
from fleetroll.tasks.records import Where
from fleetroll.tasks.rewards import RewardSpec, parse_rewards
from fleetroll.testing.fake_judge import FakeJudge, judged, toy_score

TRANSCRIPT: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 6 x 7?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c0", "content": "42"},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
    {"role": "assistant", "content": "It is 42."},
]
INPUTS = ScoreInputs("What is 6 x 7?", TRANSCRIPT, final_answer='{"answer": 42}', steps=1)


def specs(*components: dict[str, Any]) -> tuple[RewardSpec, ...]:
    parsed = parse_rewards(list(components), Where("t.jsonl", line=1))
    assert parsed is not None
    return parsed


def config(base_url: str | None, **changes: Any) -> JudgeConfig:
    fields: dict[str, Any] = {"timeout_s": 10.0, "budget": Budget(3, 0.0, 0.0)}
    fields.update(changes)
    return JudgeConfig(base_url=base_url, model="judge-model", **fields)


# -- the sum ----------------------------------------------------------------------


def test_the_reward_is_the_weighted_sum_of_the_components_not_normalised() -> None:
    components = specs(
        {"name": "a", "kind": "verifier", "weight": 0.5},
        {"name": "b", "kind": "max_turns", "max": 1, "weight": 2.0},
        {"name": "c", "kind": "contains", "text": "x", "weight": -0.25},
    )

    assert combine(components, {"a": 0.8, "b": 1.0, "c": 1.0}) == 0.5 * 0.8 + 2.0 - 0.25
    assert combine(components, {"a": 0.8, "b": None, "c": 1.0}) is None
    assert combine(components, {"a": 0.8, "b": 1.0}) is None


# -- checks -----------------------------------------------------------------------


def test_the_transcript_renders_as_text_with_calls_tool_answers_and_images() -> None:
    text = render(TRANSCRIPT)

    assert text.split("\n\n") == [
        "[user] What is 6 x 7?",
        "[assistant calls calc] {}",
        "[tool c0] 42",
        "[user] [image]",
        "[assistant] It is 42.",
    ]
    assert target_text("last_message", INPUTS) == "It is 42."
    assert target_text("final_answer", INPUTS) == '{"answer": 42}'


@pytest.mark.parametrize(
    ("component", "value"),
    [
        ({"kind": "regex", "pattern": r'"answer":\s*42'}, 1.0),
        ({"kind": "regex", "pattern": "^ANSWER"}, 0.0),
        ({"kind": "regex", "pattern": "IT IS", "on": "last_message", "ignore_case": True}, 1.0),
        ({"kind": "contains", "text": "42", "on": "transcript"}, 1.0),
        ({"kind": "contains", "text": "It is", "on": "last_message"}, 1.0),
        ({"kind": "contains", "text": "it is", "on": "last_message"}, 0.0),
        ({"kind": "contains", "text": "it is", "on": "last_message", "ignore_case": True}, 1.0),
        ({"kind": "json_schema", "schema": {"type": "object", "required": ["answer"]}}, 1.0),
        ({"kind": "json_schema", "schema": {"type": "object", "required": ["why"]}}, 0.0),
        ({"kind": "json_schema", "schema": {"type": "object"}, "on": "last_message"}, 0.0),
        ({"kind": "max_turns", "max": 1}, 1.0),
        ({"kind": "max_turns", "max": 0}, 0.0),
    ],
)
def test_each_check_holds_or_not(component: dict[str, Any], value: float) -> None:
    (spec,) = specs({"name": "c", **component})

    assert check(spec, INPUTS) == value


def test_a_check_on_a_final_answer_that_was_never_given_does_not_hold() -> None:
    (spec,) = specs({"name": "c", "kind": "regex", "pattern": ".*"})
    no_answer = ScoreInputs("p", TRANSCRIPT, final_answer=None, steps=0)

    assert check(spec, no_answer) == 0.0


# -- the judge's answer -----------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "score"),
    [
        ('{"score": 0.75, "reason": "ok"}', 0.75),
        ('```json\n{"score": 1, "reason": "ok"}\n```', 1.0),
        ('Here it is: {"score": 0} — done', 0.0),
    ],
)
def test_a_score_is_read_from_json_fenced_or_not(content: str, score: float) -> None:
    assert parse_score(content)[0] == score


@pytest.mark.parametrize(
    "content",
    ["great work", '{"reason": "no score"}', '{"score": 1.5}', '{"score": "high"}', "[0.5]"],
)
def test_an_answer_without_a_score_in_0_1_is_refused(content: str) -> None:
    with pytest.raises(ValueError):
        parse_score(content)


def test_the_judge_is_asked_with_the_documented_prompt_and_a_long_text_is_clipped() -> None:
    messages = judge_messages("Be exact.", "Task text", "x" * 5000, "transcript", max_chars=1000)

    assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    user = messages[1]["content"]
    assert user.startswith("# Task\n\nTask text\n\n# Rubric\n\nBe exact.\n\n# The conversation\n\n")
    assert "[… 4000 characters cut …]" in user
    assert user.split("# The conversation\n\n")[1].count("x") == 1000


# -- the judge over HTTP ----------------------------------------------------------


async def test_composite_reward_is_the_weighted_sum_with_the_fake_judge() -> None:
    components = specs(
        {"name": "solved", "kind": "verifier", "weight": 0.5},
        {"name": "clear", "kind": "judge", "rubric": "Is it clear?", "weight": 0.3},
        {"name": "exact", "kind": "judge", "rubric": "Exact?", "on": "final_answer", "weight": 0.1},
        {"name": "json", "kind": "json_schema", "schema": {"type": "object"}, "weight": 0.1},
    )
    async with FakeJudge() as fake, Judge(config(fake.base_url)) as judge:
        with anyio.fail_after(10):
            scored = await Scorer(judge).score(components, INPUTS, verifier=0.8)

    clear = toy_score("Is it clear?", render(TRANSCRIPT))
    exact = toy_score("Exact?", '{"answer": 42}')
    assert scored.values == {"solved": 0.8, "clear": clear, "exact": exact, "json": 1.0}
    assert scored.reward == pytest.approx(0.5 * 0.8 + 0.3 * clear + 0.1 * exact + 0.1)
    assert scored.error is None
    assert (scored.judge_calls, fake.calls) == (2, 2)
    assert scored.judge_completion_tokens == 24 and scored.judge_prompt_tokens > 100
    assert {judged(body)[0] for body in fake.server.requests} == {"Is it clear?", "Exact?"}
    assert all(body["model"] == "judge-model" for body in fake.server.requests)


async def test_a_judge_outage_leaves_the_reward_null_naming_the_component() -> None:
    components = specs(
        {"name": "solved", "kind": "verifier", "weight": 0.5},
        {"name": "clear", "kind": "judge", "rubric": "Is it clear?", "weight": 0.5},
    )
    async with FakeJudge(mode="fail") as fake, Judge(config(fake.base_url)) as judge:
        with anyio.fail_after(10):
            scored = await Scorer(judge).score(components, INPUTS, verifier=1.0)

    assert scored.reward is None
    assert scored.values == {"solved": 1.0, "clear": None}
    assert scored.error is not None
    assert scored.error.startswith("reward component 'clear' (judge) could not be computed: ")
    assert "HTTP 503" in scored.error and "attempt 3 of 3" in scored.error
    assert fake.calls == 3  # retried per the retry table: judge_attempts in all


async def test_an_unparseable_judge_answer_is_not_retried_and_leaves_no_reward() -> None:
    (component,) = specs({"name": "q", "kind": "judge", "rubric": "Good?"})
    async with FakeJudge(mode="garbage") as fake, Judge(config(fake.base_url)) as judge:
        scored = await Scorer(judge).score((component,), INPUTS)

    assert scored.reward is None and fake.calls == 1
    assert scored.error is not None and 'not {"score": 0..1}' in scored.error


async def test_a_hung_judge_is_bounded_by_its_deadline() -> None:
    async with FakeJudge(mode="hang") as fake, Judge(config(fake.base_url, timeout_s=0.3)) as judge:
        with anyio.fail_after(10), pytest.raises(JudgeError) as caught:
            await judge.judge("Good?", "p", "text", "final_answer")

    assert "within judge.timeout_s (0.3 s" in str(caught.value)
    assert caught.value.transient


async def test_the_same_question_is_answered_from_the_cache_without_a_second_call() -> None:
    async with FakeJudge() as fake, Judge(config(fake.base_url)) as judge:
        first = await judge.judge("Good?", "p", "text", "final_answer")
        again = await judge.judge("Good?", "p", "text", "final_answer")
        other = await judge.judge("Good?", "p", "other text", "final_answer")

    assert fake.calls == 2 and judge.calls == 2
    assert (again.score, again.cached, again.prompt_tokens) == (first.score, True, 0)
    assert not first.cached and first.prompt_tokens > 0
    assert other.score == toy_score("Good?", "other text")


async def test_the_same_question_in_flight_twice_is_asked_once() -> None:
    async with FakeJudge() as fake, Judge(config(fake.base_url)) as judge:
        scores: list[float] = []

        async def ask() -> None:
            scores.append((await judge.judge("Good?", "p", "same", "final_answer")).score)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(ask)

    assert fake.calls == 1 and len(set(scores)) == 1 and len(scores) == 5


async def test_the_cache_forgets_the_least_recently_used_past_its_size() -> None:
    async with FakeJudge() as fake, Judge(config(fake.base_url, cache_entries=1)) as judge:
        await judge.judge("Good?", "p", "a", "final_answer")
        await judge.judge("Good?", "p", "b", "final_answer")
        await judge.judge("Good?", "p", "a", "final_answer")

    assert fake.calls == 3


async def test_the_judge_key_is_sent_as_a_bearer_token_and_never_in_an_error() -> None:
    key = "jk-7f3a9c0d1e2b"

    async with (
        FakeJudge(mode="unauthorized") as fake,
        Judge(config(fake.base_url, api_key=SecretStr(key))) as judge,
    ):
        with pytest.raises(JudgeError) as caught:
            await judge.judge("Good?", "p", "text", "final_answer")

    assert fake.server.headers[0]["authorization"] == f"Bearer {key}"
    assert "HTTP 401" in str(caught.value) and "is not a valid key" in str(caught.value)
    assert key not in str(caught.value) and key not in repr(judge.config)
    assert not caught.value.transient and fake.calls == 1


async def test_no_judge_configured_is_a_clear_error() -> None:
    async with Judge(config(None)) as judge:
        with pytest.raises(JudgeError, match=r"set judge\.base_url"):
            await judge.judge("Good?", "p", "text", "final_answer")


async def test_a_judge_on_an_answer_never_given_scores_0_without_a_call() -> None:
    (component,) = specs({"name": "q", "kind": "judge", "rubric": "Good?", "on": "final_answer"})
    no_answer = ScoreInputs("p", TRANSCRIPT, final_answer=None, steps=0)
    async with FakeJudge() as fake, Judge(config(fake.base_url)) as judge:
        scored = await Scorer(judge).score((component,), no_answer)

    assert (scored.values, scored.reward, fake.calls) == ({"q": 0.0}, 0.0, 0)


async def test_a_judge_url_s_user_and_password_never_reach_an_error() -> None:
    async with FakeJudge(mode="fail") as fake:
        with_password = fake.base_url.replace("http://", "http://judge:pw-s3cret@")
        async with Judge(config(with_password)) as judge:
            with pytest.raises(JudgeError) as caught:
                await judge.judge("Good?", "p", "text", "final_answer")

    assert f"{fake.base_url}/chat/completions answered HTTP 503" in str(caught.value)
    assert "pw-s3cret" not in str(caught.value)
    assert fake.server.headers[0]["authorization"].startswith("Basic ")  # it was sent
