"""``POST /v1/query`` and ``GET /v1/stats``: the telemetry store, read-only, over HTTP.

Both go through :mod:`fleetroll.telemetry.queries`, which opens its own
read-only connection per call (``mode=ro``, ``PRAGMA query_only``, and an
authorizer that allows reading only): read-only is enforced by the database
connection, never by looking at the SQL. These functions block; the routes
run them in worker threads (sqlite3 releases the GIL), never on the loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetroll.service.errors import ApiError
from fleetroll.service.models import QueryResult, StatsResult
from fleetroll.telemetry import queries
from fleetroll.telemetry.store import StoreError

__all__ = ["run_query", "run_stats"]


def run_query(
    db_path: Path,
    sql: str,
    params: Sequence[Any] | Mapping[str, Any] | None,
    *,
    max_rows: int,
    timeout_s: float,
    max_bytes: int | None = None,
) -> QueryResult:
    """Run one statement read-only; at most ``max_rows`` rows and about ``max_bytes`` come back.

    The bounds apply while fetching: rows past them are never read.

    Raises:
        ApiError: 404 (no store yet), 403 (the statement tries to change
            something), 400 (invalid SQL, too slow, or not one statement).
    """
    try:
        result = queries.query(
            db_path,
            sql,
            params or (),
            timeout_s=timeout_s,
            max_rows=max_rows,
            max_bytes=max_bytes,
        )
    except queries.ReadOnlyError as exc:
        raise ApiError(403, str(exc)) from None
    except queries.QueryError as exc:
        raise ApiError(400, str(exc)) from None
    except StoreError as exc:
        raise ApiError(404, f"{exc} (nothing recorded yet?)") from None
    except (ValueError, OverflowError) as exc:  # a NUL in the SQL, an integer too large
        raise ApiError(400, f"the query failed: {exc}") from None
    return QueryResult(
        columns=result.columns,
        rows=[[_json_value(v) for v in row] for row in result.rows],
        truncated=result.truncated,
    )


def run_stats(db_path: Path, batch_id: str | None) -> StatsResult:
    """Rollouts per environment, and the started/completed invariant.

    Raises:
        ApiError: 404, no store yet or no such batch.
    """
    try:
        envs = queries.stats(db_path, batch_id)
        batches = queries.batch_costs(db_path, batch_id)
        check = queries.check(db_path, batch_id)
    except queries.NoSuchBatchError as exc:
        raise ApiError(404, str(exc)) from None
    except StoreError as exc:
        raise ApiError(404, f"{exc} (nothing recorded yet?)") from None
    return StatsResult(
        batch_id=batch_id,
        envs=[{k: _json_value(v) for k, v in row.items()} for row in envs],
        batches=[{k: _json_value(v) for k, v in row.items()} for row in batches],
        invariant_ok=check.ok,
        rollouts=check.rollouts,
        never_completed=check.never_completed,
        completed_more_than_once=check.completed_more_than_once,
        completed_without_start=check.completed_without_start,
    )


def _json_value(value: object) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no Infinity
    return value
