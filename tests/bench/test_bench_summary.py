"""``--repeat``'s medians: each round's CPU ratio is paired with the floor's run of
that round, so that the machine's drift between rounds cancels."""

from __future__ import annotations

import pytest
from bench_helpers import run

from fleetroll.bench.records import Machine, ScenarioReport, summarize
from fleetroll.bench.report import markdown


def test_the_cpu_ratio_is_the_median_of_each_round_s_own_ratio() -> None:
    # The machine ran at half speed in round 2: both systems took twice the CPU.
    runs = [
        run("fleetroll", 1, 6.0),
        run("cpu-floor", 1, 5.0),
        run("cpu-floor", 2, 10.0),
        run("fleetroll", 2, 12.0),
        run("fleetroll", 3, 7.0, overhead=1.3, scored=999, leaked=1, peak_rss_mb=170.0),
        run("cpu-floor", 3, 5.0),
    ]
    fleetroll, floor = summarize(runs)
    assert (fleetroll.system, fleetroll.rounds, floor.system) == ("fleetroll", 3, "cpu-floor")
    # Per round: 1.2, 1.2, 1.4 -> 1.2. The ratio of the medians would be 7 / 5 = 1.4.
    assert fleetroll.cpu_vs_floor == pytest.approx(1.2)
    assert fleetroll.cpu_ms_per_rollout == 7.0
    assert floor.cpu_vs_floor == pytest.approx(1.0)
    assert fleetroll.overhead == 1.1 and fleetroll.loop_lag_p99_ms == 20.0
    # The worst round where a median would hide it: the fewest scored, every leak, the peak.
    assert (fleetroll.scored, fleetroll.leaked, fleetroll.peak_rss_mb) == (999, 1, 170.0)


def test_without_a_floor_there_is_no_ratio_and_each_concurrency_has_its_own_row() -> None:
    runs = [run("fleetroll", 1, 6.0), run("fleetroll", 1, 9.0, concurrency=100)]
    rows = summarize(runs)
    assert [(r.concurrency, r.cpu_ms_per_rollout, r.cpu_vs_floor) for r in rows] == [
        (1000, 6.0, None),
        (100, 9.0, None),
    ]


def test_the_markdown_shows_the_medians_only_when_there_were_rounds() -> None:
    machine = Machine(nproc=2, cpu_model="x", python="3.11", platform="linux")
    runs = [run("fleetroll", 1, 6.0), run("cpu-floor", 1, 5.0)]
    one = ScenarioReport(
        scenario="realistic",
        description="d",
        command="c",
        started_at="now",
        machine=machine,
        parameters={"repeat": 1},
        runs=runs,
        summary=summarize(runs),
    )
    assert "Medians over" not in markdown(one)
    runs += [run("cpu-floor", 2, 4.0), run("fleetroll", 2, 6.0)]
    two = one.model_copy(
        update={"parameters": {"repeat": 2}, "runs": runs, "summary": summarize(runs)}
    )
    text = markdown(two)
    assert "Medians over 2 rounds" in text
    assert "| fleetroll | 1000 | 2 | 1000 / 1000 | 6.0 | 1.35x | 1.100 |" in text
    assert "| cpu-floor | 1000 | 2 |" in text
