"""The one reader of a verifier's result (fleetroll.tasks.verifier_results)."""

from __future__ import annotations

import math

import pytest

from fleetroll.tasks.verifier_results import verifier_reward, verifier_reward_text

#: Every shape Fleet's verifiers return, and the reward each stands for.
SHAPES = [
    (0.25, 0.25),
    ({"score": 0.5}, 0.5),
    ({"reward": 0.75}, 0.75),
    ({"value": 0.125}, 0.125),
    (True, 1.0),
    (False, 0.0),
    (1.5, 1.5),  # kept as it is: no clamp
    (-2, -2.0),
    (3, 3.0),
    ({"score": True}, 1.0),
    ({"score": 0.5, "reason": "half the rows"}, 0.5),
    ({"score": 0.5, "reward": 0.9}, 0.5),  # score first, then reward, then value
    ({"reward": 0.9, "value": 0.1}, 0.9),
]


@pytest.mark.parametrize(("result", "reward"), SHAPES)
def test_each_shape_a_fleet_verifier_returns_reads_as_its_reward(
    result: object, reward: float
) -> None:
    read = verifier_reward(result)
    assert read == reward and type(read) is float


@pytest.mark.parametrize(
    ("result", "said"),
    [
        ("abc", "the verifier returned 'abc' (a str), not a number, a boolean or a dict"),
        (math.nan, "the verifier returned nan, not a finite number"),
        (math.inf, "the verifier returned inf, not a finite number"),
        (None, "the verifier returned None (None), not a number"),
        ([1.0], "the verifier returned [1.0] (a list), not a number"),
        ({"ok": 1}, "a dict without 'score', 'reward' or 'value' (its keys: 'ok')"),
        ({"score": "high"}, "the verifier's 'score' is 'high' (a str), not a number"),
        ({"value": math.nan}, "the verifier's 'value' is nan, not a finite number"),
        ({"score": {"score": 1}}, "the verifier's 'score' is {'score': 1} (a dict)"),
        (10**400, "not a finite number"),
        ("0.5", "the verifier returned '0.5' (a str), not a number"),
    ],
)
def test_anything_else_is_no_reward_and_the_reason_names_what_was_returned(
    result: object, said: str
) -> None:
    with pytest.raises(ValueError) as caught:
        verifier_reward(result)
    assert said in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_reason_shows_a_long_result_shortened() -> None:
    with pytest.raises(ValueError) as caught:
        verifier_reward("x" * 10_000)
    assert len(str(caught.value)) < 250 and "…" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        verifier_reward({f"key{i}" * 50: i for i in range(100)})
    assert len(str(caught.value)) <= 300


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("1", 1.0),
        (" 0.25 \n", 0.25),
        ("-1e0", -1.0),
        ("1.5", 1.5),
        ("true", 1.0),
        ("False", 0.0),
        ('{"score": 0.5}', 0.5),
        ('{"reward": 0.75, "why": "most rows"}', 0.75),
        ('{"value": 0.125}', 0.125),
    ],
)
def test_text_states_a_reward_in_the_same_shapes(text: str, reward: float) -> None:
    assert verifier_reward_text(text) == reward


@pytest.mark.parametrize(
    "text", ["nan", "inf", "ok", "", '{"ok": 1}', '{"score": "abc"}', "{not json", "[1]"]
)
def test_text_that_states_no_reward_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="verifier"):
        verifier_reward_text(text)
