"""``POST /v1/query`` on a running ``fleetroll serve`` process cannot hurt the service.

The service is a real process on loopback, the test another: what the query
does to the service's interpreter (its GIL, its memory) cannot reach the
client that measures it.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from telemetry_helpers import child_env, insert_event

from fleetroll.telemetry.store import connect

#: Integration tests (real processes over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

TOKEN = "a-query-test-token-of-32-characters"
QUERY_TIMEOUT_S = 5.0
#: 30 characters that backtrack exponentially in Python's `re` on "aaa…a!" (no '@'):
#: 2**32 ways to split the 32 a's between the inner and the outer `+`.
BACKTRACKING = r"^([a-z0-9._%-]+)+@[a-z]+\.com$"
VICTIM = "a" * 32 + "!"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("query-service") / "telemetry.db"
    conn = connect(db)
    try:
        insert_event(conn, VICTIM, n=1)
        for n, value in enumerate([1.0, 2.0, 4.0], start=2):
            insert_event(conn, "fleet_rollout_completed", n=n, duration_s=value)
    finally:
        conn.close()
    return db


@pytest.fixture(scope="module")
async def service(store: Path) -> AsyncIterator[httpx.AsyncClient]:
    """``fleetroll serve --port 0`` on ``store``, and a client of it (the token sent)."""
    env = child_env() | {
        "FLEETROLL_SERVICE_TOKEN": TOKEN,
        "FLEETROLL_TELEMETRY__DB_PATH": str(store),
        "FLEETROLL_TELEMETRY__SEND_TO_LOGFIRE": "false",
        "FLEETROLL_SERVICE__QUERY_TIMEOUT_S": str(QUERY_TIMEOUT_S),
        "FLEETROLL_SERVICE__QUERY_MAX_BYTES": "4096",
    }
    command = [sys.executable, "-m", "fleetroll", "serve", "--port", "0"]
    async with await anyio.open_process(command, env=env) as process:
        try:
            assert process.stderr is not None
            said = b""
            with anyio.fail_after(90):
                while (found := re.search(rb"fleetroll serve: (http://\S+) ", said)) is None:
                    said += await process.stderr.receive()
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(
                base_url=found.group(1).decode(), headers=headers, timeout=60
            ) as client:
                yield client
        finally:
            with anyio.CancelScope(shield=True):
                process.send_signal(signal.SIGINT)  # it stops its emulator's processes
                with anyio.move_on_after(30):
                    await process.wait()
                if process.returncode is None:  # frozen: it cannot hear SIGINT
                    process.kill()
                    with anyio.move_on_after(10):
                        await process.wait()


async def test_a_backtracking_pattern_leaves_healthz_answering_within_a_second_throughout(
    service: httpx.AsyncClient,
) -> None:
    slow: list[str] = []  # /healthz polls that took a second or more
    polls = 0
    done = anyio.Event()
    answer: list[httpx.Response] = []

    async def healthz_until_done() -> None:
        nonlocal polls
        while True:
            finished = done.is_set()
            with anyio.move_on_after(1.0) as poll:
                ok = await service.get("/healthz")
                assert ok.status_code == 200, ok.text
            polls += 1
            if poll.cancelled_caught:
                slow.append(f"poll {polls}")
                done.set()  # the service froze: no need to wait for the query
                return
            if finished:
                return  # one more poll after the answer, as the service settles
            await anyio.sleep(0.05)  # a poll every 50 ms, while the query runs

    async def query() -> None:
        sql = "SELECT count(*) FROM records WHERE message ~ ?"
        with anyio.move_on_after(QUERY_TIMEOUT_S + 5):
            answer.append(
                await service.post("/v1/query", json={"sql": sql, "params": [BACKTRACKING]})
            )
        done.set()

    with anyio.fail_after(60):
        assert (await service.get("/healthz")).status_code == 200
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(healthz_until_done)
            tg.start_soon(query)
        elapsed = time.monotonic() - started

    assert not slow, f"/healthz took 1 s or more while the query ran ({slow[0]})"
    assert polls >= 2
    assert answer, f"the query did not end within {QUERY_TIMEOUT_S + 5:g} s"
    assert answer[0].status_code == 200, answer[0].text
    assert answer[0].json()["rows"] == [[0]]  # no '@': no match, the right answer
    assert elapsed < QUERY_TIMEOUT_S


@pytest.mark.parametrize(
    ("sql", "params", "said"),
    [
        ("SELECT " + "(" * 600 + "1" + ")" * 600, None, "nested too deeply"),
        ("SELECT " + "1 + " * 3000 + "1", None, "nested too deeply"),
        ("SELECT (", None, "line 1, column 8 near '(': something is missing after it"),
        ("SELECT FROM", None, "line 1, column 8 near 'FROM': expected table name"),
        ("SELECT * FROM records WHERE", None, "near 'WHERE': something is missing after it"),
        ("SELECT ?", [2**70], "a parameter is out of range"),
        ("SELECT ?", [[1, 2]], "type 'list' is not supported"),
        ("SELECT :since", {"other": 1}, "a value for binding parameter :since"),
        ("SELECT now() - interval '99999999999 days'", None, "out of range"),
        ("SELECT message ~ '(a)\\1' FROM records", None, "no backreferences"),
        (
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)"
            " SELECT i % 2, array_agg(printf('%020d', i)) FROM n GROUP BY 1",
            None,
            "array_agg holds over the 4096 byte limit (service.query_max_bytes)",
        ),
        (
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 10000)"
            " SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY i) FROM n",
            None,
            "percentile_cont holds over the 4096 byte limit",
        ),
    ],
)
async def test_bad_sql_and_bad_parameters_are_a_400_with_one_line(
    service: httpx.AsyncClient, sql: str, params: object, said: str
) -> None:
    with anyio.fail_after(30):
        answer = await service.post("/v1/query", json={"sql": sql, "params": params})
    assert answer.status_code == 400, answer.text
    detail = answer.json()["detail"]
    assert said in detail
    assert "\n" not in detail and "Traceback" not in detail
    assert not re.search(r"<class|<token|sqlglot|FR_", detail, re.I), detail


async def test_a_huge_since_on_the_dashboard_is_a_422_not_a_500(
    service: httpx.AsyncClient,
) -> None:
    with anyio.fail_after(30):
        answer = await service.get("/dashboard/data", params={"since": "99999999999d"})
    assert answer.status_code == 422, answer.text
    assert "before year 1" in answer.text


async def test_percentiles_within_the_budget_still_answer(service: httpx.AsyncClient) -> None:
    sql = (
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY (attributes->>'duration_s')::float)"
        " FROM records WHERE message = 'fleet_rollout_completed'"
    )
    with anyio.fail_after(30):
        answer = await service.post("/v1/query", json={"sql": sql})
    assert answer.status_code == 200, answer.text
    assert math.isclose(answer.json()["rows"][0][0], 2.0)
