"""The dashboard's data as typed models: one shape, whatever the store holds."""

from __future__ import annotations

import sqlite3
from dataclasses import fields
from pathlib import Path
from typing import Any

from telemetry_helpers import insert_event

from fleetroll.telemetry.dashboard import DEFAULT_PANELS, empty_snapshot, snapshot
from fleetroll.telemetry.dashboard_models import Cost
from fleetroll.telemetry.queries import COST_FIELDS


def _keys(answer: Any, path: str = "") -> set[str]:
    """Every object key of a JSON answer, by path (a list's items share one path)."""
    if isinstance(answer, dict):
        return {
            key
            for name, value in answer.items()
            for key in {f"{path}.{name}", *_keys(value, f"{path}.{name}")}
        }
    if isinstance(answer, list):
        return {key for item in answer for key in _keys(item, f"{path}[]")}
    return set()


def test_the_dashboard_answers_the_same_keys_with_no_store_as_with_a_full_one(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    at = "2026-01-01T00:01:00.000000Z"
    insert_event(conn, "fleet_batch_started", n=1, at=at, batch_id="b", rollouts=1, total=1)
    insert_event(conn, "fleet_rollout_started", n=2, at=at, batch_id="b", rollout_id="r")
    conn.commit()
    full = snapshot(db)
    empty = empty_snapshot(None, None, "no telemetry store yet", DEFAULT_PANELS).as_json()

    assert set(empty) - set(full) == {"note"}  # why there is nothing, said only then

    # Not compared: the items of lists (empty in one) and the progress (null in one).
    def objects(answer: dict[str, Any]) -> set[str]:
        return {k for k in _keys(answer) if "[]" not in k and not k.startswith(".progress.")}

    assert objects(empty) - {".note"} == objects(full)


def test_the_dashboard_s_cost_has_a_field_for_every_cost_field_of_the_results() -> None:
    assert [f.name for f in fields(Cost)] == ["completed", *COST_FIELDS]
