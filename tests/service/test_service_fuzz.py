"""A bounded property-based fuzz run of the API, generated from its own OpenAPI document.

Schemathesis makes requests from the document's schemas, valid ones and
invalid ones, for every operation; each answer must not be a 5xx, must use
a documented status and content type, and must match its documented schema.
The run is bounded: a fixed number of examples per operation, no shrinking,
a timeout on every request, and a deadline on the whole run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from service_helpers import LEDGER, Running, running_service, task_record

from fleetroll.emulator import Emulator
from fleetroll.telemetry.store import connect

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

# Imported here, not in the fuzzing thread: importing parses (pytest rewrites
# modules), and CPython 3.11's parser must not run in two threads at once.
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 12
REQUEST_TIMEOUT_S = 15.0
RUN_DEADLINE_S = 300.0


@pytest.fixture
async def fuzzed(emulator: Emulator, tmp_path: Path) -> AsyncIterator[Running]:
    db = tmp_path / "telemetry.db"
    connect(db).close()  # an empty telemetry store
    settings = {
        # Batches the fuzz starts never reach their verifier while it runs (the
        # seeded one says otherwise): CPython 3.11's parser, which schemathesis's
        # lazy imports use in the fuzzing thread, must not run in two threads at
        # once, and the verifier step parses on the event loop's thread.
        "policy": {"think_time_s": 3600},
        "telemetry": {"db_path": str(db)},
        "service": {
            "max_batch_rollouts": 4,
            "session_idle_s": 30.0,
            "max_body_bytes": 65536,
            "query_timeout_s": 1.0,
            "tasks_root": str(tmp_path),
        },
    }
    async with running_service(emulator, **settings) as running:
        yield running


def fuzz(document: dict[str, Any], base_url: str, known: dict[str, str]) -> dict[str, int]:
    """Run every operation's examples (blocking: a worker thread); answers by status.

    Operations on a batch, a tree or a session run a third time with ``known`` ids, so
    the fuzz also reaches live objects, not only 404s.
    """
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    statuses: dict[str, int] = {}
    schema = schemathesis.openapi.from_dict(document)
    for result in schema.get_all_operations():
        operation = result.ok()
        passes: list[tuple[Any, dict[str, str] | None]] = [
            (GenerationMode.POSITIVE, None),
            (GenerationMode.NEGATIVE, None),
        ]
        ids = {name: v for name, v in known.items() if f"{{{name}}}" in operation.path}
        if ids:
            passes.append((GenerationMode.POSITIVE, ids))
        for mode, path_parameters in passes:

            @given(
                case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)
            )
            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Any) -> None:
                response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
                case.validate_response(response, checks=checks)
                key = f"{case.method} {case.path} {response.status_code}"
                statuses[key] = statuses.get(key, 0) + 1

            try:
                run()
            except Unsatisfiable:
                # No invalid input exists for an operation that takes none (GET /healthz).
                assert mode is GenerationMode.NEGATIVE
    return statuses


async def test_a_bounded_fuzz_run_finds_no_server_error_and_no_hang(
    fuzzed: Running, emulator: Emulator
) -> None:
    async with httpx.AsyncClient(base_url=fuzzed.url, timeout=30) as http:
        document = (await http.get("/openapi.json")).json()
        task = task_record(LEDGER[0])
        seed = {"tasks": [task], "batch_id": "fuzz", "policy": {"think_time_s": 0}}
        batch = await http.post("/v1/batches", json=seed)
        await http.get("/v1/batches/fuzz/results")  # to its end line
        session = await http.post("/v1/sessions", json={"task": task})
        seed_tree = {"task": task, "branch_at": 1, "width": 2, "tree_id": "fuzz-tree"}
        tree = await http.post("/v1/trees", json=seed_tree | {"policy": {"think_time_s": 0}})
        await http.get("/v1/trees/fuzz-tree/results")  # to its end line
    known = {
        "batch_id": batch.json()["batch_id"],
        "session_id": session.json()["session_id"],
        "tree_id": tree.json()["tree_id"],
    }
    with anyio.fail_after(RUN_DEADLINE_S):
        statuses = await anyio.to_thread.run_sync(
            fuzz, document, fuzzed.url, known, abandon_on_cancel=True
        )
    exercised = {key.rsplit(" ", 1)[0] for key in statuses}
    documented = {
        f"{method.upper()} {path}"
        for path, item in document["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert exercised == documented, statuses  # every operation answered
    assert not any(key.endswith((" 500", " 502", " 503", " 504")) for key in statuses)
