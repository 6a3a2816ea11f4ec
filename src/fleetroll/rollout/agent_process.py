"""An agent command's processes: started contained, ended to the last descendant.

:func:`start_agent` runs the agent under a small init of its own
(:mod:`fleetroll.rollout._agent_init`, a standard-library script), chosen
once per process by ``policy.agent_sandbox``:

- ``namespace`` (``auto``'s choice where it works): ``unshare --user
  --map-current-user --pid --fork --mount-proc --kill-child`` (util-linux; as
  root without ``--user`` if user namespaces are refused). The init is process
  1 of a PID namespace with its own ``/proc``: when it exits, the kernel kills
  every process left in it, ``setsid`` or not; and the agent sees no process
  but its own, so neither fleetroll's environment (its keys) nor its
  siblings' (their gateway keys) is in its reach through ``/proc``.
- ``subreaper`` (``auto``'s fallback, with a one-line warning): the init is a
  child subreaper, so the agent's orphans become its children, and it kills
  every descendant before it exits. ``/proc`` is not hidden then.

Every exit path ends the whole tree: the agent's own exit (the init exits
with it), the rollout's deadline or cancel (:meth:`AgentProcess.stop`:
SIGTERM to all, then the end), fleetroll's SIGTERM/SIGINT (they cancel the
rollouts), and fleetroll's death by SIGKILL: the init holds the read end of a
*lifeline* pipe whose only write end is fleetroll's, so it sees the pipe's end
and ends everything. What would still be left (an init itself killed, or
stopped) is found by the next start on the same folder (:class:`AgentRecords`).

The init also caps the agent's log (``policy.agent_max_log_bytes``): the head,
a marker line, then its last bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL, STDOUT
from typing import IO, Any, Final, Literal

import anyio
from anyio.abc import Process

from fleetroll.environments.mcp.process import open_program
from fleetroll.errors import ConfigError
from fleetroll.rollout._agent_init import descendants

__all__ = ["AgentLimits", "AgentProcess", "AgentRecords", "containment", "start_agent"]

_log = logging.getLogger(__name__)

Sandbox = Literal["auto", "namespace", "subreaper"]
#: The init every agent runs under (by path: it is not imported in the agent's process).
INIT: Final = Path(__file__).with_name("_agent_init.py")
#: Bytes of the end of an agent's output kept past ``agent_max_log_bytes`` (at most).
_TAIL_BYTES: Final = 64 * 1024
_NAMESPACE: Final = ("--pid", "--fork", "--mount-proc", "--kill-child")
_USER_NAMESPACES: Final = (("--user", "--map-current-user"), ("--user", "--map-root-user"))
#: Bounds the one probe of ``unshare`` per process (a blocking ``subprocess.run``).
_PROBE_S: Final = 10.0
#: Rounds of "kill what is left" at a start (a tree that forks while it is killed).
_REAP_ROUNDS: Final = 100
#: The tag of agents started without records (:class:`AgentRecords`).
_TAG: Final = uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class AgentLimits:
    """How an agent's processes are run and ended (``policy.agent_*``)."""

    kill_grace_s: float = 2.0
    max_log_bytes: int = 16 * 1024 * 1024
    sandbox: Sandbox = "auto"


@dataclass(frozen=True, slots=True)
class Containment:
    """How this process contains agents: the init's mode and what runs it."""

    mode: Literal["namespace", "subreaper", "group"]
    prefix: tuple[str, ...] = ()


_probe_lock = threading.Lock()
_probed: dict[str, Containment] = {}


def containment(sandbox: Sandbox) -> Containment:
    """What contains agents here under ``sandbox`` (probed once per process).

    Blocking (it may run ``unshare`` once): call it from a worker thread.

    Raises:
        ConfigError: ``sandbox`` is ``namespace`` and no PID namespace can be made.
    """
    with _probe_lock:
        if sandbox not in _probed:
            _probed[sandbox] = _choose(sandbox)
        return _probed[sandbox]


def _choose(sandbox: Sandbox) -> Containment:
    if sandbox != "subreaper":
        prefix, reason = _namespace_prefix()
        if prefix is not None:
            return Containment("namespace", prefix)
        if sandbox == "namespace":
            raise ConfigError(
                f"policy.agent_sandbox = 'namespace', but no PID namespace can be made"
                f" here ({reason}); allow unprivileged user namespaces, or set 'auto'"
            )
        _log.warning(
            "agent commands run without a PID namespace (%s): each one's processes are"
            " still ended to the last, but an agent can read this process's and its"
            " siblings' environments in /proc (policy.agent_sandbox)",
            reason,
        )
    return Containment("subreaper" if sys.platform == "linux" else "group")


def _namespace_prefix() -> tuple[tuple[str, ...] | None, str]:
    if sys.platform != "linux":
        return None, "not Linux"
    unshare = shutil.which("unshare")
    if unshare is None:
        return None, "no unshare command: install util-linux"
    tries: list[tuple[str, ...]] = [(unshare, *user, *_NAMESPACE) for user in _USER_NAMESPACES]
    if os.geteuid() == 0:
        tries.append((unshare, *_NAMESPACE))
    reason = "unshare failed"
    for prefix in tries:
        try:
            done = subprocess.run(
                [*prefix, "--", sys.executable, "-I", "-S", "-c", "pass"],
                stdin=DEVNULL,
                capture_output=True,
                timeout=_PROBE_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason = f"unshare: {exc}"
            continue
        if done.returncode == 0:
            return prefix, ""
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        reason = said[-1] if said else f"unshare exited with {done.returncode}"
    return None, reason


class AgentProcess:
    """A running agent (its init, and ``unshare`` before it in a namespace)."""

    def __init__(self, process: Process, lifeline: int) -> None:
        self.process = process
        self._lifeline: int | None = lifeline

    @property
    def returncode(self) -> int | None:
        """The agent's exit status (128 + N: killed by signal N), once it ended."""
        return self.process.returncode

    async def wait(self) -> int:
        """Wait for the agent to exit (its init exits with it, ending the rest)."""
        return await self.process.wait()

    async def stop(self, *, grace_s: float, wait_s: float) -> None:
        """End every process of the agent; shielded.

        A running agent gets SIGTERM (its init passes it on to all of them),
        then ``grace_s`` to exit; then its init ends whatever is left (the
        lifeline's end), and SIGKILL follows if the init has not exited
        ``wait_s`` later.
        """
        process = self.process
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                _signal_group(process.pid, signal.SIGTERM)
                with anyio.move_on_after(grace_s):
                    await process.wait()
            self._cut_lifeline()
            with anyio.move_on_after(wait_s):
                await process.wait()
            if process.returncode is None:
                _signal_group(process.pid, signal.SIGKILL)
                with anyio.move_on_after(wait_s):
                    await process.wait()
            with anyio.move_on_after(wait_s), contextlib.suppress(Exception):
                await process.aclose()

    def _cut_lifeline(self) -> None:
        fd, self._lifeline = self._lifeline, None
        if fd is not None:
            os.close(fd)


async def start_agent(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log: IO[bytes],
    limits: AgentLimits,
    records: AgentRecords | None = None,
) -> AgentProcess:
    """Start ``argv`` as an agent, contained as ``limits.sandbox`` says, its output to ``log``.

    With ``records``, its init carries their tag (a later start ends it, should
    it outlive this process).

    Raises:
        ConfigError: the sandbox asked for cannot be had here.
        OSError: the program cannot be found or started.
    """
    contained = await anyio.to_thread.run_sync(containment, limits.sandbox)
    _check_program(argv[0], cwd, env)
    tail = min(_TAIL_BYTES, limits.max_log_bytes // 2)
    read_end, write_end = os.pipe()  # the write end is not inherited: fleetroll's only
    tag = _TAG if records is None else records.tag
    init = [sys.executable, "-I", "-S", str(INIT), tag, str(read_end), contained.mode]
    init += [str(limits.max_log_bytes), str(tail), "--", *argv]
    command = [*contained.prefix, "--", *init] if contained.prefix else init
    try:
        process = await open_program(
            command,
            cwd=cwd,
            env=dict(env),
            stdin=DEVNULL,
            stdout=log,
            stderr=STDOUT,
            start_new_session=True,
            pass_fds=(read_end,),
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return AgentProcess(process, write_end)


def _check_program(program: str, cwd: Path, env: Mapping[str, str]) -> None:
    """Raises: FileNotFoundError: ``program`` is not there to run (as exec would say)."""
    if "/" in program:
        found = os.access(cwd / program, os.X_OK)
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath)) is not None
    if not found:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class AgentRecords:
    """A folder noting which fleetroll processes started agents, so that the next
    start on it ends what a killed one left running.

    :meth:`open` (blocking) first ends the agents of every earlier process
    noted there that no longer holds its note (a locked file named by its tag:
    a live process keeps its lock), found by their inits' command lines (the
    tag is there; a reused process id has another command line), then notes
    this process. ``fleetroll run`` keeps one beside its journal
    (``<out>.agents``), ``fleetroll serve`` one in ``service.state_dir/agents``.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        #: In the command line of each agent's init started with these records.
        self.tag = uuid.uuid4().hex
        self._fd: int | None = None

    def open(self) -> int:
        """End what earlier processes left; note this one. The processes ended.

        Raises:
            ConfigError: the folder cannot be made or written.
        """
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            ended = sum(self._reap(note) for note in sorted(self.folder.glob("*.lock")))
            note = self.folder / f"{self.tag}.lock"
            fd = os.open(note, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        except OSError as exc:
            raise ConfigError(f"cannot keep agents' records in {self.folder}: {exc}") from None
        self._fd = fd
        if ended:
            _log.warning(
                "ended %d process(es) of agents that an earlier fleetroll on %s left running",
                ended,
                self.folder,
            )
        return ended

    def close(self) -> None:
        """Remove this process's note (its agents are all ended by now), and the
        folder if no other note is left in it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                (self.folder / f"{self.tag}.lock").unlink()
            os.close(fd)
            with contextlib.suppress(OSError):
                self.folder.rmdir()

    def __enter__(self) -> AgentRecords:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _reap(self, note: Path) -> int:
        try:
            fd = os.open(note, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # its process lives: its agents are its own
            ended = end_tagged(note.stem)
            note.unlink(missing_ok=True)
            return ended
        finally:
            os.close(fd)


def end_tagged(tag: str) -> int:
    """SIGKILL every init (and ``unshare``) tagged ``tag`` and all under them.

    Blocking: reads /proc. Returns how many processes were killed.
    """
    ended = 0
    for _ in range(_REAP_ROUNDS):
        found = [pid for pid in _pids() if _is_tagged(pid, tag)]
        if not found:
            return ended
        for pid in found:
            # What is under it first: a subreaper init killed first would let its
            # orphans go to the system's init.
            for victim in [*descendants(pid), pid]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(victim, signal.SIGKILL)
                    ended += 1
    return ended


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _is_tagged(pid: int, tag: str) -> bool:
    """Whether ``pid`` runs an agent init of ``tag`` (its command line says so)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    if stat[stat.rfind(b")") + 2 :][:1] == b"Z":
        return False  # already ended, waiting for its parent
    init, want = str(INIT).encode(), tag.encode()
    return any(w == init and words[i + 1 : i + 2] == [want] for i, w in enumerate(words))
