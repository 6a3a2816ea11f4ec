"""How long loading a big task file takes, and how much memory it needs.

    python benchmarks/load_tasks.py [--tasks 100000] [--file PATH]

Writes a JSON Lines file of ``--tasks`` tasks made from the shipped ledger
examples (each with a new key, so every line is a distinct task; the
verifiers repeat, as they do in real exports), then loads it once with
``fleetroll.tasks.load_tasks`` in a fresh process and prints the wall time
and the peak RSS of that process. Nothing here asserts: it measures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fleetroll.settings import config_dir

_LOAD = """
import json, resource, sys, time
from fleetroll.tasks import load_tasks
began = time.perf_counter()
tasks = load_tasks(sys.argv[1], modalities={"tool_use", "computer_use"})
took = time.perf_counter() - began
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"tasks": len(tasks), "seconds": round(took, 2), "peak_rss_mib": round(peak)}))
"""


def write_tasks(path: Path, count: int) -> None:
    examples = [
        json.loads(line)
        for line in (config_dir() / "tasks" / "ledger.jsonl").read_text().splitlines()
        if line.strip()
    ]
    with path.open("w", encoding="utf-8") as f:
        for n in range(count):
            task = dict(examples[n % len(examples)])
            task["key"] = f"{task['key']}-{n}"
            f.write(json.dumps(task) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--file", type=Path, default=None, help="keep the task file here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleetroll-bench-tasks-") as scratch:
        path = args.file or Path(scratch) / "tasks.jsonl"
        write_tasks(path, args.tasks)
        size_mib = path.stat().st_size / 1024**2
        done = subprocess.run(
            [sys.executable, "-c", _LOAD, str(path)], check=True, capture_output=True, text=True
        )
    figures = json.loads(done.stdout)
    figures["file_mib"] = round(size_mib)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
