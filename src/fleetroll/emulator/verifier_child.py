"""Runs verifiers, in its own process. Started by :mod:`.verifiers` as a script.

This file imports nothing from fleetroll (so it starts fast). It serves one
request per line: a JSON request on stdin, a JSON answer on stdout:

request: ``{"code", "function_name", "args_b64", "instance_id", "databases"}``;
answer: ``{"success", "result", "error", "stdout"}``. Each run gets a fresh
namespace; the parent recycles a worker after a timeout, a crash, or a
number of runs.

The parent starts it with a scrubbed environment, in its own session, with
its working directory a private folder the parent made (``--workdir``), and
maybe without network (``unshare -rn``). Here it caps what a verifier can
take and say:

* address space (``--memory-mb``) for the whole process;
* CPU time (``--cpu-s``) per run: the soft limit is moved to "used so far +
  cap" before each run (only the soft one: an unprivileged process cannot
  raise its hard limit again); passing it raises :class:`CPUTimeExceeded` in
  the verifier, again every second of CPU after that, and a verifier that
  swallows them all is killed by the parent's timeout;
* what it prints (``--max-output`` bytes are kept, the rest counted);
* the answer line (``--max-answer`` bytes; a larger one becomes an error).

The protocol runs over private copies of stdin and stdout: file descriptors
0 and 1 point at ``/dev/null`` while verifiers run, so a verifier that writes
to fd 1 or reads fd 0 cannot corrupt or steal a request or an answer.

Between runs the working folder is emptied, so one verifier never sees
another's files. Only the folder given as ``--workdir`` is ever emptied, and
only if it is a ``fleetroll-verifier-*`` folder that is this process's
current directory, owned by this user and private (mode 0700).

The verifier gets an ``env`` offering the part of Fleet's environment API
that verifiers use: ``env.db(name).query(sql, args)`` answering an object with
``success, columns, rows, error, message``, and ``env.instance_id``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import pickle
import re
import resource
import shutil
import signal
import sqlite3
import stat
import string
import traceback
from typing import Any

_TRANSLATOR = str.maketrans(string.punctuation, " " * len(string.punctuation))
WORKDIR_PREFIX = "fleetroll-verifier-"


class CPUTimeExceeded(Exception):
    """The verifier used more CPU time than one run may."""


class QueryResult:
    def __init__(self, columns: list[str], rows: list[list[Any]]) -> None:
        self.success = True
        self.columns = columns
        self.rows = rows
        self.rows_affected = None
        self.last_insert_id = None
        self.error = None
        self.message = f"{len(rows)} rows"


class Database:
    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)

    def query(self, query: str, args: list[Any] | None = None) -> QueryResult:
        cursor = self._conn.execute(query, args or [])
        columns = [d[0] for d in cursor.description or ()]
        return QueryResult(columns, [list(row) for row in cursor.fetchall()])


class Env:
    def __init__(self, instance_id: str, databases: dict[str, str]) -> None:
        self.instance_id = instance_id
        self._databases = databases

    def db(self, name: str = "current") -> Database:
        if name not in self._databases:
            known = ", ".join(sorted(self._databases))
            raise KeyError(f"no database {name!r} on this instance (known: {known})")
        return Database(name, self._databases[name])


class BoundedOutput(io.TextIOBase):
    """Keeps the first ``limit`` characters written to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        self._parts: list[str] = []
        self._kept = 0
        self._dropped = 0
        self._limit = limit

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        room = self._limit - self._kept
        if room > 0:
            self._parts.append(text[:room])
            self._kept += min(room, len(text))
        self._dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def getvalue(self) -> str:
        text = "".join(self._parts)
        if self._dropped:
            text += f"\n[output truncated: {self._dropped} more characters]"
        return text


def _normalize_text(value: str) -> str:
    return "".join(value.lower().translate(_TRANSLATOR).split())


def normalized_contains(target: str, blob: Any) -> bool:
    text = json.dumps(blob, sort_keys=True) if isinstance(blob, dict | list) else str(blob)
    return _normalize_text(target) in _normalize_text(text)


def extract_numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"-?\d+\.?\d*", text.replace(",", ""))]


def contains_number(text: str, target: Any) -> bool:
    try:
        value = float(str(target).replace(",", ""))
    except ValueError:
        return False
    return value in extract_numbers(text)


def clean_code(code: str) -> str:
    """Drop the ``@verifier`` decorator and fleet imports, as Fleet's runner does."""
    code = re.sub(r"@verifier\([^)]*\)\s*\n", "", code)
    code = re.sub(r"^from fleet(\.\w+)* import .*$\n?", "", code, flags=re.MULTILINE)
    return re.sub(r"^import fleet(\.\w+)*$\n?", "", code, flags=re.MULTILINE)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _on_cpu_limit(signum: int, frame: Any) -> None:
    raise CPUTimeExceeded("the verifier used more than its CPU time")


def _cap_cpu(seconds: int) -> None:
    """Let the next run use ``seconds`` more CPU time (the limit counts the process's life)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime) + seconds
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    signal.signal(signal.SIGXCPU, _on_cpu_limit)


def run(request: dict[str, Any], *, max_output: int) -> dict[str, Any]:
    captured = BoundedOutput(max_output)
    try:
        namespace: dict[str, Any] = {
            "__name__": "verifier",
            "TASK_SUCCESSFUL_SCORE": 1.0,
            "TASK_FAILED_SCORE": 0.0,
            "normalized_contains": normalized_contains,
            "extract_numbers": extract_numbers,
            "contains_number": contains_number,
            "json": json,
            "re": re,
            "string": string,
        }
        payload = pickle.loads(base64.b64decode(request["args_b64"]))
        # The SDK sends (None, *args, {"env": instance_id}): a placeholder for env
        # first, the instance reference last.
        args = list(payload.get("args", ()))[1:]
        if args and isinstance(args[-1], dict) and set(args[-1]) == {"env"}:
            args = args[:-1]
        kwargs = dict(payload.get("kwargs", {}))
        env = Env(request["instance_id"], request["databases"])
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            exec(compile(clean_code(request["code"]), "verifier.py", "exec"), namespace)
            func = namespace.get(request["function_name"])
            if not callable(func):
                raise NameError(f"verifier defines no function {request['function_name']!r}")
            result = func(env, *args, **kwargs)
        return {
            "success": True,
            "result": _jsonable(result),
            "error": None,
            "stdout": captured.getvalue(),
        }
    except (Exception, SystemExit) as exc:  # the child reports; it never raises
        return {
            "success": False,
            "result": None,
            "error": {
                "type": type(exc).__name__,
                "message": str(exc)[:2000],
                "traceback": traceback.format_exc(limit=8)[-4000:],
            },
            "stdout": captured.getvalue(),
        }


def _encode(answer: dict[str, Any], max_answer: int) -> bytes:
    line = json.dumps(answer).encode() + b"\n"
    if len(line) <= max_answer:
        return line
    small = {
        "success": False,
        "result": None,
        "error": {
            "type": "AnswerTooLarge",
            "message": f"the verifier's answer is {len(line)} bytes, over the {max_answer} allowed",
            "traceback": "",
        },
        "stdout": "",
    }
    return json.dumps(small).encode() + b"\n"


def empty_workdir(workdir: str) -> None:
    """Remove what a verifier left in ``workdir``, after checking it is ours to empty.

    Raises:
        RuntimeError: ``workdir`` is not a private ``fleetroll-verifier-*`` folder
            that is this process's current directory (then nothing is removed).
    """
    path = os.path.realpath(workdir)
    info = os.lstat(path)
    if (
        not os.path.basename(path).startswith(WORKDIR_PREFIX)
        or path != os.path.realpath(os.getcwd())
        or not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise RuntimeError(f"refusing to empty {path!r}: not this worker's private folder")
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _private_channels() -> tuple[io.BufferedReader, io.BufferedWriter]:
    """The protocol's own copies of stdin and stdout; fds 0 and 1 go to /dev/null."""
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    return requests, answers


def main() -> None:
    """Serve requests, one JSON line in, one JSON line out, until stdin closes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--memory-mb", type=int, default=512)
    parser.add_argument("--cpu-s", type=int, default=60)
    parser.add_argument("--max-output", type=int, default=1024 * 1024)
    parser.add_argument("--max-answer", type=int, default=16 * 1024 * 1024)
    options = parser.parse_args()
    limit = options.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    empty_workdir(options.workdir)  # checks the folder before any verifier runs
    requests, answers = _private_channels()
    for line in requests:
        if not line.strip():
            continue
        _cap_cpu(options.cpu_s)
        answer = run(json.loads(line), max_output=options.max_output)
        # Our own bookkeeping is not the verifier's: no CPU limit until the next run.
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        empty_workdir(options.workdir)
        answers.write(_encode(answer, options.max_answer))
        answers.flush()


if __name__ == "__main__":
    main()
