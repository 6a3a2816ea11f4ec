"""Benchmarks: fleetroll against hand-written baselines, on the emulator.

``fleetroll bench`` runs a :class:`~fleetroll.bench.scenarios.Scenario` for
fleetroll and for each baseline, every run against a fresh emulator in its
own process (so the emulator's CPU is not charged to fleetroll), and reports
makespan against the scenario's ideal, throughput, per-phase latency, event
loop lag, peak RSS, CPU, and what the emulator's ledger says was leaked.

* :mod:`~fleetroll.bench.scenarios`: the scenarios and their tasks;
* :mod:`~fleetroll.bench.ideal`: the ideal makespan of a scenario;
* :mod:`~fleetroll.bench.measure`: loop lag, CPU, RSS, percentiles;
* :mod:`~fleetroll.bench.systems`: fleetroll's run, and the harness around every run;
* :mod:`~fleetroll.bench.baselines`: ``fresh-session`` and ``naive-gather``;
* :mod:`~fleetroll.bench.toolcall`: the per-call micro-benchmark;
* :mod:`~fleetroll.bench.policy_turn`: CPU per policy turn against turn index;
* :mod:`~fleetroll.bench.report`: JSON, markdown and the PNG plot.
"""

from fleetroll.bench.scenarios import SCENARIOS, Scenario

__all__ = ["SCENARIOS", "Scenario"]
