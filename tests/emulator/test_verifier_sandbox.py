"""The emulator's verifier workers are sandboxes: code from a task sees none of ours.

Each test runs real worker processes (``verifier_child.py``) through
:class:`VerifierRunner`, as the emulator's ``/v1/verifiers/execute`` does.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import pickle
import socket
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.emulator.verifiers import VerifierRunner
from fleetroll.settings.sections import VerifierLimits

SECRETS = {
    "FLEETROLL_SERVICE_TOKEN": "svc-token-0123456789abcdef",
    "OPENAI_API_KEY": "sk-test-0123456789abcdef",
    "LOGFIRE_TOKEN": "pylf_v1_us_0123456789abcdef",
    "FLEET_API_KEY": "fleet-key-0123456789abcdef",
}


@pytest.fixture
async def runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AsyncIterator[VerifierRunner]:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    # The emulator's own working directory holds something precious: it must survive.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precious.txt").write_text("keep me")
    limits = VerifierLimits(cpu_s=2, max_output_bytes=64 * 1024, max_answer_bytes=1024 * 1024)
    r = VerifierRunner(limits=limits, max_parallel=2)
    try:
        yield r
    finally:
        await r.aclose()
    assert (tmp_path / "precious.txt").read_text() == "keep me"


async def verify(runner: VerifierRunner, code: str, timeout_s: float = 30) -> dict[str, Any]:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("verifier.py", code)
    bundle = buffer.getvalue()
    sha = hashlib.sha256(bundle).hexdigest()
    runner.add_bundle(sha, bundle)
    args = base64.b64encode(pickle.dumps({"args": (None, {"env": "i-1"}), "kwargs": {}})).decode()
    with anyio.fail_after(timeout_s + 10):
        return await runner.execute(
            sha256=sha,
            function_name="verify",
            args_b64=args,
            instance_id="i-1",
            databases={},
            timeout_s=timeout_s,
        )


async def test_a_verifier_sees_none_of_the_servers_secrets(runner: VerifierRunner) -> None:
    answer = await verify(
        runner,
        "import os\ndef verify(env):\n    print(dict(os.environ))\n    return dict(os.environ)\n",
    )
    assert answer["success"], answer
    seen = repr(answer)
    for name, value in SECRETS.items():
        assert name not in answer["result"]
        assert value not in seen


async def test_a_verifier_runs_in_a_private_folder_that_is_emptied_and_removed(
    runner: VerifierRunner, tmp_path: Path
) -> None:
    first = await verify(
        runner,
        "import os, stat\n"
        "def verify(env):\n"
        "    open('left.txt', 'w').write('x')\n"
        "    mode = stat.S_IMODE(os.stat('.').st_mode)\n"
        "    return {'cwd': os.getcwd(), 'mode': mode}\n",
    )
    assert first["success"], first
    cwd = first["result"]["cwd"]
    assert cwd != str(tmp_path)
    assert Path(cwd).name.startswith("fleetroll-verifier-")
    assert first["result"]["mode"] == 0o700
    second = await verify(
        runner,
        "import os\ndef verify(env):\n    return {'cwd': os.getcwd(), 'files': os.listdir()}\n",
    )
    assert second["result"] == {"cwd": cwd, "files": []}  # the same worker; nothing left over
    await runner.aclose()
    assert not Path(cwd).exists()


async def test_a_verifier_spinning_on_the_cpu_is_stopped_by_its_cpu_cap(
    runner: VerifierRunner,
) -> None:
    answer = await verify(runner, "def verify(env):\n    while True:\n        pass\n", timeout_s=60)
    assert not answer["success"]
    assert answer["error"]["type"] == "CPUTimeExceeded"
    # The worker is usable again: the cap is per run.
    again = await verify(runner, "def verify(env):\n    return 1.0\n")
    assert again["success"] and again["result"] == 1.0


async def test_a_verifier_that_swallows_the_cpu_signal_is_killed_at_its_timeout(
    runner: VerifierRunner,
) -> None:
    answer = await verify(
        runner,
        "def verify(env):\n"
        "    while True:\n"
        "        try:\n"
        "            while True:\n"
        "                pass\n"
        "        except Exception:\n"
        "            pass\n",
        timeout_s=4,
    )
    assert not answer["success"]
    assert answer["error"]["type"] == "TimeoutError"
    assert runner.live_workers == 0


async def test_what_a_verifier_prints_is_kept_only_up_to_the_cap(runner: VerifierRunner) -> None:
    answer = await verify(
        runner, "def verify(env):\n    print('x' * 50_000_000)\n    return 1.0\n", timeout_s=60
    )
    assert answer["success"], answer["error"]
    assert answer["result"] == 1.0
    assert len(answer["stdout"]) < 64 * 1024 + 100
    assert "output truncated" in answer["stdout"]


async def test_an_answer_over_the_cap_is_an_error_and_leaks_no_worker(
    runner: VerifierRunner,
) -> None:
    for _ in range(3):
        answer = await verify(runner, "def verify(env):\n    return 'y' * 5_000_000\n")
        assert not answer["success"]
        assert answer["error"]["type"] == "AnswerTooLarge"
    assert runner.live_workers <= 2


async def test_writing_to_the_real_stdout_cannot_corrupt_the_answer(
    runner: VerifierRunner,
) -> None:
    answer = await verify(
        runner,
        "import os\n"
        "def verify(env):\n"
        '    os.write(1, b\'{"success": true, "result": 99}\\n\')\n'
        "    return 0.5\n",
    )
    assert answer["success"] and answer["result"] == 0.5
    again = await verify(runner, "def verify(env):\n    return 0.25\n")
    assert again["result"] == 0.25


async def test_a_verifier_has_no_network_where_the_machine_allows_it(
    runner: VerifierRunner,
) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        answer = await verify(
            runner,
            "import socket\n"
            "def verify(env):\n"
            "    try:\n"
            f"        socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
            "        return 'connected'\n"
            "    except OSError as exc:\n"
            "        return type(exc).__name__\n",
        )
    if not runner.network_isolated:
        pytest.skip("unshare -rn is not available to this user: workers keep the network")
    assert answer["result"] != "connected"


async def test_a_worker_refuses_to_empty_a_folder_that_is_not_its_own(tmp_path: Path) -> None:
    import subprocess
    import sys

    from fleetroll.emulator import verifier_child

    victim = tmp_path / "fleetroll-verifier-not-private"
    victim.mkdir(mode=0o755)
    (victim / "data.txt").write_text("keep")
    done = subprocess.run(
        [sys.executable, "-I", verifier_child.__file__, f"--workdir={victim}"],
        cwd=victim,
        input=b"",
        capture_output=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert b"refusing to empty" in done.stderr
    assert (victim / "data.txt").read_text() == "keep"
    assert os.path.isdir(victim)
