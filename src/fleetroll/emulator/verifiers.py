"""Verifier execution as Fleet performs it: bundles by sha256, run out of process.

The SDK (``AsyncVerifierFunction.remote_with_response``) first asks
``GET /v1/verifiers/check?sha256=`` whether the bundle is known, then posts
``/v1/verifiers/execute`` with the zip bundle (``verifier.py`` inside) when it
is not. Verifiers run in worker processes (``verifier_child.py``) under an
address-space cap, one run at a time per worker, each in a fresh namespace;
nothing of a verifier runs in the emulator's process (nor, therefore, in the
orchestrator's). A worker that passes a run's timeout or dies is killed and
replaced; every worker is replaced after ``_RUNS_PER_WORKER`` runs. Starting
a Python process per run cost ~50 ms of CPU, which capped a 2-core machine at
a few dozen verifications a second.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import uuid
import zipfile
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

__all__ = ["BundleError", "VerifierRunner"]

_CHILD = Path(__file__).with_name("verifier_child.py")
#: Cap on what Fleet accepts as an execute timeout (VerifiersExecuteRequest: 1..300).
MAX_TIMEOUT_S = 300
_RUNS_PER_WORKER = 500
_MAX_ANSWER_BYTES = 16 * 1024 * 1024


class BundleError(ValueError):
    """A bundle is missing, unreadable, or has no ``verifier.py``."""


class _Worker:
    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdout is not None
        self.stdout = BufferedByteReceiveStream(process.stdout)
        self.runs = 0

    async def ask(self, request: bytes) -> bytes:
        assert self.process.stdin is not None
        await self.process.stdin.send(request + b"\n")
        return await self.stdout.receive_until(b"\n", _MAX_ANSWER_BYTES)

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            # It may have exited since (e.g. on Ctrl-C, with the whole process
            # group): killing a reaped process raises.
            with suppress(ProcessLookupError):
                self.process.kill()
            with anyio.move_on_after(5):
                await self.process.wait()
            await self.process.aclose()


class VerifierRunner:
    """Keeps uploaded bundles and a pool of verifier worker processes."""

    def __init__(self, *, memory_mb: int = 512, max_parallel: int = 4) -> None:
        self._bundles: dict[str, str] = {}  # sha256 -> verifier.py source
        self._memory_mb = memory_mb
        self._limiter = anyio.CapacityLimiter(max_parallel)
        self._idle: list[_Worker] = []

    def has_bundle(self, sha256: str) -> bool:
        return sha256 in self._bundles

    def add_bundle(self, sha256: str, bundle: bytes) -> None:
        try:
            with zipfile.ZipFile(io.BytesIO(bundle)) as zf:
                code = zf.read("verifier.py").decode("utf-8")
        except (zipfile.BadZipFile, KeyError, UnicodeDecodeError) as exc:
            raise BundleError(f"bundle {sha256[:12]} has no readable verifier.py: {exc}") from exc
        self._bundles[sha256] = code

    async def execute(
        self,
        *,
        sha256: str,
        function_name: str,
        args_b64: str,
        instance_id: str,
        databases: dict[str, str],
        timeout_s: float,
    ) -> dict[str, Any]:
        """Run a known bundle's function; answer ``{success, result, error, stdout}``.

        Raises:
            BundleError: no bundle with that sha256 was uploaded.
        """
        code = self._bundles.get(sha256)
        if code is None:
            raise BundleError(f"bundle not found: {sha256}")
        request = json.dumps(
            {
                "code": code,
                "function_name": function_name,
                "args_b64": args_b64,
                "instance_id": instance_id,
                "databases": databases,
            }
        ).encode()
        timeout_s = max(1.0, min(timeout_s, MAX_TIMEOUT_S))
        async with self._limiter:
            started = time.monotonic()
            answer = await self._run(request, timeout_s)
            answer["execution_time_ms"] = int((time.monotonic() - started) * 1000)
        answer["execution_id"] = uuid.uuid4().hex
        return answer

    async def _run(self, request: bytes, timeout_s: float) -> dict[str, Any]:
        worker = self._idle.pop() if self._idle else await self._spawn()
        try:
            with anyio.fail_after(timeout_s):
                line = await worker.ask(request)
        except TimeoutError:
            await worker.kill()
            return _failure("TimeoutError", f"verifier ran past its {timeout_s:g} s timeout")
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead, OSError):
            await worker.kill()
            return _failure("RuntimeError", "the verifier process died (memory cap or crash)")
        except anyio.get_cancelled_exc_class():
            await worker.kill()  # cancelled mid-run: the worker's state is unknown
            raise
        try:
            answer: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            await worker.kill()
            return _failure("RuntimeError", "the verifier process answered garbage")
        worker.runs += 1
        if worker.runs >= _RUNS_PER_WORKER:
            await worker.kill()
        else:
            self._idle.append(worker)
        return answer

    async def _spawn(self) -> _Worker:
        process = await anyio.open_process(
            [sys.executable, "-I", str(_CHILD), str(self._memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        return _Worker(process)

    async def aclose(self) -> None:
        """Stop every idle worker."""
        workers, self._idle = self._idle, []
        for worker in workers:
            await worker.kill()


def _failure(kind: str, message: str) -> dict[str, Any]:
    return {
        "success": False,
        "result": None,
        "stdout": "",
        "error": {"type": kind, "message": message, "traceback": ""},
    }
