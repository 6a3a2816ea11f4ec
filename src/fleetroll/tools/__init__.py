"""The agent's tools: the session that calls them and the routes that pick their endpoint.

Below the environment providers (which open tool sessions) and the rollout
(which calls through them): the MCP clients (the SDK's and the thin one behind
one protocol), how a tool call is routed by modality, and what an answer is.
"""
