"""``fleetroll query``, ``fleetroll stats`` and ``fleetroll dashboard``: the telemetry, read.

Registered lazily on the ``fleetroll`` group by :mod:`fleetroll.cli.main`.
Exit codes: 0 done; 1 ``stats --check`` found rollouts that broke the
invariant; 2 bad input (no store, SQL error, a write refused, no read token).
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import click

from fleetroll._internal.signals import until_signalled
from fleetroll.cli.options import CONFIG_OPTION, Failed, load_command_settings
from fleetroll.errors import FleetrollError
from fleetroll.telemetry.store import StoreError

__all__ = ["dashboard", "query", "stats"]

_DB_OPTION = click.option(
    "--db",
    "db_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The telemetry store (default: telemetry.db_path from the config).",
)


def _db(db_path: Path | None, config_file: Path | None) -> Path:
    if db_path is not None:
        return db_path
    return load_command_settings(config_file).telemetry.db_path


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _console() -> Any:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 200))
    return console


#: Characters a column needs to stay readable in the table view of `query`.
_MIN_COLUMN_CHARS = 10


def _print_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    title: str | None,
    *,
    cut: bool = False,
) -> None:
    """A rich table; with ``cut``, one line per row (long values end in …).

    With ``cut``, when the columns cannot all get ``_MIN_COLUMN_CHARS`` on
    the terminal (``SELECT *``), each row is printed as ``column  value``
    lines instead (psql's expanded display).
    """
    from rich.table import Table

    console = _console()
    if cut and rows:
        needed = sum(min(len(name), _MIN_COLUMN_CHARS) + 3 for name in columns)
        if needed > console.width:
            _print_expanded(console, columns, rows)
            return
    cells = [[_line(_cell(v)) if cut else _cell(v) for v in row] for row in rows]
    cap = _column_cap(columns, cells, console.width) if cut else None
    table = Table(title=title)
    for i, name in enumerate(columns):
        numeric = bool(rows) and all(
            isinstance(row[i], int | float) or row[i] is None for row in rows
        )
        table.add_column(
            name,
            justify="right" if numeric else "left",
            overflow="ellipsis" if cut else "fold",
            no_wrap=cut,
            max_width=cap,
        )
    for row_cells in cells:
        table.add_row(*row_cells)
    console.print(table)


def _column_cap(columns: Sequence[str], cells: Sequence[Sequence[str]], width: int) -> int | None:
    """The widest a column may be for the table to fit ``width`` (None: it fits as it is).

    Narrow columns keep their width; only the widest are cut, all to one width.
    """
    natural = [max([len(name), *(len(row[i]) for row in cells)]) for i, name in enumerate(columns)]
    room = width - 3 * len(columns) - 1  # borders and padding
    if sum(natural) <= room:
        return None
    low, high = 1, max(natural)
    while low < high:  # the largest cap with which everything fits
        mid = (low + high + 1) // 2
        if sum(min(w, mid) for w in natural) <= room:
            low = mid
        else:
            high = mid - 1
    return max(low, _MIN_COLUMN_CHARS)


def _line(text: str) -> str:
    """One line of a table cell: line breaks shown as ⏎ (the cell is cut to its width)."""
    return text.replace("\r\n", "⏎").replace("\n", "⏎")


def _print_expanded(console: Any, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.rule import Rule
    from rich.table import Table

    for number, row in enumerate(rows, start=1):
        console.print(Rule(f"row {number}", align="left"))
        label = max(map(len, columns))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True, min_width=label)
        grid.add_column(
            overflow="ellipsis",
            no_wrap=True,
            max_width=max(_MIN_COLUMN_CHARS, console.width - label - 2),
        )
        for name, value in zip(columns, row, strict=True):
            grid.add_row(name, _line(_cell(value)))
        console.print(grid)


def _print_schema(fmt: str) -> None:
    from fleetroll.telemetry.queries import schema

    result = schema()
    if fmt == "table":
        _print_table(result.columns, result.rows, title="records")
        return
    _print_rows(result.columns, result.rows, fmt)


def _json_columns() -> frozenset[str]:
    from fleetroll.telemetry.queries import COLUMN_NOTES

    return frozenset(name for name, (kind, _) in COLUMN_NOTES.items() if kind == "json")


def _decoded(column: str, value: Any, json_columns: frozenset[str]) -> Any:
    """A JSON column's text (``attributes``, ``tags``...) as the object it holds."""
    if column in json_columns and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _print_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str) -> None:
    if fmt == "json":
        json_columns = _json_columns()
        records = [
            {c: _decoded(c, v, json_columns) for c, v in zip(columns, row, strict=True)}
            for row in rows
        ]
        click.echo(json.dumps(records, indent=2, default=str))
    elif fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(["" if v is None else v for v in row] for row in rows)
    else:
        _print_table(columns, rows, title=None, cut=True)
        click.echo(f"{len(rows)} row{'s' if len(rows) != 1 else ''}", err=True)


def _format_option(func: Any) -> Any:
    func = click.option("--csv", "fmt", flag_value="csv", help="CSV with a header row, on stdout.")(
        func
    )
    func = click.option("--json", "fmt", flag_value="json", help="A JSON array of objects.")(func)
    return click.option("--table", "fmt", flag_value="table", default=True, hidden=True)(func)


@click.command()
@click.argument("sql", required=False)
@_format_option
@click.option(
    "--schema",
    "show_schema",
    is_flag=True,
    help="List the columns of records (type, what each holds) instead of running SQL.",
)
@click.option(
    "--logfire",
    "on_logfire",
    is_flag=True,
    help="Run the SQL on Logfire cloud instead (read token from LOGFIRE_READ_TOKEN).",
)
@click.option(
    "--since",
    default="24h",
    show_default=True,
    help="With --logfire: only records newer than this (e.g. 30m, 6h, 7d).",
)
@click.option(
    "--max-rows",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many rows (default: service.query_max_rows from the config).",
)
@_DB_OPTION
@CONFIG_OPTION
def query(
    sql: str | None,
    fmt: str,
    show_schema: bool,
    on_logfire: bool,
    since: str,
    max_rows: int | None,
    db_path: Path | None,
    config_file: Path | None,
) -> None:
    """Run SQL on the telemetry records, the same SQL as on Logfire.

    The local store (a SQLite file) has Logfire's `records` table and takes
    Logfire's SQL (::float, date_trunc, now() - interval '5 minutes', ILIKE,
    percentile_cont ... WITHIN GROUP, ->>), e.g.:

    \b
      fleetroll query "SELECT attributes->>'env_key' AS env, COUNT(*)
        FROM records WHERE message = 'fleet_rollout_completed' GROUP BY 1"

    --schema lists the columns. The store is opened read-only: statements
    that write are refused. Rows are fetched up to --max-rows and
    service.query_max_bytes of values; past either, the answer is cut short
    and a note on stderr says so. The table cuts long values to one line
    (…) and shows wide rows one column per line; --json and --csv give
    every value whole (--json: JSON columns such as attributes as objects).
    """
    if show_schema:
        _print_schema(fmt)
        return
    if not sql:
        raise Failed(
            'give the SQL to run, e.g. "SELECT COUNT(*) FROM records" (--schema lists the columns)'
        )
    if on_logfire:
        columns, rows = _query_logfire(sql, since)
    else:
        from fleetroll.telemetry.queries import query as run_query

        settings = load_command_settings(config_file)
        limit = max_rows if max_rows is not None else settings.service.query_max_rows
        db = db_path if db_path is not None else settings.telemetry.db_path
        try:
            result = run_query(db, sql, max_rows=limit, max_bytes=settings.service.query_max_bytes)
        except StoreError as exc:
            raise Failed(str(exc)) from None
        columns, rows = result.columns, result.rows
        if result.truncated:
            click.echo(
                f"truncated: only the first {len(rows)} rows (limits: {limit} rows, "
                f"{settings.service.query_max_bytes} bytes; --max-rows, "
                "service.query_max_bytes)",
                err=True,
            )
    _print_rows(columns, rows, fmt)


def _since(text: str) -> timedelta:
    units = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
    try:
        amount, unit = float(text[:-1]), units[text[-1]]
    except (ValueError, KeyError, IndexError):
        raise Failed(f"--since {text!r}: use a number and a unit: 30m, 6h, 7d") from None
    try:
        return timedelta(**{unit: amount})
    except OverflowError:  # 1e20d
        raise Failed(f"--since {text!r} reaches back before year 1: give less") from None


def _query_logfire(sql: str, since: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    import anyio
    from logfire.query_client import AsyncLogfireQueryClient

    from fleetroll.telemetry.events import Redactor

    token = os.environ.get("LOGFIRE_READ_TOKEN")
    if not token:
        raise Failed("--logfire needs a read token in LOGFIRE_READ_TOKEN (Logfire → Settings)")
    try:
        min_timestamp = datetime.now(UTC) - _since(since)
    except OverflowError:  # before year 1
        raise Failed(f"--since {since!r} reaches back before year 1: give less") from None

    async def run() -> Any:
        async with AsyncLogfireQueryClient(read_token=token) as client:
            return await client.query_json_rows(sql, min_timestamp=min_timestamp)

    try:
        answer = anyio.run(run)
    except Exception as exc:  # HTTP and API errors of the query client: one clear line
        message = Redactor([token])(f"{type(exc).__name__}: {exc}")
        raise Failed(f"the Logfire query failed: {message}") from None
    records: list[dict[str, Any]] = list(answer.get("rows") or [])
    columns = [c["name"] for c in answer.get("columns") or []]
    if not columns and records:
        columns = list(records[0])
    return columns, [tuple(r.get(c) for c in columns) for r in records]


@click.command()
@click.option("--batch", "batch_id", default=None, help="Only this batch.")
@click.option(
    "--check",
    "run_check",
    is_flag=True,
    help="Check that every rollout started once and completed once; exit 1 if not.",
)
@click.option(
    "--live",
    is_flag=True,
    help="With --check, on a running service or run: rollouts started and not completed"
    " whose process is alive are running, not offences, unless their batch ended or"
    " they started more than --max-age ago.",
)
@click.option(
    "--max-age",
    "max_age_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="With --live: the oldest a running rollout's start may be (default: the"
    " timeouts a rollout runs under, provision_total_s + rollout_s + verifier_s +"
    " release_s).",
)
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
@_DB_OPTION
@CONFIG_OPTION
def stats(
    batch_id: str | None,
    run_check: bool,
    live: bool,
    max_age_s: float | None,
    as_json: bool,
    db_path: Path | None,
    config_file: Path | None,
) -> None:
    """Rollouts per environment: outcomes, failure reasons, reward, provisioning time.

    With --check, verify instead that every rollout id has exactly one
    fleet_rollout_started and one fleet_rollout_completed event (exit code 1,
    with the offending ids, if not). Rollouts whose process is gone (killed
    before they completed) are listed as lost, grouped by batch with the
    command that resumes each, and do not fail the check. With --live (a
    health probe of a running service), rollouts still running do not fail
    it either.
    """
    from fleetroll.telemetry import queries

    if (live or max_age_s is not None) and not run_check:
        raise Failed("--live and --max-age go with --check")
    if max_age_s is not None and not live:
        raise Failed("--max-age goes with --live")
    db = _db(db_path, config_file)
    if live and max_age_s is None:
        t = load_command_settings(config_file).timeouts
        max_age_s = t.provision_total_s + t.rollout_s + t.verifier_s + t.release_s
    try:
        if run_check:
            result = queries.check(db, batch_id, live_max_age_s=max_age_s if live else None)
        else:
            rows = queries.stats(db, batch_id)
            batches = [] if as_json or batch_id else queries.batch_costs(db)
    except StoreError as exc:
        raise Failed(str(exc)) from None
    if run_check:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "ok": result.ok,
                        "rollouts": result.rollouts,
                        "never_completed": result.never_completed,
                        "completed_more_than_once": result.completed_more_than_once,
                        "completed_without_start": result.completed_without_start,
                        "rerun": result.rerun,
                        "lost": [{"rollout_id": r, "batch_id": b} for r, b in result.lost],
                        "lost_batches": [
                            {
                                "batch_id": g.batch_id,
                                "rollouts": len(g.rollout_ids),
                                "resume": g.resume,
                            }
                            for g in result.lost_batches
                        ],
                        "running": result.running,
                    },
                    indent=2,
                )
            )
        else:
            click.echo(result.describe(), err=not result.ok)
        if not result.ok:
            raise SystemExit(1)
        return
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    _print_stats(rows, batch_id)
    _print_costs(rows, batches, batch_id)


#: Column headings of the cost tables, for :data:`queries.COST_FIELDS`.
_COST_HEADINGS: Final = (
    "instance s",
    "prompt tokens",
    "completion tokens",
    "policy calls",
    "tool calls",
)


def _cost_cells(row: Mapping[str, Any]) -> list[Any]:
    from fleetroll.telemetry.queries import COST_FIELDS

    seconds = row["instance_s"]
    # Whole seconds from 100 on: the table's 4 significant digits would show 1.235e+04.
    shown = round(seconds) if seconds >= 100 else round(seconds, 1)
    return [shown if name == "instance_s" else row[name] for name in COST_FIELDS]


def _print_costs(
    rows: Sequence[dict[str, Any]], batches: Sequence[dict[str, Any]], batch_id: str | None
) -> None:
    """The results' ``cost`` summed per environment (with a total) and per batch."""
    from fleetroll.telemetry.queries import COST_FIELDS

    per_env = [[_env_name(row), row["rollouts"], *_cost_cells(row)] for row in rows]
    if len(rows) > 1:
        total = {name: sum(row[name] for row in rows) for name in COST_FIELDS}
        per_env.append(["total", sum(row["rollouts"] for row in rows), *_cost_cells(total)])
    suffix = f" (batch {batch_id})" if batch_id else ""
    _print_table(
        ["env", "rollouts", *_COST_HEADINGS], per_env, title="cost by environment" + suffix
    )
    if batches and batch_id is None:
        _print_table(
            ["batch", "rollouts", *_COST_HEADINGS],
            [[b["batch_id"], b["completed"], *_cost_cells(b)] for b in batches],
            title="cost by batch (newest first)",
        )


def _env_name(row: Mapping[str, Any]) -> str:
    return f"{row['env_key']}:{row['env_version']}" if row["env_version"] else str(row["env_key"])


def _failed_pct(row: Mapping[str, Any]) -> float | None:
    """The share of the rollouts that ran to their end that failed (cancelled ones
    were not let finish: they are not in it)."""
    ran = row["completed"] + row["failed"]
    return round(100.0 * row["failed"] / ran, 1) if ran else None


def _print_stats(rows: Sequence[dict[str, Any]], batch_id: str | None) -> None:
    # Cancelled has a column of its own, apart from the failures and their reasons.
    reasons = sorted(
        {reason for row in rows for reason in row["failure_reasons"] if reason != "cancelled"}
    )
    columns = [
        "env",
        "modality",
        "started",
        "completed",
        "failed",
        "failed %",
        "cancelled",
        *reasons,
        "reward mean",
        "provision p50 s",
        "provision p95 s",
        "tool errors",
        "verifier errors",
    ]
    table_rows = []
    for row in rows:
        table_rows.append(
            [
                _env_name(row),
                row["modality"],
                row["started"],
                row["completed"],
                row["failed"],
                _failed_pct(row),
                row["cancelled"],
                *(row["failure_reasons"].get(reason, 0) for reason in reasons),
                row["reward_mean"],
                row["provisioning_p50_s"],
                row["provisioning_p95_s"],
                row["tool_errors"],
                row["verifier_errors"],
            ]
        )
    title = "rollouts by environment" + (f" (batch {batch_id})" if batch_id else "")
    _print_table(columns, table_rows, title=title)


@click.command()
@_DB_OPTION
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=int, default=8377, show_default=True, help="Port to listen on (0: a free one)."
)
@CONFIG_OPTION
def dashboard(db_path: Path | None, host: str, port: int, config_file: Path | None) -> None:
    """Serve the live dashboard of the telemetry store until Ctrl-C.

    The current batch's progress with an ETA, throughput, reward per batch,
    uniform-reward groups, stuck and lost rollouts, the latest errors,
    admission state, rollouts over time, failure reasons, provisioning
    latency, rewards, the slowest rollouts and the cost, refreshed every two
    seconds: open the printed URL in a browser. The store is only ever read.

    Guarded as `fleetroll serve` is: anything but loopback needs
    FLEETROLL_SERVICE_TOKEN (open /dashboard/login?token=<token> once: it
    sets a cookie and opens the page); without a token, only requests naming
    a loopback host are answered.
    """
    import anyio

    from fleetroll._internal.guard import check_bind

    settings = load_command_settings(config_file)
    try:
        check_bind(host, settings.service_token)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    db = db_path if db_path is not None else settings.telemetry.db_path

    async def serve() -> None:
        from fleetroll._internal.guard import Guard
        from fleetroll._internal.serving import serve_asgi
        from fleetroll.telemetry.dashboard import PAGE_PATHS, dashboard_app, dashboard_panels
        from fleetroll.telemetry.dashboard_auth import LOGIN_PATH, cookie_authorizer

        token = settings.service_token
        app = Guard(
            dashboard_app(
                db,
                query_timeout_s=settings.service.query_timeout_s,
                panels=dashboard_panels(settings.telemetry),
                token=token,
            ),
            token=token,
            max_body_bytes=settings.service.max_body_bytes,
            open_paths={"/healthz", *PAGE_PATHS},
            also_authorized=cookie_authorizer(token),
        )
        async with serve_asgi(app, host=host, port=port) as url:
            page = f"{url}/dashboard"
            if token is not None:  # its shape: the token itself is never printed
                page = f"{url}{LOGIN_PATH}?token=<FLEETROLL_SERVICE_TOKEN>"
            click.echo(f"fleetroll dashboard: {page}  (store {db}; Ctrl-C to stop)")
            await until_signalled()
        click.echo("fleetroll dashboard: stopped", err=True)

    try:
        anyio.run(serve)
    except OSError as exc:
        raise Failed(f"cannot serve the dashboard on {host}:{port}: {exc}") from None
