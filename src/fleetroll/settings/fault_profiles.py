"""The emulator's fault profiles: what can go wrong, and how often, as plain data.

A :class:`FaultProfile` comes from ``[emulator.profiles.NAME]`` in a TOML
file (:class:`fleetroll.settings.sections.EmulatorSettings`) or is built in a
test; :class:`fleetroll.emulator.faults.FaultInjector` turns it into
decisions. It lives below both, so the settings import nothing of the
emulator.
"""

from __future__ import annotations

import random
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FaultProfile", "Latency"]

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Seconds = Annotated[float, Field(ge=0.0)]


class Latency(BaseModel):
    """A delay drawn uniformly from ``[min_s, max_s]`` (``max_s`` defaults to ``min_s``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_s: Seconds = 0.0
    max_s: Seconds | None = None

    def draw(self, rng: random.Random) -> float:
        high = self.min_s if self.max_s is None else max(self.max_s, self.min_s)
        if high == self.min_s:
            return self.min_s
        return rng.uniform(self.min_s, high)


class FaultProfile(BaseModel):
    """Every fault knob of the emulator. All default to "no fault"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0

    # -- provisioning -------------------------------------------------------
    create_latency: Latency = Latency()
    #: Serialise creates: at most one create finishes every this many seconds
    #: (Fleet under load served about one create per 10 s). 0 = no queue.
    create_queue_interval_s: Seconds = 0.0
    #: Probability that a create answers 500, 502 or 503 (chosen evenly).
    p_create_5xx: Probability = 0.0
    #: Probability that a create answers 429 with ``Retry-After``.
    p_create_429: Probability = 0.0
    #: Creates a second the account allows (a token bucket holding a second's
    #: worth): past it, a create answers 429 with the ``Retry-After`` of the next
    #: token, as a rate-limited Fleet account does. None: no limit.
    create_rate_limit: float | None = Field(default=None, gt=0)
    retry_after_s: Seconds = 1.0
    #: Probability that a 5xx body is marked ``"retryable": true``.
    p_retryable_body: Probability = 0.0
    #: Running instances allowed at once; a create past it answers 403
    #: ``instance_limit_exceeded``. None = unlimited.
    instance_limit: int | None = Field(default=None, ge=0)
    #: Probability that a create hangs for ``create_hang_s`` before answering 504
    #: (sooner if the request's ``max_wait_seconds`` is shorter, as on Fleet).
    p_create_hang: Probability = 0.0
    create_hang_s: Seconds = 3600.0
    #: A create whose client left (a cancelled request) still makes its instance
    #: once its latency is over, as Fleet goes on with it; off: none is made.
    creates_outlive_clients: bool = False
    #: Seconds a create's answer is held back after its instance is made: longer
    #: than the client's deadline, the instance runs and its client never learns
    #: its id (an answer lost in flight).
    create_answer_delay_s: Seconds = 0.0

    # -- MCP and tools ------------------------------------------------------
    #: MCP endpoints answer 503 for this long after an instance is created.
    mcp_warmup_s: Seconds = 0.0
    tool_latency: Latency = Latency()
    #: Seconds more for some tools' calls, by tool name (on top of
    #: ``tool_latency``): a deliberately slow tool, for finding it in telemetry.
    slow_tools: dict[str, Seconds] = Field(default_factory=dict)
    #: Probability that a tool call hangs for ``tool_hang_s``.
    p_tool_hang: Probability = 0.0
    tool_hang_s: Seconds = 3600.0
    #: Probability that a tool call answers with an injected MCP tool error.
    p_tool_error: Probability = 0.0
    #: A nondeterministic environment: an instance reset (or made) without a
    #: ``seed`` draws its random values (the ledger's transaction references)
    #: from an unseeded source, different every time; with a seed, seeded as ever.
    unseeded_random: bool = False
    #: The first this many ``tools/list`` requests of each instance answer a
    #: JSON-RPC internal error (a server still loading its tools).
    list_tools_failures: int = Field(default=0, ge=0)
    #: Broken environments (``"key:version"``, or ``"key"`` for every version):
    #: their instances come up, but their MCP endpoints always answer 502.
    broken_envs: tuple[str, ...] = ()

    def broken(self, env_key: str, version: str) -> bool:
        """Whether instances of ``env_key:version`` are broken (``broken_envs``)."""
        return env_key in self.broken_envs or f"{env_key}:{version}" in self.broken_envs

    # -- instance manager ---------------------------------------------------
    #: Probability that a reset hangs for ``reset_hang_s``.
    p_reset_hang: Probability = 0.0
    reset_hang_s: Seconds = 3600.0
    #: Probability that a reset answers ``"success": false`` and leaves the state as it was.
    p_reset_error: Probability = 0.0
    #: Probability that an instance dies, and when (seconds after creation).
    p_instance_death: Probability = 0.0
    death_after: Latency = Latency(min_s=5.0)
    #: Probability that a delete answers 500 and the instance keeps running.
    p_delete_error: Probability = 0.0
    #: Probability that a browser lease never turns healthy (its health check
    #: answers 503).
    p_browser_lease_unhealthy: Probability = 0.0
    #: TTL applied when a create does not ask for one. None = no TTL.
    default_ttl_s: Seconds | None = None

    # -- verifier -----------------------------------------------------------
    #: Probability that a verifier execution fails on the platform's side.
    p_verifier_error: Probability = 0.0

    # -- trace API ----------------------------------------------------------
    #: Probability that a trace post (a job or a session) answers 500, 502 or 503.
    p_trace_5xx: Probability = 0.0
    #: Probability that a trace post hangs for ``trace_hang_s`` before answering 504.
    p_trace_hang: Probability = 0.0
    trace_hang_s: Seconds = 3600.0
