"""Any MCP server as an environment: the ``mcp`` provider."""
