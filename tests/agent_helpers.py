"""Agent commands that leave processes behind, and finding those processes from outside.

An agent may run in a PID namespace of its own: the process ids it sees are
not this test's. So its descendants carry a mark in their command line, and
the tests look for the mark in /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid


def new_mark() -> str:
    return f"fleetroll-test-mark-{uuid.uuid4().hex}"


def marked(mark: str) -> list[int]:
    """The live processes (zombies are not) whose command line holds ``mark``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if mark.encode() in words and stat[stat.rfind(b")") + 2 :][:1] != b"Z":
            found.append(int(name))
    return found


def leaving_descendants(
    mark: str, *, then: str = "import time; time.sleep(600)", deaf: bool = False
) -> list[str]:
    """An agent that starts a child which calls ``setsid`` and starts a
    grandchild (a daemon's double fork), both sleeping with ``mark`` in their
    command lines (``deaf``: ignoring SIGTERM); once both run, it makes one
    policy call, then runs ``then``."""
    deafen = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if deaf else ""
    sleeper = deafen + "import time; time.sleep(600)"
    daemon = (
        f"{deafen}import os, subprocess, sys, time\n"
        "os.setsid()\n"
        f"subprocess.Popen([sys.executable, '-c', {sleeper!r}, {mark!r}],"
        " start_new_session=True)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    script = f"""
import json, os, subprocess, sys, urllib.request
child = subprocess.Popen([sys.executable, "-c", {daemon!r}, {mark!r}], stdout=subprocess.PIPE)
assert child.stdout.readline() == b"up\\n"
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
body = json.dumps({{"model": "any", "messages": [{{"role": "user", "content": "hi"}}]}}).encode()
request = urllib.request.Request(base + "/chat/completions", body, {{
    "Authorization": "Bearer " + key, "Content-Type": "application/json"}})
urllib.request.urlopen(request).read()
{then}
"""
    return [sys.executable, "-c", script]


def end_marked(mark: str) -> None:
    """SIGKILL what a failed test left running (its marked processes only)."""
    for pid in marked(mark):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
