"""pass@k and the statistics of an evaluation, against cases worked by hand."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest

from fleetroll.evaluation import EvalReport, compare, evaluate, pass_at_k
from fleetroll.evaluation.estimators import (
    bootstrap_interval,
    fisher_exact_p,
    holm,
    pass_at_ks,
    sign_flip_p,
    wilson_interval,
)
from fleetroll.evaluation.markdown import comparison_markdown, report_markdown
from fleetroll.results import FailureReason, RolloutResult


def result(
    task: str,
    sample: int,
    reward: float | None,
    reason: FailureReason | None = None,
    *,
    env: str = "ledger",
    batch: str = "b",
) -> RolloutResult:
    failed = reward is None or reason is not None
    return RolloutResult(
        rollout_id=f"{batch}/{task}/{sample}",
        batch_id=batch,
        task_key=task,
        sample_index=sample,
        env_key=env,
        env_version="v1",
        modality="tool_use",
        status="failed" if failed else "completed",
        failure_reason=(reason or FailureReason.INIT_ERROR) if reward is None else reason,
        reward=reward,
    )


def results_of(rewards: dict[str, list[float | None]], **kwargs: object) -> list[RolloutResult]:
    return [
        result(task, i, r, **kwargs)  # type: ignore[arg-type]
        for task, rs in rewards.items()
        for i, r in enumerate(rs)
    ]


# ---------------------------------------------------------------- the estimator


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, Fraction(2, 5)),  # pass@1 is the success rate
        (5, 2, 2, 1 - Fraction(3, 10)),  # 1 - C(3,2)/C(5,2)
        (5, 2, 3, 1 - Fraction(1, 10)),  # 1 - C(3,3)/C(5,3)
        (5, 2, 4, Fraction(1)),  # any 4 of 5 hold one of the 2 successes
        (4, 1, 2, 1 - Fraction(3, 6)),  # 1 - C(3,2)/C(4,2)
        (10, 3, 5, 1 - Fraction(21, 252)),  # 1 - C(7,5)/C(10,5)
    ],
)
def test_pass_at_k_is_the_unbiased_estimator_on_hand_computed_cases(
    n: int, c: int, k: int, expected: Fraction
) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (4, 1), (4, 3), (8, 8)])
def test_no_success_gives_zero_and_all_successes_give_one(n: int, k: int) -> None:
    assert pass_at_k(n, 0, k) == 0.0
    assert pass_at_k(n, n, k) == 1.0


def test_at_k_equal_to_n_one_success_is_enough() -> None:
    assert pass_at_k(6, 1, 6) == 1.0
    assert pass_at_k(6, 0, 6) == 0.0
    assert pass_at_k(6, 1, 5) == pytest.approx(1 - 1 / 6)  # 1 - C(5,5)/C(6,5)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (0, 0, 1), (4, 1, 0), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_refuses_what_has_no_estimate(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 40])
def test_every_pass_at_j_at_once_is_the_same_estimator(n: int) -> None:
    for c in range(n + 1):
        assert pass_at_ks(n, c, n) == pytest.approx([pass_at_k(n, c, j) for j in range(1, n + 1)])
    with pytest.raises(ValueError):
        pass_at_ks(n, 0, n + 1)


def test_the_product_form_matches_the_exact_ratio_where_the_binomials_are_huge() -> None:
    exact = 1 - Fraction(math.comb(990, 100), math.comb(1000, 100))

    assert pass_at_k(1000, 10, 100) == pytest.approx(float(exact), rel=1e-12)


# ---------------------------------------------------------------- intervals and tests


def test_wilson_intervals_match_the_published_values() -> None:
    low, high = wilson_interval(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and round(high, 4) == 0.2775
    low, high = wilson_interval(10, 10)
    assert round(low, 4) == 0.7225 and high == 1.0


def test_a_bootstrap_interval_needs_two_tasks_and_is_reproducible() -> None:
    values = [0.0, 0.25, 1.0, 1.0, 0.5, 0.0, 1.0]

    assert bootstrap_interval([0.5]) is None
    assert bootstrap_interval([1.0, 1.0, 1.0]) == (1.0, 1.0)
    first = bootstrap_interval(values, seed=3)
    assert first == bootstrap_interval(values, seed=3)
    assert first is not None and first[0] < sum(values) / len(values) < first[1]


def test_fisher_s_exact_test_on_hand_computed_tables() -> None:
    # 8 of 8 against 0 of 8: only the two extreme tables are as unlikely.
    assert fisher_exact_p(8, 8, 0, 8) == pytest.approx(2 / math.comb(16, 8))
    # The lady tasting tea, 3 of 4 against 1 of 4: (1 + 16 + 16 + 1) / 70.
    assert fisher_exact_p(3, 4, 1, 4) == pytest.approx(34 / 70)
    assert fisher_exact_p(2, 4, 2, 4) == 1.0


def test_holm_stops_at_the_first_p_value_over_its_bound() -> None:
    # 0.01 < 0.05/3; then 0.03 >= 0.05/2: it and everything above it stay.
    assert holm([0.01, 0.04, 0.03], 0.05) == [True, False, False]
    assert holm([0.001, 0.02], 0.05) == [True, True]
    assert holm([], 0.05) == []


def test_the_sign_flip_test_is_exact_on_few_tasks() -> None:
    assert sign_flip_p([1.0] * 10) == pytest.approx(2 / 1024)  # all + or all -
    assert sign_flip_p([1.0, -1.0] * 5) == 1.0
    assert sign_flip_p([0.0, 0.0]) == 1.0
    assert sign_flip_p([]) == 1.0


def test_the_sign_flip_test_on_many_tasks_is_seeded_and_never_zero() -> None:
    diffs = [1.0] * 40

    p = sign_flip_p(diffs, seed=1)
    assert p == sign_flip_p(diffs, seed=1)
    assert 0 < p < 0.001


# ---------------------------------------------------------------- evaluate


def test_a_task_s_figures_come_from_its_scored_samples_with_n_recorded() -> None:
    report = evaluate(results_of({"t": [1.0, 0.0, 1.0, None]}), k=4)
    t = report.tasks["t"]

    assert (t.samples, t.scored, t.successes, t.unscored) == (4, 3, 2, 1)
    assert t.unscored_reasons == {"init_error": 1}
    assert t.pass_at[0] == pytest.approx(2 / 3)
    assert t.pass_at[1:] == (1.0, 1.0, None)  # pass@4 needs 4 scored samples
    assert t.mean_reward == pytest.approx(2 / 3)
    assert t.interval == wilson_interval(2, 3)


def test_infrastructure_failures_do_not_lower_pass_at_k() -> None:
    rewards: dict[str, list[float | None]] = {
        "a": [1.0, 1.0, 1.0, 1.0],
        "b": [0.0, 0.0, 0.0, 0.0],
        "c": [1.0, 0.0, 1.0, 0.0],
    }
    clean = evaluate(results_of(rewards), k=4)
    # The same policy, with the platform failing a sample of every task.
    faulty = evaluate(results_of({key: [*rs[:3], None] for key, rs in rewards.items()}), k=4)

    for key in rewards:
        assert faulty.tasks[key].unscored == 1
        assert faulty.tasks[key].successes <= clean.tasks[key].successes
    assert faulty.tasks["a"].pass_at[:3] == clean.tasks["a"].pass_at[:3] == (1.0, 1.0, 1.0)
    assert faulty.tasks["b"].pass_at[:3] == clean.tasks["b"].pass_at[:3] == (0.0, 0.0, 0.0)
    assert faulty.overall.unscored == 3 and faulty.overall.unscored_reasons == {"init_error": 3}
    assert clean.overall.unscored == 0


def test_a_task_with_no_scored_sample_is_left_out_of_the_means() -> None:
    report = evaluate(results_of({"a": [1.0, 1.0], "down": [None, None]}), k=2)

    assert report.tasks["down"].pass_at == (None, None)
    assert report.overall.pass_at == (1.0, 1.0)
    assert report.overall.counted == (1, 1)
    assert (report.overall.tasks, report.overall.tasks_scored) == (2, 1)


def test_success_is_a_reward_at_or_over_the_threshold() -> None:
    rs = results_of({"t": [0.6, 0.4, 1.0]})

    assert evaluate(rs).tasks["t"].successes == 1
    assert evaluate(rs, success_threshold=0.5).tasks["t"].successes == 2


def test_environments_and_overall_weigh_each_task_the_same() -> None:
    rs = [
        *results_of({"l1": [1.0, 1.0], "l2": [0.0, 0.0]}, env="ledger"),
        *results_of({"d1": [1.0, 0.0]}, env="desktop"),
    ]
    report = evaluate(rs)

    assert set(report.environments) == {"ledger:v1", "desktop:v1"}
    assert report.environments["ledger:v1"].pass_at == (0.5, 0.5)
    assert report.environments["desktop:v1"].pass_at == (0.5, 1.0)
    assert report.overall.pass_at[1] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    interval = report.overall.intervals[0]
    assert interval is not None and interval[0] <= report.overall.pass_at[0] <= interval[1]  # type: ignore[operator]


def test_k_defaults_to_the_most_samples_and_a_bad_k_is_refused() -> None:
    assert evaluate(results_of({"a": [1.0, 0.0, 1.0], "b": [1.0]})).k == 3
    with pytest.raises(ValueError):
        evaluate([], k=None)
    with pytest.raises(ValueError):
        evaluate(results_of({"a": [1.0]}), k=0)
    with pytest.raises(ValueError, match="no task has more than 2"):
        evaluate(results_of({"a": [1.0, 1.0]}), k=3)


def test_sets_of_tasks_have_intervals_for_pass_at_1_and_pass_at_k() -> None:
    report = evaluate(results_of({"a": [1.0, 0.0, 0.0], "b": [1.0, 1.0, 0.0]}))

    first, middle, last = report.overall.intervals
    assert first is not None and last is not None and middle is None


def test_the_json_has_a_record_per_task_key_with_every_pass_at_j_and_reads_back() -> None:
    report = evaluate(results_of({"a": [1.0, 0.0, None], "b": [0.0, 0.0, 0.0]}), k=3)
    record = json.loads(json.dumps(report.to_json()))

    assert set(record["tasks"]) == {"a", "b"}
    assert [record["tasks"]["a"][f"pass@{j}"] for j in (1, 2, 3)] == [0.5, 1.0, None]
    assert record["overall"]["pass@1"] == pytest.approx(0.25)
    assert EvalReport.from_json(record) == report


def test_the_markdown_lists_every_task_and_says_what_was_not_scored() -> None:
    text = report_markdown(evaluate(results_of({"a": [1.0, None], "b": [0.0, 0.0]}), k=2))

    assert "| a | ledger:v1 | 1/1 | 1 |" in text and "| b | ledger:v1 | 0/2 | 0 |" in text
    assert "1 of 4 samples had no reward" in text and "init_error 1" in text


# ---------------------------------------------------------------- compare


def test_compare_flags_a_large_real_difference() -> None:
    tasks = [f"t{i}" for i in range(10)]
    a = evaluate(results_of({t: [0.0] * 8 for t in tasks}))
    b = evaluate(results_of({t: [1.0] * 8 for t in tasks}))

    c = compare(a, b, k=1)
    assert c.overall.difference == 1.0 and c.overall.significant
    assert c.overall.p_value == pytest.approx(2 / 1024)
    assert all(d.significant for d in c.tasks.values())
    assert "**yes**" in comparison_markdown(c)


def test_compare_does_not_flag_a_difference_that_is_noise() -> None:
    # Two runs of one policy that solves each task half the time: counts move a little.
    a = evaluate(
        results_of({"t0": [1.0, 0.0] * 4, "t1": [1.0, 1.0, 0.0, 0.0] * 2, "t2": [0.0] * 8})
    )
    b = evaluate(
        results_of(
            {"t0": [1.0, 0.0, 0.0, 0.0] * 2, "t1": [1.0] * 5 + [0.0] * 3, "t2": [0.0] * 7 + [1.0]}
        )
    )

    c = compare(a, b, k=1)
    assert not c.overall.significant
    assert not any(d.significant for d in c.tasks.values())
    assert "**yes**" not in comparison_markdown(c)


def test_compare_pairs_only_tasks_with_pass_at_k_on_both_sides() -> None:
    a = evaluate(results_of({"both": [1.0, 1.0], "only_a": [1.0, 1.0], "short": [1.0, None]}))
    b = evaluate(results_of({"both": [1.0, 0.0], "short": [1.0, 1.0]}))

    c = compare(a, b, k=2)
    assert list(c.tasks) == ["both"] and c.unpaired == ("only_a", "short")
    with pytest.raises(ValueError):
        compare(a, b, k=0)
