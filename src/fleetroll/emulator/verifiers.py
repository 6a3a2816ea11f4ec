"""Verifier execution as Fleet performs it: bundles by sha256, one process per run.

The SDK (``AsyncVerifierFunction.remote_with_response``) first asks
``GET /v1/verifiers/check?sha256=`` whether the bundle is known, then posts
``/v1/verifiers/execute`` with the zip bundle (``verifier.py`` inside) when it
is not. Each execution runs ``verifier_child.py`` in a fresh Python process
under a timeout and an address-space cap; nothing of the verifier runs in the
emulator's process (nor, therefore, in the orchestrator's).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

__all__ = ["BundleError", "VerifierRunner"]

_CHILD = Path(__file__).with_name("verifier_child.py")
#: Cap on what Fleet accepts as an execute timeout (VerifiersExecuteRequest: 1..300).
MAX_TIMEOUT_S = 300


class BundleError(ValueError):
    """A bundle is missing, unreadable, or has no ``verifier.py``."""


class VerifierRunner:
    """Keeps uploaded bundles and runs verifiers in subprocesses."""

    def __init__(self, *, memory_mb: int = 512, max_parallel: int = 4) -> None:
        self._bundles: dict[str, str] = {}  # sha256 -> verifier.py source
        self._memory_mb = memory_mb
        self._limiter = anyio.CapacityLimiter(max_parallel)

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
                "memory_mb": self._memory_mb,
            }
        ).encode()
        timeout_s = max(1.0, min(timeout_s, MAX_TIMEOUT_S))
        async with self._limiter:
            started = time.monotonic()
            answer = await self._run_child(request, timeout_s)
            answer["execution_time_ms"] = int((time.monotonic() - started) * 1000)
        answer["execution_id"] = uuid.uuid4().hex
        return answer

    async def _run_child(self, request: bytes, timeout_s: float) -> dict[str, Any]:
        process: Process = await anyio.open_process(
            [sys.executable, "-I", str(_CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        async with process:
            try:
                with anyio.fail_after(timeout_s):
                    stdout = await _communicate(process, request)
            except TimeoutError:
                process.kill()
                return _failure("TimeoutError", f"verifier ran past its {timeout_s:g} s timeout")
        if process.returncode != 0 or not stdout:
            return _failure(
                "RuntimeError",
                f"verifier process exited with code {process.returncode} (memory cap or crash)",
            )
        try:
            answer: dict[str, Any] = json.loads(stdout)
        except json.JSONDecodeError:
            return _failure("RuntimeError", "verifier process answered garbage")
        return answer


async def _communicate(process: Process, data: bytes) -> bytes:
    assert process.stdin is not None and process.stdout is not None
    await process.stdin.send(data)
    await process.stdin.aclose()
    chunks = [chunk async for chunk in process.stdout]
    await process.wait()
    return b"".join(chunks)


def _failure(kind: str, message: str) -> dict[str, Any]:
    return {
        "success": False,
        "result": None,
        "stdout": "",
        "error": {"type": kind, "message": message, "traceback": ""},
    }
