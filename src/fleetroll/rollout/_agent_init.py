"""The init of one agent command's processes (:mod:`fleetroll.rollout.agent_process`).

Run by fleetroll as ``python -I -S _agent_init.py TAG LIFELINE MODE MAX_LOG TAIL -- ARGV...``
(the standard library only: it is not imported as part of fleetroll). It
starts ARGV (the agent), copies its output to its own stdout (the agent's log)
up to MAX_LOG bytes (the head, then a marker line, then the last TAIL bytes at
the end), and exits with the agent's status once the agent exits, the
LIFELINE pipe closes (fleetroll closed it or died) or it is told to stop,
leaving nothing of the agent running:

- MODE ``namespace``: it is process 1 of a PID namespace of its own
  (``unshare``); when it exits, the kernel kills every process left in it,
  whatever session or group those processes moved to.
- MODE ``subreaper``: it is a child subreaper (``PR_SET_CHILD_SUBREAPER``),
  so the agent's orphans (those that called ``setsid`` included) become its
  children; before it exits it kills every descendant, round after round
  until none is left.
- MODE ``group`` (not Linux): the agent's process group only, as fleetroll signals it.

SIGTERM, SIGINT and SIGHUP are passed on to every process of the agent (they
end it gracefully; fleetroll's SIGKILL, or the lifeline's end, follows).
TAG is fleetroll's: it finds inits an earlier fleetroll left by it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import sys

#: Rounds of "kill every descendant" before giving up (a fork bomb racing the kills).
_ROUNDS = 1000
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Log:
    """The agent's output, written up to ``limit`` bytes: the head, then the last ``tail``."""

    def __init__(self, limit: int, tail: int) -> None:
        self.head_left = max(0, limit - tail)
        self.tail = tail
        self.kept = bytearray()
        self.cut = 0

    def write(self, data: bytes) -> None:
        if self.head_left:
            head, data = data[: self.head_left], data[self.head_left :]
            _write_all(head)
            self.head_left -= len(head)
            if self.head_left == 0:
                _write_all(
                    b"\n[fleetroll: the agent's output reached policy.agent_max_log_bytes;"
                    b" only its last %d bytes follow, written when it ends]\n" % self.tail
                )
        if not data:
            return
        self.kept += data
        if len(self.kept) > self.tail:
            drop = len(self.kept) - self.tail
            self.cut += drop
            del self.kept[:drop]

    def close(self) -> None:
        if self.cut:
            _write_all(b"[fleetroll: %d bytes of the agent's output left out]\n" % self.cut)
        _write_all(bytes(self.kept))


def _write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(1, view) :]
        except OSError:
            return  # the log is gone (a full disk): the agent still runs


def _subreaper() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (its children's children too), from /proc."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc: only the process group is reached
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 2 or fields[0] == b"Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    found: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _reap(agent: int) -> int | None:
    """Collect every exited child; the agent's wait status, if it was among them."""
    status = None
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == agent:
            status = raw


def _signal_all(mode: str, agent: int, sig: int) -> None:
    targets = [-1] if mode == "namespace" else [agent, *descendants(os.getpid())]
    for pid in targets:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _kill_descendants() -> None:
    for _ in range(_ROUNDS):
        found = descendants(os.getpid())
        if not found:
            return
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        # A killed child is waited for here; the children of a killed grandchild
        # become this process's (a subreaper's), to be found by the next round.
        for pid in found:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        _reap(0)


def _drain(fd: int, log: _Log) -> None:
    os.set_blocking(fd, False)
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            raise
        if not data:
            return
        log.write(data)


def main(argv: list[str]) -> int:
    tag, lifeline, mode, limit, tail = argv[1], int(argv[2]), argv[3], int(argv[4]), int(argv[5])
    del tag  # only in the command line, where a later fleetroll looks for it
    command = argv[7:]
    os.set_inheritable(lifeline, False)
    if mode == "subreaper":
        _subreaper()  # "group" (no prctl): the agent's process group only
    out_r, out_w = os.pipe()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    pending: list[int] = []
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda sig, frame: None)
    for sig in _STOPPING:
        signal.signal(sig, lambda sig, frame: pending.append(sig))
    agent = os.fork()
    if agent == 0:
        signal.set_wakeup_fd(-1)
        for sig in (*_STOPPING, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"fleetroll: cannot start {command[0]}: {exc.strerror}\n".encode())
        os._exit(127)
    os.close(out_w)
    log = _Log(limit, tail)
    status: int | None = None
    reading = True
    while status is None:
        watched = [lifeline, wake_r] + ([out_r] if reading else [])
        ready, _, _ = select.select(watched, [], [])
        if out_r in ready and reading:
            data = os.read(out_r, 65536)
            if data:
                log.write(data)
            else:
                reading = False
        if wake_r in ready:
            _drain_wakeups(wake_r)
        while pending:
            _signal_all(mode, agent, pending.pop())
        status = _reap(agent)
        if lifeline in ready:
            break  # fleetroll closed it, or is gone: end everything now
    if mode != "namespace":  # in a namespace, the kernel ends the rest when this exits
        _kill_descendants()
    if reading:
        _drain(out_r, log)
    log.close()
    if status is None:
        return 128 + signal.SIGKILL
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _drain_wakeups(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


if __name__ == "__main__":
    os._exit(main(sys.argv))
