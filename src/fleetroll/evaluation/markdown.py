"""Reports and comparisons as Markdown tables, for the terminal and for pasting."""

from __future__ import annotations

from collections.abc import Sequence

from fleetroll.evaluation.compare import METHOD, Comparison, SetDifference
from fleetroll.evaluation.report import INTERVALS, EvalReport, Summary

__all__ = ["comparison_markdown", "report_markdown"]


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _signed(value: float | None) -> str:
    return "—" if value is None else f"{value:+.3f}"


def _with_interval(value: float | None, interval: tuple[float, float] | None) -> str:
    if value is None:
        return "—"
    if interval is None:
        return _num(value)
    return f"{value:.3f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _reasons(reasons: dict[str, int] | object) -> str:
    assert isinstance(reasons, dict)
    return ", ".join(f"{name} {count}" for name, count in reasons.items()) or "—"


def _shown(k: int) -> list[int]:
    """The pass@j columns of a table: 1 and K (all of them in the JSON)."""
    return [1] if k == 1 else [1, k]


def report_markdown(report: EvalReport) -> str:
    """The per-task table, then per environment and overall with intervals."""
    shown = _shown(report.k)
    version = "" if report.policy_version is None else f", policy version {report.policy_version}"
    lines = [
        f"## Evaluation: {len(report.tasks)} tasks × {report.k} samples"
        f" (success: reward ≥ {report.success_threshold:g}{version})",
        "",
    ]
    task_rows = [
        [
            score.task_key,
            score.env,
            f"{score.successes}/{score.scored}",
            str(score.unscored),
            *(_num(score.pass_at_k(j)) for j in shown),
            _num(score.mean_reward),
        ]
        for score in report.tasks.values()
    ]
    lines += _table(
        [
            "task",
            "env",
            "successes/scored",
            "unscored",
            *(f"pass@{j}" for j in shown),
            "mean reward",
        ],
        task_rows,
        right_from=2,
    )
    lines += ["", "### By environment", ""]
    summaries: list[Summary] = [*report.environments.values(), report.overall]
    lines += _table(
        [
            "env",
            "tasks",
            "successes/scored",
            "unscored",
            *(f"pass@{j}" for j in shown),
            "mean reward",
        ],
        [
            [
                f"**{s.name}**" if s is report.overall else s.name,
                str(s.tasks),
                f"{s.successes}/{s.scored}",
                str(s.unscored),
                *(
                    _with_interval(s.pass_at_k(j), s.intervals[j - 1])
                    + ("" if s.counted[j - 1] == s.tasks else f" ({s.counted[j - 1]} tasks)")
                    for j in shown
                ),
                _num(s.mean_reward),
            ]
            for s in summaries
        ],
    )
    unscored = report.overall.unscored
    lines += ["", f"{INTERVALS}."]
    if unscored:
        lines.append(
            f"{unscored} of {report.overall.samples} samples had no reward (not counted as"
            f" failures of the policy): {_reasons(dict(report.overall.unscored_reasons))}."
            " A task's pass@j uses its scored samples; it is — when it has fewer than j."
        )
    else:
        lines.append(f"Every one of the {report.overall.samples} samples was scored.")
    return "\n".join(lines)


def _set_row(d: SetDifference) -> list[str]:
    return [
        f"**{d.name}**" if d.name == "overall" else d.name,
        str(d.tasks),
        _num(d.a),
        _num(d.b),
        _signed(d.difference)
        + ("" if d.interval is None else f" [{d.interval[0]:+.2f}, {d.interval[1]:+.2f}]"),
        f"{d.p_value:.3g}",
        "**yes**" if d.significant else "no",
    ]


def comparison_markdown(c: Comparison, a_name: str = "A", b_name: str = "B") -> str:
    """Per task, per environment and overall: A, B, B − A, p, beyond noise."""
    a = a_name + ("" if c.a_version is None else f" (v{c.a_version})")
    b = b_name + ("" if c.b_version is None else f" (v{c.b_version})")
    lines = [f"## pass@{c.k}: {b} against {a}", ""]
    lines += _table(
        ["task", "env", a, b, f"{b_name} − {a_name}", "p", "beyond noise"],
        [
            [
                d.task_key,
                d.env,
                _num(d.a),
                _num(d.b),
                _signed(d.difference),
                f"{d.p_value:.3g}",
                "**yes**" if d.significant else "no",
            ]
            for d in c.tasks.values()
        ],
        right_from=2,
    )
    lines += ["", "### By environment", ""]
    lines += _table(
        ["env", "tasks", a, b, f"{b_name} − {a_name} [95% interval]", "p", "beyond noise"],
        [_set_row(d) for d in [*c.environments.values(), c.overall]],
    )
    lines += ["", f"Beyond noise: p < {c.alpha:g}; {METHOD}."]
    if c.unpaired:
        lines.append(
            f"Not compared ({len(c.unpaired)}: without pass@{c.k} on both sides):"
            f" {', '.join(c.unpaired)}."
        )
    return "\n".join(lines)
