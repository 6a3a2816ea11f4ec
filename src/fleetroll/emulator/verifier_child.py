"""Runs one verifier, in its own process. Started by :mod:`.verifiers` as a script.

This file imports nothing from fleetroll (so it starts fast) and runs
verifiers' code under an address-space cap (``argv[1]``, MB). It serves one
request per line: a JSON request on stdin, a JSON answer on stdout:

request: ``{"code", "function_name", "args_b64", "instance_id", "databases"}``;
answer: ``{"success", "result", "error", "stdout"}``. Each run gets a fresh
namespace; the parent recycles a worker after a timeout, a crash, or a
number of runs.

The verifier gets an ``env`` offering the part of Fleet's environment API
that verifiers use: ``env.db(name).query(sql, args)`` answering an object with
``success, columns, rows, error, message``, and ``env.instance_id``.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import re
import resource
import sqlite3
import string
import sys
import traceback
from typing import Any

_TRANSLATOR = str.maketrans(string.punctuation, " " * len(string.punctuation))


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


def run(request: dict[str, Any]) -> dict[str, Any]:
    captured = io.StringIO()
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
        with contextlib.redirect_stdout(captured):
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
                "message": str(exc),
                "traceback": traceback.format_exc(limit=8),
            },
            "stdout": captured.getvalue(),
        }


def main() -> None:
    """Serve requests, one JSON line in, one JSON line out, until stdin closes."""
    limit = int(sys.argv[1]) * 1024 * 1024 if len(sys.argv) > 1 else 512 * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = run(json.loads(line))
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
