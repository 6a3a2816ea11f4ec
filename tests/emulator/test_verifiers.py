"""Verifiers run as on Fleet: through the SDK, in a subprocess, capped and timed."""

from __future__ import annotations

import os

import pytest
from fleet._async.tasks import Task

from fleetroll.emulator import Emulator
from fleetroll.settings.sections import VerifierLimits

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


def task(code: str) -> Task:
    return Task(key="verifier-test", prompt="p", env_id="ledger", version="v1", verifier_func=code)


async def verify(sdk, code: str, **kwargs):
    async with Emulator(verifier_limits=VerifierLimits(memory_mb=256)) as emu:
        env = await sdk(emu).make("ledger", data_key="seed")
        try:
            return await task(code).verify_detailed_async(env, **kwargs)
        finally:
            await env.close()


async def test_a_verifier_reads_the_instance_database_and_gets_the_final_answer(sdk) -> None:
    code = (
        "@verifier(key='x')\n"
        "def check(env, final_answer=None):\n"
        "    rows = env.db('current').query('SELECT COUNT(*) FROM accounts').rows\n"
        "    print('accounts', rows[0][0])\n"
        "    return 1.0 if rows[0][0] == 11 and final_answer == 'yes' else 0.0\n"
    )
    response = await verify(sdk, code, final_answer="yes")
    assert response.success and response.result == 1.0
    assert response.stdout == "accounts 11\n" and response.execution_id


async def test_a_verifier_that_raises_reports_its_error_type_and_message(sdk) -> None:
    response = await verify(sdk, "def v(env, final_answer=None):\n    raise KeyError('boom')\n")
    assert not response.success and response.result is None
    assert response.error is not None and response.error["type"] == "KeyError"
    assert "boom" in response.error["message"]


async def test_a_verifier_that_runs_forever_is_stopped_at_its_timeout(sdk) -> None:
    code = "def v(env, final_answer=None):\n    while True:\n        pass\n"
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger")
        verifier = task(code)
        verifier._rebuild_verifier()
        bundle, sha = verifier.verifier._get_or_create_bundle()
        response = await env.execute_verifier_remote(
            bundle_data=bundle,
            bundle_sha=sha,
            key="k",
            function_name="v",
            args=(),
            args_array=[{"env": env.instance_id}],
            kwargs={},
            timeout=1,
        )
        await env.close()
    assert not response.success and response.error["type"] == "TimeoutError"


async def test_a_verifier_over_its_memory_cap_fails_without_hurting_the_emulator(sdk) -> None:
    code = "def v(env, final_answer=None):\n    x = bytearray(1024 * 1024 * 1024)\n    return 1.0\n"
    response = await verify(sdk, code)
    assert not response.success and response.error["type"] == "MemoryError"


async def test_a_verifier_runs_in_another_process(sdk) -> None:
    code = "import os\ndef v(env, final_answer=None):\n    return os.getpid()\n"
    response = await verify(sdk, code)
    assert response.success and response.result != os.getpid()


async def test_a_verifier_cannot_write_to_the_instance_database(sdk) -> None:
    code = (
        "def v(env, final_answer=None):\n"
        "    env.db('current').query('DELETE FROM accounts')\n    return 1.0\n"
    )
    response = await verify(sdk, code)
    assert not response.success and "readonly" in response.error["message"]
