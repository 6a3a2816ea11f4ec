from __future__ import annotations

import compileall
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetroll._internal.pydantic_plugins import skip_unused_pydantic_plugins

# As the fleetroll command does for itself, before any model is built, for every
# process of the run: the workers, what they start (snippets, examples, Ray's
# workers) and what those start. ~0.5 s of CPU less per process; nothing changes.
skip_unused_pydantic_plugins(os.environ)

import fleetroll  # noqa: E402
from fleetroll.emulator import Emulator  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Compile fleetroll's modules once, before the workers start.

    With ``PYTHONDONTWRITEBYTECODE`` set (as on this project's machines) Python
    writes no ``.pyc``, and an editable install's sources have none from the
    install: every process the suite starts (each ``fleetroll`` command, each
    emulator, each Ray actor) then compiled every fleetroll module again,
    ~0.45 s of CPU per process. Reading a ``.pyc`` is allowed with the variable
    set; only writing is not, and compileall writes.
    """
    if hasattr(config, "workerinput") or not sys.flags.dont_write_bytecode:
        return  # an xdist worker (its controller compiled), or Python writes them itself
    compileall.compile_dir(Path(fleetroll.__file__).parent, quiet=1)


#: Files whose tests keep one worker longest (Ray's start and actors, the load tests,
#: the commands run as a user runs them), scheduled first: started last, one of them
#: would run on alone while the other workers sit idle at the end of the run.
LONGEST_FIRST = (
    "test_ray_pool.py",
    "test_pool.py",
    "test_cli.py",
    "test_docs_snippets.py",
    "test_control_plane.py",
    "test_bench_smoke.py",
    "test_mcp_provider.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session", autouse=True)
def _outside_the_repository(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run every test, and whatever it starts, in a scratch folder, never in the checkout.

    A test (or a server or worker it starts) that writes or deletes in its working directory
    then touches only a folder made for this run.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture(scope="session")
def anyio_backend() -> Any:
    """One backend for the whole run, so module-scoped async fixtures can exist."""
    if os.environ.get("FLEETROLL_TEST_UVLOOP"):
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray instance for a module's tests (the Ray tests are one module).

    Starting Ray costs seconds of CPU (its GCS, raylet and first workers): once
    per run, not once per test; stopped after the module, so it does not idle on
    the run's two cores through the other files.
    """
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
async def emulator() -> AsyncIterator[Emulator]:
    """An emulator with no faults, shared by the tests of one module."""
    async with Emulator() as emu:
        yield emu
