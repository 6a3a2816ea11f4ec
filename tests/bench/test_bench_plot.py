"""The bench's plot: each system's median over its rounds with their range as
error bars, axes from 0, and a provisional mark (with its reason) when a run was
on a busy machine or a point has fewer rounds than the bench's minimum."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import run

from fleetroll.bench.records import BUSY_CORES, Machine, RunRecord, ScenarioReport
from fleetroll.bench.report import MIN_ROUNDS, Point, plot, plot_data

README = Path(__file__).resolve().parents[2] / "README.md"


def report(runs: list[RunRecord]) -> ScenarioReport:
    machine = Machine(nproc=2, cpu_model="x", python="3.11", platform="linux")
    return ScenarioReport(
        scenario="realistic",
        description="d",
        command="c",
        started_at="now",
        machine=machine,
        parameters={},
        runs=runs,
    )


def rounds(system: str, concurrency: int, per_s: list[float], **fields: object) -> list[RunRecord]:
    return [
        run(system, n, 5.0, concurrency=concurrency, rollouts_per_s=value, **fields)
        for n, value in enumerate(per_s, start=1)
    ]


def test_each_point_is_the_median_of_its_rounds_with_their_range_on_axes_from_0() -> None:
    runs = [
        *rounds("fleetroll", 1000, [1000.0, 960.0, 1040.0]),
        *rounds("fleetroll", 100, [99.0, 100.0, 98.0], overhead=1.02),
        *rounds("cpu-floor", 1000, [1010.0, 1005.0, 1020.0], overhead=None),
    ]
    data = plot_data(report(runs))
    assert data.throughput == {
        "fleetroll": [Point(100, 99.0, 98.0, 100.0, 3), Point(1000, 1000.0, 960.0, 1040.0, 3)],
        "cpu-floor": [Point(1000, 1010.0, 1005.0, 1020.0, 3)],
    }
    # Overhead only where a run had an ideal to compare with.
    assert data.overhead == {
        "fleetroll": [Point(100, 1.02, 1.02, 1.02, 3), Point(1000, 1.1, 1.1, 1.1, 3)]
    }
    # Not a tight 960-1040 range: throughput from 0, over the highest bar.
    assert data.throughput_ylim[0] == 0.0 and data.throughput_ylim[1] > 1040.0
    assert data.overhead_ylim[0] == 0.0 and data.overhead_ylim[1] > 1.1
    assert data.provisional is None


def test_a_plot_is_provisional_with_fewer_rounds_than_the_minimum_or_on_a_busy_machine() -> None:
    assert MIN_ROUNDS == 3
    few = plot_data(report(rounds("fleetroll", 1000, [1000.0, 990.0])))
    assert few.provisional == "2 round(s) at a point, fewer than 3 (--repeat)"
    busy = rounds("fleetroll", 1000, [1000.0, 990.0, 995.0])
    busy[1] = busy[1].model_copy(update={"provisional": True, "other_cpu_utilisation": 0.4})
    assert plot_data(report(busy)).provisional == (
        f"1 of 3 runs on a busy machine (others' CPU over {BUSY_CORES} cores)"
    )
    both = [*rounds("fleetroll", 100, [99.0], provisional=True), *busy]
    assert plot_data(report(both)).provisional == (
        f"2 of 4 runs on a busy machine (others' CPU over {BUSY_CORES} cores);"
        " 1 round(s) at a point, fewer than 3 (--repeat)"
    )


@pytest.mark.parametrize("provisional", [False, True])
def test_the_png_carries_the_provisional_mark_and_its_reason(
    tmp_path: Path, provisional: bool
) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    runs = rounds("fleetroll", 1000, [1000.0, 990.0, 1010.0], provisional=provisional)
    path = tmp_path / "realistic.png"
    assert plot(report(runs), path)
    with Image.open(path) as image:
        description = image.text["Description"]
    assert description.startswith("fleetroll bench: realistic (median of rounds, bars: min to")
    mark = f"PROVISIONAL: 3 of 3 runs on a busy machine (others' CPU over {BUSY_CORES} cores)"
    assert (mark in description) is provisional


def test_the_readme_states_the_plot_s_rule() -> None:
    text = " ".join(README.read_text(encoding="utf-8").split())
    assert f"fewer than {MIN_ROUNDS} rounds" in text
    assert f"above {BUSY_CORES} cores" in text
    assert "min–max error bars" in text
