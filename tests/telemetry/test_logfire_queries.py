"""Logfire-style queries, written as on Logfire, on a store filled by real batches on the emulator.

The SQL follows Logfire's documentation (Explore view, dashboard recipes,
the SQL reference: ``COUNT()``, ``level > 'info'``, ``is_exception``,
``time_bucket``, ``percentile_cont``/``approx_percentile_cont``) and Fleet's
OpenEnv dashboards on ``fleet_rollout_completed`` (success rate per env, p95
duration, rollouts per minute, error types, reward per batch). Each answer
is checked against the batches' own results, or against the same numbers
computed in Python from the rows: not only "it ran".
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from telemetry_helpers import local_settings

from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import open_telemetry
from fleetroll.telemetry.queries import query, stats

#: Integration tests (the emulator over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
DESKTOP = load_tasks(config_dir() / "tasks" / "desktop.jsonl", modalities=SETTINGS.modalities)
FAULTS = FaultProfile(
    seed=17,
    create_latency=Latency(min_s=0.01, max_s=0.1),
    p_create_5xx=0.25,
    retry_after_s=0.01,
    p_tool_error=0.1,
    p_verifier_error=0.2,
)
BATCH_SETTINGS = {
    "provisioning": {
        "creates_per_second": 1000,
        "max_attempts": 2,  # so that some creates give up: init_error
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.02,
    },
    "pool": {"concurrency": 16},
}
COMPLETED = "message = 'fleet_rollout_completed'"


@dataclass(frozen=True)
class Store:
    db: Path
    results: list[RolloutResult]

    def run(self, sql: str) -> list[dict[str, Any]]:
        """The rows of Logfire-style ``sql``, as dicts."""
        return query(self.db, sql).dicts()

    def raw(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows of plain SQLite SQL (no translation), to compute expectations from."""
        return query(self.db, sql, dialect="sqlite").rows


async def run_batches(db: Path) -> list[RolloutResult]:
    settings = local_settings(db, **BATCH_SETTINGS)
    results: list[RolloutResult] = []
    async with (
        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events,
        Emulator(FAULTS) as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as pool,
    ):
        policy = ScriptedPolicy(think_time_s=0.01)
        with anyio.fail_after(180):
            for batch_id, tasks in (("b1", [*LEDGER, *DESKTOP]), ("b2", LEDGER[:8])):
                batch = pool.run_batch(tasks, policy, samples_per_task=2, batch_id=batch_id)
                results += [result async for result in batch]
    return results


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """One store with two finished batches, shared by this module's tests (they only read)."""
    db = tmp_path_factory.mktemp("logfire") / "telemetry.db"
    made = Store(db, anyio.run(run_batches, db))
    assert {r.failure_reason for r in made.results} > {None}, "no failures: weaker checks"
    return made


def by(results: list[RolloutResult], key: str) -> dict[str, list[RolloutResult]]:
    groups: dict[str, list[RolloutResult]] = defaultdict(list)
    for r in results:
        groups[getattr(r, key)].append(r)
    return groups


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# -- Fleet / OpenEnv dashboard queries on fleet_rollout_completed ------------------------


def test_success_rate_per_env_with_a_float_cast_of_a_filtered_count(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'env_key' AS env, "
        "count(*) FILTER (WHERE attributes->>'failure_reason' IS NULL)::float / count(*) "
        f"AS success_rate FROM records WHERE {COMPLETED} GROUP BY 1 ORDER BY 1"
    )
    expected = {
        env: sum(r.failure_reason is None for r in rs) / len(rs)
        for env, rs in by(store.results, "env_key").items()
    }
    assert {r["env"]: r["success_rate"] for r in rows} == pytest.approx(expected)
    assert [r["env"] for r in rows] == sorted(expected)


def test_p95_rollout_duration_per_env_with_percentile_cont_within_group(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'env_key' AS env, percentile_cont(0.95) WITHIN GROUP "
        "(ORDER BY (attributes->>'duration_s')::float) AS p95_s "
        f"FROM records WHERE {COMPLETED} GROUP BY env"
    )
    expected = {
        env: percentile([round(r.timings.total_s, 4) for r in rs], 0.95)
        for env, rs in by(store.results, "env_key").items()
    }
    assert {r["env"]: r["p95_s"] for r in rows} == pytest.approx(expected)


def test_rollouts_per_minute_with_date_trunc(store: Store) -> None:
    rows = store.run(
        "SELECT date_trunc('minute', start_timestamp) AS minute, count(*) AS rollouts "
        f"FROM records WHERE {COMPLETED} GROUP BY 1 ORDER BY 1"
    )
    stamps = [ts for (ts,) in store.raw(f"SELECT start_timestamp FROM records WHERE {COMPLETED}")]
    expected = Counter(ts[:16] + ":00.000000Z" for ts in stamps)
    assert {r["minute"]: r["rollouts"] for r in rows} == expected
    assert sum(r["rollouts"] for r in rows) == len(store.results)


def test_rollouts_per_five_seconds_with_time_bucket(store: Store) -> None:
    rows = store.run(
        "SELECT time_bucket('5 seconds', start_timestamp) AS x, COUNT() AS n "
        f"FROM records WHERE {COMPLETED} GROUP BY x ORDER BY x"
    )
    stamps = [ts for (ts,) in store.raw(f"SELECT start_timestamp FROM records WHERE {COMPLETED}")]

    def bucket(ts: str) -> str:
        seconds = datetime.fromisoformat(ts).timestamp()
        start = datetime.fromtimestamp(seconds // 5 * 5, datetime.fromisoformat(ts).tzinfo)
        return start.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    assert {r["x"]: r["n"] for r in rows} == Counter(bucket(ts) for ts in stamps)


def test_error_types_by_count(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'failure_reason' AS reason, count(*) AS n FROM records "
        f"WHERE {COMPLETED} AND attributes->>'failure_reason' IS NOT NULL "
        "GROUP BY reason ORDER BY n DESC, reason"
    )
    expected = Counter(r.failure_reason.value for r in store.results if r.failure_reason)
    assert {r["reason"]: r["n"] for r in rows} == expected
    assert [r["n"] for r in rows] == sorted(expected.values(), reverse=True)


def test_reward_mean_per_batch(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'batch_id' AS batch, avg((attributes->>'reward')::float) AS mean, "
        "count(attributes->>'reward') AS rewarded, count(*) AS rollouts "
        f"FROM records WHERE {COMPLETED} GROUP BY 1 ORDER BY 1"
    )
    assert [r["batch"] for r in rows] == ["b1", "b2"]
    for row in rows:
        batch = [r for r in store.results if r.batch_id == row["batch"]]
        rewards = [r.reward for r in batch if r.reward is not None]
        assert row["rollouts"] == len(batch)
        assert row["rewarded"] == len(rewards)
        assert row["mean"] == pytest.approx(statistics.fmean(rewards))


def test_outcomes_with_coalesce(store: Store) -> None:
    rows = store.run(
        "SELECT COALESCE(attributes->>'failure_reason', 'completed') AS outcome, count(*) AS n "
        f"FROM records WHERE {COMPLETED} GROUP BY 1"
    )
    expected = Counter(
        r.failure_reason.value if r.failure_reason else "completed" for r in store.results
    )
    assert {r["outcome"]: r["n"] for r in rows} == expected


def test_outcomes_with_case(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'modality' AS modality, "
        "sum(CASE WHEN attributes->>'status' = 'completed' THEN 1 ELSE 0 END) AS ok, "
        "sum(CASE WHEN attributes->>'status' = 'failed' THEN 1 ELSE 0 END) AS failed "
        f"FROM records WHERE {COMPLETED} GROUP BY 1"
    )
    for row in rows:
        group = [r for r in store.results if r.modality == row["modality"]]
        assert row["ok"] == sum(r.status == "completed" for r in group)
        assert row["failed"] == sum(r.status == "failed" for r in group)
    assert sum(row["ok"] + row["failed"] for row in rows) == len(store.results)


def test_batch_counts_read_with_nested_arrows(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'batch_id' AS batch, "
        "(attributes->'counts'->>'completed')::int AS completed "
        "FROM records WHERE message = 'fleet_batch_completed' ORDER BY 1"
    )
    for row in rows:
        batch = [r for r in store.results if r.batch_id == row["batch"]]
        assert row["completed"] == sum(r.failure_reason is None for r in batch)
    assert [r["batch"] for r in rows] == ["b1", "b2"]


def test_provisioning_percentiles_agree_with_fleetroll_stats(store: Store) -> None:
    [row] = store.run(
        "SELECT approx_percentile_cont((attributes->>'provisioning_time_s')::float, 0.5) AS p50, "
        "percentile_cont(0.95) WITHIN GROUP (ORDER BY (attributes->>'provisioning_time_s')::float)"
        " AS p95, median((attributes->>'provisioning_time_s')::float) AS median "
        "FROM records WHERE message = 'fleet_provisioning_completed' "
        "AND attributes->>'batch_id' = 'b2'"
    )
    [expected] = stats(store.db, "b2")
    assert row["p50"] == pytest.approx(expected["provisioning_p50_s"])
    assert row["median"] == pytest.approx(expected["provisioning_p50_s"])
    assert row["p95"] == pytest.approx(expected["provisioning_p95_s"])


def test_tool_errors_and_mean_steps_per_env(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'env_key' AS env, sum((attributes->>'tool_errors')::int) AS errors,"
        " avg((attributes->>'step_count')::int)::numeric AS steps "
        f"FROM records WHERE {COMPLETED} GROUP BY 1"
    )
    groups = by(store.results, "env_key")
    for row in rows:
        assert row["errors"] == sum(r.tool_errors for r in groups[row["env"]])
        assert row["steps"] == pytest.approx(statistics.fmean(r.steps for r in groups[row["env"]]))


def test_tasks_that_fail_most_with_limit(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'task_key' AS task, "
        "count(*) FILTER (WHERE attributes->>'failure_reason' IS NOT NULL) AS failed "
        f"FROM records WHERE {COMPLETED} GROUP BY task ORDER BY failed DESC, task LIMIT 5"
    )
    failed = Counter({r.task_key: 0 for r in store.results})
    failed.update(r.task_key for r in store.results if r.failure_reason)
    expected = sorted(failed.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    assert [(r["task"], r["failed"]) for r in rows] == expected


def test_groups_whose_samples_all_got_the_same_reward_with_a_cte(store: Store) -> None:
    [row] = store.run(
        "WITH g AS (SELECT attributes->>'batch_id' AS batch, attributes->>'task_key' AS task, "
        "min((attributes->>'reward')::float) AS lo, max((attributes->>'reward')::float) AS hi, "
        "count(attributes->>'reward') AS n "
        f"FROM records WHERE {COMPLETED} GROUP BY 1, 2) "
        "SELECT count(*) FILTER (WHERE n = 2 AND lo = hi) AS uniform FROM g"
    )
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in store.results:
        if r.reward is not None:
            groups[(r.batch_id, r.task_key)].append(r.reward)
    assert row["uniform"] == sum(1 for v in groups.values() if len(v) == 2 and v[0] == v[1])


def test_reward_spread_with_stddev(store: Store) -> None:
    [row] = store.run(
        f"SELECT stddev((attributes->>'reward')::float) AS sd FROM records WHERE {COMPLETED}"
    )
    rewards = [r.reward for r in store.results if r.reward is not None]
    assert row["sd"] == pytest.approx(statistics.stdev(rewards))


def test_distinct_instances_used(store: Store) -> None:
    [row] = store.run(
        f"SELECT count(DISTINCT attributes->>'instance_id') AS n FROM records WHERE {COMPLETED}"
    )
    assert row["n"] == len({r.instance_id for r in store.results if r.instance_id})


def test_every_started_rollout_completed_with_a_left_join(store: Store) -> None:
    rows = store.run(
        "SELECT s.attributes->>'rollout_id' AS rollout FROM records s "
        "LEFT JOIN records c ON c.message = 'fleet_rollout_completed' "
        "AND c.attributes->>'rollout_id' = s.attributes->>'rollout_id' "
        "WHERE s.message = 'fleet_rollout_started' AND c.span_id IS NULL"
    )
    assert rows == []


def test_rollout_time_from_its_start_and_completed_events_with_extract_epoch(
    store: Store,
) -> None:
    rows = store.run(
        "SELECT s.attributes->>'rollout_id' AS rollout, "
        "extract(epoch from c.start_timestamp - s.start_timestamp) AS seconds "
        "FROM records s JOIN records c ON c.attributes->>'rollout_id' = s.attributes->>'rollout_id'"
        " WHERE s.message = 'fleet_rollout_started' AND c.message = 'fleet_rollout_completed' "
        "AND s.attributes->>'batch_id' = 'b2'"
    )
    pairs = store.raw(
        "SELECT s.start_timestamp, c.start_timestamp FROM records s JOIN records c "
        "ON c.attributes->>'rollout_id' = s.attributes->>'rollout_id' "
        "WHERE s.message = 'fleet_rollout_started' AND c.message = 'fleet_rollout_completed' "
        "AND s.attributes->>'batch_id' = 'b2'"
    )
    expected = sorted(
        (datetime.fromisoformat(c) - datetime.fromisoformat(s)).total_seconds() for s, c in pairs
    )
    assert sorted(r["seconds"] for r in rows) == pytest.approx(expected)
    assert len(rows) == sum(r.batch_id == "b2" for r in store.results)


# -- Logfire documentation style --------------------------------------------------------


def test_most_common_span_names_with_count_and_no_argument(store: Store) -> None:
    rows = store.run(
        "SELECT COUNT() AS count, span_name FROM records GROUP BY span_name ORDER BY count DESC"
    )
    names = Counter(name for (name,) in store.raw("SELECT span_name FROM records"))
    assert {r["span_name"]: r["count"] for r in rows} == names
    assert [r["count"] for r in rows] == sorted(names.values(), reverse=True)


def test_warnings_and_errors_with_level_above_info(store: Store) -> None:
    [row] = store.run("SELECT count(*) AS n FROM records WHERE level > 'info'")
    levels = Counter(level for (level,) in store.raw("SELECT level FROM records"))
    assert row["n"] == sum(n for level, n in levels.items() if level in ("warn", "error"))
    failed = sum(r.status == "failed" for r in store.results)
    [row] = store.run(f"SELECT count(*) AS n FROM records WHERE {COMPLETED} AND level >= 'warn'")
    assert row["n"] == failed


def test_errors_with_level_num(store: Store) -> None:
    [row] = store.run("SELECT count(*) AS n FROM records WHERE level >= level_num('error')")
    [(expected,)] = store.raw("SELECT count(*) FROM records WHERE level IN ('error', 'fatal')")
    assert row["n"] == expected


def test_exceptions_with_is_exception(store: Store) -> None:
    rows = store.run(
        "SELECT COUNT() AS count, exception_type FROM records WHERE is_exception "
        "GROUP BY exception_type ORDER BY count DESC"
    )
    [(expected,)] = store.raw("SELECT count(*) FROM records WHERE is_exception = 1")
    assert sum(r["count"] for r in rows) == expected


def test_recent_records_with_now_and_intervals(store: Store) -> None:
    [row] = store.run(
        "SELECT count(*) FILTER (WHERE start_timestamp > now() - interval '1 hour') AS hour, "
        "count(*) FILTER (WHERE start_timestamp > now() + interval '1 minute') AS future, "
        "count(*) FILTER (WHERE start_timestamp >= '2000-01-01'::timestamp) AS all_time "
        f"FROM records WHERE {COMPLETED}"
    )
    assert row == {"hour": len(store.results), "future": 0, "all_time": len(store.results)}


def test_failed_messages_with_ilike(store: Store) -> None:
    [row] = store.run(
        "SELECT count(*) AS n FROM records WHERE message ILIKE '%ROLLOUT_completed' "
        "AND attributes->>'status' ILIKE 'FAILED'"
    )
    assert row["n"] == sum(r.status == "failed" for r in store.results)


def test_batch_wall_time_and_throughput_with_extract_epoch(store: Store) -> None:
    rows = store.run(
        "SELECT attributes->>'batch_id' AS batch, "
        "extract(epoch from max(start_timestamp) - min(start_timestamp)) AS seconds, "
        "count(*) / (extract(epoch from max(start_timestamp) - min(start_timestamp)) / 60) "
        f"AS per_minute FROM records WHERE {COMPLETED} GROUP BY 1 ORDER BY 1"
    )
    for row in rows:
        stamps = [
            datetime.fromisoformat(ts)
            for (ts,) in store.raw(
                f"SELECT start_timestamp FROM records WHERE {COMPLETED} "
                f"AND attributes->>'batch_id' = '{row['batch']}'"
            )
        ]
        seconds = (max(stamps) - min(stamps)).total_seconds()
        assert row["seconds"] == pytest.approx(seconds)
        assert row["per_minute"] == pytest.approx(len(stamps) / (seconds / 60))
