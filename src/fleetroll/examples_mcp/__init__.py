"""MCP servers fleetroll ships as examples and test environments.

Each is a standalone script (it imports ``mcp``, never ``fleetroll``), so a
task runs it with ``["{python}", "{examples}/notes_server.py", ...]``: the
interpreter running fleetroll and this folder, substituted by the ``mcp``
provider (docs/tasks.md).
"""
