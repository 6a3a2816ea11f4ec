"""A small "notes" MCP server over stdio: text files under one root folder.

Run: ``python notes_server.py --root DIR`` (the mcp provider starts it per
rollout with ``--root {workdir}``). Tools: ``write_file``, ``read_file``,
``list_files``, ``delete_file``, and ``clear`` (a reset) and ``check_file``
(a verifier); paths are relative to the root and may not
leave it. ``--crash-after N`` exits the process on the N-th tool call and
``--hang-tool`` adds a ``hang`` tool that never answers (for tests of
failures). Imports only ``mcp``: it runs without fleetroll on its path.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer


def _inside(root: Path, path: str) -> Path:
    target = (root / path).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"{path!r} is outside the notes folder")
    return target


def build(root: Path, *, crash_after: int | None = None, hang_tool: bool = False) -> MCPServer:
    """The server over ``root``."""
    server = MCPServer("notes")
    root = root.resolve()
    calls = 0

    def count() -> None:
        nonlocal calls
        calls += 1
        if crash_after is not None and calls >= crash_after:
            os._exit(3)  # a crash: no clean shutdown, no answer

    @server.tool(description="Write text to a file (made with its folders if missing).")
    def write_file(path: str, content: str) -> str:
        count()
        target = _inside(root, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        return f"wrote {len(content)} characters to {path}"

    @server.tool(description="Read a file's text.")
    def read_file(path: str) -> str:
        count()
        return _inside(root, path).read_text(encoding="utf-8")

    @server.tool(description="List the files under the notes folder.")
    def list_files() -> list[str]:
        count()
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    @server.tool(description="Delete a file.")
    def delete_file(path: str) -> str:
        count()
        _inside(root, path).unlink()
        return f"deleted {path}"

    @server.tool(description="Delete every file: back to an empty notes folder (a reset).")
    def clear() -> str:
        files = [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            path.unlink()
        return f"deleted {len(files)} files"

    @server.tool(description="1.0 when the file holds exactly the text, else 0.0 (a verifier).")
    def check_file(path: str, content: str) -> float:
        target = _inside(root, path)
        return 1.0 if target.is_file() and target.read_text(encoding="utf-8") == content else 0.0

    if hang_tool:

        @server.tool(description="Never answers.")
        async def hang() -> str:
            await anyio.sleep_forever()
            return "unreachable"

    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the notes folder (default: the cwd)")
    parser.add_argument("--crash-after", type=int, default=None)
    parser.add_argument("--hang-tool", action="store_true")
    parser.add_argument("--fail-start", default=None, help="print this to stderr and exit 2")
    args = parser.parse_args(argv)
    if args.fail_start:
        print(args.fail_start, file=sys.stderr)
        sys.exit(2)
    build(Path(args.root), crash_after=args.crash_after, hang_tool=args.hang_tool).run("stdio")


if __name__ == "__main__":
    main()
