"""Every code snippet in README.md and docs/ runs as written.

A fenced block tagged ``python`` runs as a script; one tagged ``sh`` runs in
bash with ``set -e``, with the project's ``fleetroll`` on PATH. Both run against the
embedded emulator, in a temporary folder holding a copy of ``config/`` and
``examples/`` (snippets name ``config/tasks/...``), with the telemetry store there too.

An HTML comment on the line just before a block changes how it runs:

* ``<!-- snippet: skip REASON -->``: not run (installs, commands that run
  for minutes); the reason is required and shows in the skip message.
* ``<!-- snippet: with-serve -->``: run while ``fleetroll serve`` listens.
  The snippet names its default address, 127.0.0.1:8750; the test serves on a
  free port instead and puts that port in the snippet.

Blocks tagged anything else (``text``, ``json``, ``toml``, ``sql``) are not
code to run.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*snippet:\s*(skip|with-serve)\b\s*(.*?)\s*-->\s*$")
_RUNNABLE = {"python", "sh"}
_DEFAULT_ADDRESS = "127.0.0.1:8750"


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    lang: str
    code: str
    directive: str | None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def snippets(path: Path) -> Iterator[Snippet]:
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        lang = opening.group(1)
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        directive = _DIRECTIVE.match(lines[start - 1]) if start > 0 else None
        yield Snippet(
            path=path,
            line=start + 1,
            lang=lang,
            code="\n".join(body) + "\n",
            directive=directive.group(1) if directive else None,
            reason=directive.group(2) if directive else "",
        )


def documents() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md")) if (ROOT / "docs").is_dir() else []
    return [ROOT / "README.md", *docs]


ALL = [s for doc in documents() for s in snippets(doc) if s.lang in _RUNNABLE]


def test_the_documents_hold_runnable_snippets() -> None:
    # Guards the extraction itself: a change of fence style must not make
    # every snippet test vanish silently.
    assert sum(1 for s in ALL if s.lang == "python") >= 2
    assert sum(1 for s in ALL if s.lang == "sh") >= 2


def test_every_skipped_snippet_says_why() -> None:
    unexplained = [s.id for s in ALL if s.directive == "skip" and not s.reason]
    assert unexplained == []


def _environment(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # A home of its own: `fleetroll serve` makes its token in ~/.local/state, and
    # the snippets read it there, as the user's would.
    env["HOME"] = str(tmp_path / "home")
    env["FLEETROLL_TELEMETRY__DB_PATH"] = str(tmp_path / "telemetry.db")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _serving(env: dict[str, str], tmp_path: Path, cwd: Path, port: int) -> Iterator[None]:
    """``fleetroll serve`` on ``port``, once it says it listens (its output goes to serve.log)."""
    log_path = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetroll", "serve", "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    listening, said_so = threading.Event(), list[bytes]()

    def copy_output() -> None:  # and drain it, so that serve never blocks on a full pipe
        assert proc.stdout is not None
        with proc.stdout, log_path.open("wb") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(b"fleetroll serve: http"):
                    said_so.append(line)
                    listening.set()
        listening.set()  # it exited: the check below says so

    copier = threading.Thread(target=copy_output, daemon=True)
    copier.start()
    try:
        if not listening.wait(timeout=60):
            raise AssertionError("fleetroll serve did not say it listens within 60 s")
        if not said_so:
            raise AssertionError(f"fleetroll serve exited: {log_path.read_text()}")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).is_success
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        copier.join(timeout=30)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("snippet", ALL, ids=[s.id for s in ALL])
def test_the_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.directive == "skip":
        pytest.skip(f"{snippet.id}: {snippet.reason}")
    env = _environment(tmp_path)
    work = tmp_path / "work"
    shutil.copytree(ROOT / "config", work / "config")
    shutil.copytree(ROOT / "examples", work / "examples")  # snippets run examples/...
    code, port = snippet.code, _free_port()
    if snippet.directive == "with-serve":
        assert _DEFAULT_ADDRESS in code, f"{snippet.id} does not name {_DEFAULT_ADDRESS}"
        code = code.replace(_DEFAULT_ADDRESS, f"127.0.0.1:{port}")
    if snippet.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(code, encoding="utf-8")
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    serving = _serving(env, tmp_path, work, port) if snippet.directive == "with-serve" else None
    with serving or _nothing():
        done = subprocess.run(
            command, cwd=work, env=env, capture_output=True, text=True, timeout=240
        )
    assert done.returncode == 0, (
        f"{snippet.id} failed (exit {done.returncode}):\n{snippet.code}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )
