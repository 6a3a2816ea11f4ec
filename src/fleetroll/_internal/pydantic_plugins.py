"""Logfire's pydantic plugin, left unloaded in processes where nothing asks for it.

pydantic imports every installed plugin when a process builds its first
model, and Logfire's pulls in most of Logfire and OpenTelemetry: ~0.5 s of CPU
at the start of every process that uses pydantic (each ``fleetroll`` command,
the emulator, each Ray actor, an MCP server built on the MCP SDK), for a
plugin that records nothing unless ``LOGFIRE_PYDANTIC_PLUGIN_RECORD`` is set.
Importing this module builds no model.
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["skip_unused_pydantic_plugins"]


def skip_unused_pydantic_plugins(env: MutableMapping[str, str]) -> None:
    """Set ``PYDANTIC_DISABLE_PLUGINS=logfire-plugin`` in ``env`` (a process's
    environment) unless ``LOGFIRE_PYDANTIC_PLUGIN_RECORD`` asks for the plugin or
    ``PYDANTIC_DISABLE_PLUGINS`` is already set.
    """
    if "LOGFIRE_PYDANTIC_PLUGIN_RECORD" not in env:
        env.setdefault("PYDANTIC_DISABLE_PLUGINS", "logfire-plugin")
