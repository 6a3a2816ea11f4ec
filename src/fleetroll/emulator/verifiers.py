"""Verifier execution as Fleet performs it: bundles by sha256, run out of process.

The SDK (``AsyncVerifierFunction.remote_with_response``) first asks
``GET /v1/verifiers/check?sha256=`` whether the bundle is known, then posts
``/v1/verifiers/execute`` with the zip bundle (``verifier.py`` inside) when it
is not. Verifiers run in worker processes (``verifier_child.py``), one run at
a time per worker, each in a fresh namespace; nothing of a verifier runs in
the emulator's process (nor, therefore, in the orchestrator's).

A verifier is code from a task, so a worker is a sandbox, as far as this
machine allows cheaply:

* a scrubbed environment: ``PATH``, ``LANG``, and ``HOME``/``TMPDIR`` pointing
  at its own folder; nothing of ours (no ``FLEET_*``, ``FLEETROLL_*``, no key
  or token of any kind) reaches it;
* its working directory a private folder (``mkdtemp``, mode 0700) made here,
  emptied after every run and removed with the worker;
* no network when ``unshare -rn`` works for this user (checked once);
* caps on address space, CPU time per run, what it prints and the size of
  its answer (:class:`~fleetroll.settings.sections.VerifierLimits`);
* its own session, so a kill takes whatever it started with it.

A worker that passes a run's timeout, dies, or answers too much is killed
and replaced; every worker is replaced after ``_RUNS_PER_WORKER`` runs.
Starting a Python process per run cost ~50 ms of CPU, which capped a 2-core
machine at a few dozen verifications a second.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from fleetroll.settings.sections import VerifierLimits

__all__ = ["BundleError", "VerifierRunner"]

_CHILD = Path(__file__).with_name("verifier_child.py")
#: Cap on what Fleet accepts as an execute timeout (VerifiersExecuteRequest: 1..300).
MAX_TIMEOUT_S = 300
_RUNS_PER_WORKER = 500
_WORKDIR_PREFIX = "fleetroll-verifier-"  # verifier_child.WORKDIR_PREFIX
_KILL_WAIT_S = 5.0
#: What a worker may see of our environment (values are ours, not the caller's).
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


class BundleError(ValueError):
    """A bundle is missing, unreadable, or has no ``verifier.py``."""


class _Worker:
    def __init__(self, process: Process, workdir: str, max_answer: int) -> None:
        self.process = process
        self.workdir = workdir
        assert process.stdout is not None
        self.stdout = BufferedByteReceiveStream(process.stdout)
        self.max_answer = max_answer
        self.runs = 0

    async def ask(self, request: bytes) -> bytes:
        assert self.process.stdin is not None
        await self.process.stdin.send(request + b"\n")
        # One byte more than the child ever sends, so that a larger answer
        # (a child gone wrong) is DelimiterNotFound, not a cut answer.
        return await self.stdout.receive_until(b"\n", self.max_answer + 1)

    async def kill(self) -> None:
        """Kill the worker and what it started, wait for it (bounded), remove its folder."""
        with anyio.CancelScope(shield=True):
            # It may have exited since (e.g. on Ctrl-C, with the whole process
            # group): killing a reaped process raises.
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with suppress(ProcessLookupError):
                self.process.kill()
            with anyio.move_on_after(_KILL_WAIT_S):
                await self.process.wait()
            await self.process.aclose()
            await anyio.to_thread.run_sync(_remove_workdir, self.workdir)


def _remove_workdir(path: str) -> None:
    # Only a folder made by _spawn: mkdtemp's name, under the temp root.
    if os.path.basename(path).startswith(_WORKDIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def _worker_environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": _SAFE_PATH,
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


class VerifierRunner:
    """Keeps uploaded bundles and a pool of sandboxed verifier worker processes."""

    def __init__(self, *, limits: VerifierLimits | None = None, max_parallel: int = 4) -> None:
        self._bundles: dict[str, str] = {}  # sha256 -> verifier.py source
        self._limits = limits or VerifierLimits()
        self._limiter = anyio.CapacityLimiter(max_parallel)
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._prefix: list[str] | None = None  # ["unshare", "-rn"] or [], decided once

    @property
    def live_workers(self) -> int:
        """Worker processes alive now (idle or running)."""
        return len(self._live)

    @property
    def network_isolated(self) -> bool | None:
        """Whether workers run without network (None until the first one started)."""
        return None if self._prefix is None else bool(self._prefix)

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
            await self._retire(worker)
            return _failure("TimeoutError", f"verifier ran past its {timeout_s:g} s timeout")
        except anyio.DelimiterNotFound:
            await self._retire(worker)
            return _failure(
                "AnswerTooLarge",
                f"the verifier's answer is over {self._limits.max_answer_bytes} bytes",
            )
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead, OSError):
            await self._retire(worker)
            return _failure(
                "RuntimeError", "the verifier process died (memory cap, CPU cap or crash)"
            )
        except anyio.get_cancelled_exc_class():
            await self._retire(worker)  # cancelled mid-run: the worker's state is unknown
            raise
        try:
            answer: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            await self._retire(worker)
            return _failure("RuntimeError", "the verifier process answered garbage")
        worker.runs += 1
        if worker.runs >= _RUNS_PER_WORKER:
            await self._retire(worker)
        else:
            self._idle.append(worker)
        return answer

    async def _retire(self, worker: _Worker) -> None:
        self._live.discard(worker)
        await worker.kill()

    async def _command_prefix(self) -> list[str]:
        if self._prefix is None:
            self._prefix = []
            if self._limits.isolate_network and shutil.which("unshare"):
                with suppress(OSError), anyio.move_on_after(10):
                    probe = await anyio.run_process(
                        ["unshare", "-rn", "true"], check=False, stderr=subprocess.DEVNULL
                    )
                    if probe.returncode == 0:
                        self._prefix = ["unshare", "-rn"]
        return self._prefix

    async def _spawn(self) -> _Worker:
        lim = self._limits
        prefix = await self._command_prefix()
        workdir = await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
        process: Process | None = None
        try:
            process = await anyio.open_process(
                [
                    *prefix,
                    sys.executable,
                    "-I",
                    str(_CHILD),
                    f"--workdir={workdir}",
                    f"--memory-mb={lim.memory_mb}",
                    f"--cpu-s={lim.cpu_s}",
                    f"--max-output={lim.max_output_bytes}",
                    f"--max-answer={lim.max_answer_bytes}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=workdir,
                env=_worker_environment(workdir),
                start_new_session=True,
            )
        finally:
            if process is None:  # it never started: nothing else will remove the folder
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_remove_workdir, workdir)
        worker = _Worker(process, workdir, lim.max_answer_bytes)
        self._live.add(worker)
        return worker

    async def aclose(self) -> None:
        """Stop every idle worker and remove its folder."""
        workers, self._idle = self._idle, []
        for worker in workers:
            await self._retire(worker)


def _failure(kind: str, message: str) -> dict[str, Any]:
    return {
        "success": False,
        "result": None,
        "stdout": "",
        "error": {"type": kind, "message": message, "traceback": ""},
    }
