"""The section models of :class:`fleetroll.settings.Settings`, one per ``[table]``.

Moved out of ``settings.py`` to keep modules short; import them from
``fleetroll.settings`` as before (it re-exports every one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetroll.errors import ConfigError
from fleetroll.settings.fault_profiles import FaultProfile

__all__ = [
    "SERVICE_FOLDER",
    "STATE_ROOT",
    "STORE_FILE",
    "AdmissionSettings",
    "BreakerSettings",
    "EmulatorSettings",
    "EnvAdmissionSettings",
    "JudgeSettings",
    "McpSettings",
    "ModalitySettings",
    "PolicySettings",
    "PoolSettings",
    "ProvisioningSettings",
    "RetrySettings",
    "SamplingSettings",
    "ServiceSettings",
    "TelemetrySettings",
    "TimeoutSettings",
    "TraceSettings",
    "VerifierLimits",
]

#: Where fleetroll keeps what it writes by default (relative: to the working
#: directory), and the names inside it: the telemetry store and ``fleetroll
#: serve``'s folder (``serve --state-dir`` puts both under another root).
STATE_ROOT = Path(".fleetroll")
STORE_FILE = "telemetry.db"
SERVICE_FOLDER = "service"


@dataclass(frozen=True, slots=True)
class Budget:
    """How often, and with what waits, one operation is tried.

    ``attempts`` counts the first try; None tries until the caller's deadline.
    Each section that retries something says its budget (``ProvisioningSettings.budget``,
    ``RetrySettings.verify_budget``, ...); :func:`fleetroll._internal.retrying.attempts`
    spends it.
    """

    attempts: int | None
    backoff_initial_s: float
    backoff_max_s: float


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TimeoutSettings(_Section):
    """Hard deadlines, in seconds, one per operation that leaves the process."""

    provision_create_s: float = Field(900.0, gt=0)
    provision_total_s: float = Field(1800.0, gt=0)
    reset_s: float = Field(10.0, gt=0)
    mcp_connect_s: float = Field(30.0, gt=0)
    list_tools_s: float = Field(60.0, gt=0)
    call_tool_s: float = Field(60.0, gt=0)
    policy_s: float = Field(300.0, gt=0)
    #: Opening a connection to the policy endpoint (inside ``policy_s``): one
    #: that cannot open in this long will not by waiting longer, and failing it
    #: early leaves the rest of ``policy_s`` to retries.
    policy_connect_s: float = Field(10.0, gt=0)
    verifier_s: float = Field(120.0, gt=0)
    release_s: float = Field(30.0, gt=0)
    #: Setting up a browser lease (create, navigate, health check) in all.
    browser_lease_s: float = Field(60.0, gt=0)
    telemetry_s: float = Field(5.0, gt=0)
    rollout_s: float = Field(1800.0, gt=0)
    #: An idle HTTP connection (control plane, MCP) is not reused after this
    #: long. Keep it below the idle timeout of Fleet's servers and load
    #: balancers: one that closes an idle connection just as a request goes
    #: out fails that request (and an MCP session with it).
    http_keepalive_s: float = Field(15.0, gt=0)
    #: With ``--ray``: a call to an actor that answers at once (a rollout's
    #: view, for the service's ``get_state`` and ``get_messages``; giving a
    #: create slot back to the limiter actor).
    ray_call_s: float = Field(30.0, gt=0)
    #: Each pre-flight check of ``fleetroll run`` (the environment listing,
    #: the policy endpoint's ``/models``).
    preflight_s: float = Field(30.0, gt=0)
    #: A weight sync (:mod:`fleetroll.training.weight_sync`): pushing new weights
    #: to every policy server, retries and the check of each server's version included.
    weight_sync_s: float = Field(600.0, gt=0)


class ProvisioningSettings(_Section):
    """How instances are created: limits and the one retry policy."""

    #: Ceilings of the create gate: creates in flight, and a second.
    max_concurrent_creates: int = Field(32, ge=1)
    creates_per_second: float = Field(32.0, gt=0)
    #: Learn the create rate and the creates in flight from Fleet's answers
    #: (up while it answers fast; halved on 429, 503, time-outs, slow answers),
    #: from the start values below, under the ceilings above. Off: the ceilings
    #: are the rate, and a 429 is a failed attempt like a 5xx.
    adaptive_creates: bool = True
    #: Where the learnt rate and in-flight limit start. None: a quarter of their
    #: ceilings (8 a second, the fixed rate of old, and 8 in flight by default).
    start_creates_per_second: float | None = Field(None, gt=0)
    start_concurrent_creates: int | None = Field(None, ge=1)
    #: The learnt rate never falls below this.
    min_creates_per_second: float = Field(0.1, gt=0)
    #: A create that succeeds but takes longer than this says Fleet is loaded.
    slow_create_s: float = Field(120.0, gt=0)
    #: Instances are made with this heartbeat interval (whole seconds; Fleet
    #: accepts 30-3600) and kept alive by heartbeats while this process holds
    #: them: a killed process's instances stop about two intervals later, not
    #: at their TTL. None: no heartbeats (the TTL alone ends them).
    heartbeat_s: int | None = Field(60, ge=1)
    #: How a rollout's control-plane calls are made (create, reset, verify,
    #: heartbeat, release): "direct" sends the Fleet SDK's requests over one shared
    #: connection pool without its models and clients (less CPU per rollout);
    #: "sdk" goes through the SDK. Listing, account, runs, leases and sweeps use
    #: the SDK either way.
    control_client: Literal["direct", "sdk"] = "direct"
    max_attempts: int = Field(5, ge=1)
    backoff_initial_s: float = Field(2.0, ge=0)
    backoff_max_s: float = Field(60.0, ge=0)
    retry_instance_limit: bool = False
    region: str | None = None
    #: Reuse instances: one whose rollout ended without an infrastructure failure
    #: is reset to its seed and handed to the next rollout of the same
    #: environment, version and data (docs/configuration.md, "Instance reuse").
    #: Off by default: a reset that leaves state behind (files outside the
    #: environment's database, caches) would change another rollout's reward
    #: with no error, and only a run with and without reuse can tell; computer-use
    #: and browser-lease modalities are never reused (a screen is not in the seed).
    reuse: bool = False
    #: Times one instance may be reused after its first rollout; then it is released.
    max_reuses: int = Field(16, ge=0)
    #: A rollout that finds no idle instance of its kind while others of that kind
    #: are in use or being created waits for one to come back; it creates its own
    #: once none came back or became ready for this long, or at once when its place
    #: in the queue means a longer wait (at the rate they come back).
    reuse_wait_s: float = Field(10.0, ge=0)
    #: Idle (reset) instances kept per environment, version and data, for the
    #: next rollouts and batches of a long-lived pool; more are released at once.
    warm_instances: int = Field(8, ge=0)
    #: An idle instance is released after this long unused.
    warm_idle_s: float = Field(60.0, gt=0)

    @property
    def budget(self) -> Budget:
        """A create's, and a pre-flight's: both ask Fleet's control plane."""
        return Budget(self.max_attempts, self.backoff_initial_s, self.backoff_max_s)


class EnvAdmissionSettings(_Section):
    """Admission of one environment version (``[admission.env."ledger:v1"]``)."""

    #: Its instances provisioned and not released yet (starting ones count).
    max_instances: int | None = Field(None, ge=1)


class BreakerSettings(_Section):
    """The per-environment-version circuit breaker (docs/configuration.md)."""

    enabled: bool = True
    #: The last this many rollouts of an environment version are the window.
    window: int = Field(20, ge=1)
    #: No verdict on fewer rollouts than this in the window.
    min_rollouts: int = Field(10, ge=1)
    #: Share of infrastructure failures (init_error, tools_error,
    #: instance_lost, verifier_error, reset_failed) in the window that opens the breaker.
    failure_share: float = Field(0.5, gt=0, le=1)
    #: While open: "wait" holds new rollouts of it (within the provisioning
    #: budget); "fail" ends them at once as ``env_unavailable``.
    on_open: Literal["wait", "fail"] = "wait"
    #: An open breaker lets one probe rollout through this long after it
    #: opened (or after the last probe failed); its success closes it.
    probe_interval_s: float = Field(30.0, gt=0)


class AdmissionSettings(_Section):
    """Which instances may be created now (fleetroll.environments.admission)."""

    #: Instances provisioned and not released yet, starting ones counted. None: no cap
    #: but Fleet's account limit.
    max_instances: int | None = Field(None, ge=1)
    #: Read Fleet's account instance limit (``account()``) at start and after a 403.
    account_limit: bool = True
    #: Other clients' instances on the account (seen in a 403) are presumed
    #: gone this long after: a create is tried again.
    limit_recheck_s: float = Field(10.0, gt=0)
    breaker: BreakerSettings = BreakerSettings()
    #: Per environment version (``"key:version"``) or key (``"key"``).
    env: dict[str, EnvAdmissionSettings] = Field(default_factory=dict)


class RetrySettings(_Section):
    """Retries of outgoing calls other than creates (those are ``[provisioning]``).

    Which failures are retried is one table (:mod:`fleetroll._internal.retrying`); the
    waits are full-jitter exponential backoff, a server's Retry-After first.
    """

    verifier_attempts: int = Field(3, ge=1)
    verifier_backoff_initial_s: float = Field(0.2, ge=0)
    verifier_backoff_max_s: float = Field(2.0, ge=0)
    mcp_connect_backoff_initial_s: float = Field(0.05, ge=0)
    mcp_connect_backoff_max_s: float = Field(2.0, ge=0)
    #: Tries in all to open an MCP session; none: until timeouts.mcp_connect_s.
    mcp_connect_attempts: int | None = Field(None, ge=1)
    #: Tries in all of an MCP session's tools/list (idempotent), inside
    #: timeouts.list_tools_s, with the mcp_connect backoffs.
    list_tools_attempts: int = Field(3, ge=1)
    #: Tries in all of one MCP HTTP request (a tools/call too) whose connection
    #: could not be opened: the request never left, so sending it again is safe.
    mcp_request_attempts: int = Field(3, ge=1)
    #: The policy's waits; how many retries is policy.max_retries.
    policy_backoff_initial_s: float = Field(0.5, ge=0)
    policy_backoff_max_s: float = Field(30.0, ge=0)
    #: Tries in all of one judge call (a task's ``rewards``) that failed
    #: transiently (connection error, 408/425/429/5xx), inside judge.timeout_s.
    judge_attempts: int = Field(3, ge=1)
    judge_backoff_initial_s: float = Field(0.5, ge=0)
    judge_backoff_max_s: float = Field(10.0, ge=0)
    #: Tries in all of one server's weight update (fleetroll.training.weight_sync)
    #: that failed transiently (connection error, 408/425/429/5xx), inside
    #: timeouts.weight_sync_s.
    weight_sync_attempts: int = Field(3, ge=1)
    weight_sync_backoff_initial_s: float = Field(1.0, ge=0)
    weight_sync_backoff_max_s: float = Field(10.0, ge=0)
    #: Defaults of fleetroll.client.FleetrollClient (a trainer's process).
    client_max_retries: int = Field(5, ge=0)
    client_backoff_initial_s: float = Field(0.1, ge=0)
    client_backoff_max_s: float = Field(5.0, ge=0)

    @property
    def mcp_connect_budget(self) -> Budget:
        """Opening an MCP session."""
        initial, cap = self.mcp_connect_backoff_initial_s, self.mcp_connect_backoff_max_s
        return Budget(self.mcp_connect_attempts, initial, cap)

    @property
    def list_tools_budget(self) -> Budget:
        """An MCP session's tools/list (idempotent), with the mcp_connect backoffs."""
        initial, cap = self.mcp_connect_backoff_initial_s, self.mcp_connect_backoff_max_s
        return Budget(self.list_tools_attempts, initial, cap)

    @property
    def mcp_request_budget(self) -> Budget:
        """An MCP request whose connection could not be opened, with the mcp_connect backoffs."""
        initial, cap = self.mcp_connect_backoff_initial_s, self.mcp_connect_backoff_max_s
        return Budget(self.mcp_request_attempts, initial, cap)

    @property
    def verify_budget(self) -> Budget:
        """A verifier call."""
        initial, cap = self.verifier_backoff_initial_s, self.verifier_backoff_max_s
        return Budget(self.verifier_attempts, initial, cap)

    @property
    def judge_budget(self) -> Budget:
        """A judge call (a task's ``rewards``)."""
        return Budget(self.judge_attempts, self.judge_backoff_initial_s, self.judge_backoff_max_s)

    @property
    def weight_sync_budget(self) -> Budget:
        """One policy server's weight update."""
        initial, cap = self.weight_sync_backoff_initial_s, self.weight_sync_backoff_max_s
        return Budget(self.weight_sync_attempts, initial, cap)


class ModalitySettings(_Section):
    """One row of the modality routing table (docs/configuration.md)."""

    endpoint: str = Field(description="MCP URL template; {root} is the instance's urls.root")
    image_type: str | None = None
    ttl_s: int = Field(900, ge=1)
    tools: Literal["api", "computer"] = "api"
    #: browser_use's lease flow: a browser leased apart from the instance,
    #: navigated to its UI; the route goes to the lease's MCP URL.
    browser_lease: bool = False


class PoolSettings(_Section):
    concurrency: int = Field(128, ge=1)
    max_steps: int = Field(30, ge=1)
    #: Keep screenshots (data URLs) in result transcripts; off, they are
    #: replaced by a short placeholder (a screenshot is ~65 KB of base64).
    transcript_images: bool = False
    #: A tool call that fails for infrastructure reasons (timeout, transport
    #: error, instance gone): "fail" ends the rollout as ``tool_failure`` with
    #: no reward; "continue" feeds the error to the agent and goes on. Either
    #: way it is counted in the result's ``tool_failures``.
    on_tool_failure: Literal["fail", "continue"] = "fail"
    #: Largest verifier source (``verifier_func``, UTF-8 bytes) a rollout
    #: accepts; a bigger one is a ``verifier_error``, never parsed.
    max_verifier_bytes: int = Field(1024 * 1024, ge=1)
    #: Bytes of one MCP answer to a tool call (the HTTP body, an SSE stream, or
    #: a stdio line) read before giving up: past it the call is a tool failure
    #: (``tool_failure``), the connection closed, the rest never read.
    max_tool_answer_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    #: Bytes of one MCP tool listing (``tools/list``) read before giving up:
    #: past it connecting is a ``tools_error``.
    max_tool_listing_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    #: Finished batches a pool still holds (``pool.batches``) once their results
    #: were all read; the oldest is forgotten first. A long-lived pool (a
    #: training controller's) would otherwise keep every transcript it made.
    keep_finished_batches: int = Field(16, ge=0)
    #: Rollouts not yet finished across all of a pool's batches; a batch that
    #: would go over is refused (``PoolFullError``; HTTP 503 with Retry-After).
    max_queued_rollouts: int = Field(100_000, ge=1)
    #: Extra rollouts started per group (GRPO): a group is complete at its first
    #: ``samples_per_task`` scored samples, and the extras still running are
    #: stopped and end as ``superseded`` (no reward). ``run_batch(oversample=)``
    #: overrides it per batch.
    oversample: int = Field(0, ge=0)
    #: Asynchronous RL: a rollout whose first policy call used a version more
    #: than this many versions behind ``pool.policy_version`` when it ends is
    #: ``stale`` (scored by the verifier). None: no limit.
    max_staleness: int | None = Field(None, ge=0)
    #: What a stale rollout does: "flag" reports it ``stale``; "restart" runs it
    #: again from scratch on a fresh instance (still one result per rollout),
    #: at most ``max_stale_restarts`` times, then reports it ``stale``.
    staleness_action: Literal["flag", "restart"] = "flag"
    max_stale_restarts: int = Field(2, ge=0)
    #: Live events a rollout keeps (``GET /v1/rollouts/{id}/events``): phases,
    #: turns, tool calls, the end; the oldest go first beyond this.
    events_max: int = Field(512, ge=8)
    #: Characters of text (redacted) an event's preview keeps of a turn, a
    #: tool call's arguments or its answer.
    events_preview_chars: int = Field(200, ge=0)
    #: ``fleetroll run``: when each of the first this many rollouts to finish
    #: failed the same way (same failure_reason and error), the batch stops
    #: there; the rest end ``cancelled`` (``--resume`` runs them). 0: never.
    stop_after_same_failures: int = Field(20, ge=0)
    #: The garbage collector's policy of ``fleetroll run``, ``bench`` and
    #: ``serve`` (never of a program that imports fleetroll): "tuned" freezes
    #: what start-up made and collects less often; "python" leaves Python's own
    #: (docs/configuration.md has the numbers).
    gc_policy: Literal["tuned", "python"] = "tuned"
    #: The MCP client of sessions over HTTP: "thin" speaks the modern,
    #: stateless revision (2026-07-28) with plain POSTs on one shared
    #: connection pool per provider, and hands any other server (a legacy or
    #: stateful one) to the mcp SDK's client; "sdk" always uses the SDK's.
    mcp_client: Literal["thin", "sdk"] = "thin"


class SamplingSettings(_Section):
    """The task sampler of ``fleetroll run --steps`` (``fleetroll.training.sampler``)."""

    #: Seeds every shuffle: the same seed, tasks and settings draw the same sequence.
    seed: int = 0
    #: Per environment (a task's ``env_key``): its share of the draws. Empty:
    #: every task alike, in one shuffled pass over all of them per epoch.
    #: Otherwise every environment of the tasks needs a weight (0 leaves it out).
    weights: dict[str, float] = Field(default_factory=dict)
    #: Per environment: at least this many of its tasks in every batch.
    minimums: dict[str, int] = Field(default_factory=dict)
    #: The difficulty filter: rest a task after ``uniform_groups`` uniform
    #: groups in a row (every sample the same reward), for ``rest_steps`` steps.
    rest_uniform: bool = False
    uniform_groups: int = Field(2, ge=1)
    rest_steps: int = Field(8, ge=1)

    @field_validator("weights")
    @classmethod
    def _non_negative_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        negative = sorted(env for env, w in weights.items() if not w >= 0)
        if negative:
            raise ValueError(f"a weight must be 0 or more (sampling.weights.{negative[0]})")
        return weights

    @field_validator("minimums")
    @classmethod
    def _non_negative_minimums(cls, minimums: dict[str, int]) -> dict[str, int]:
        negative = sorted(env for env, n in minimums.items() if n < 0)
        if negative:
            raise ValueError(f"a minimum must be 0 or more (sampling.minimums.{negative[0]})")
        return minimums


class PolicySettings(_Section):
    """The default policy, and the OpenAI-compatible endpoint's parameters."""

    kind: Literal["scripted", "openai"] = "scripted"
    #: Scripted policy: seconds of "think time" before each turn (benchmarks).
    think_time_s: float = Field(0.0, ge=0)
    model: str = "gpt-4o-mini"
    base_url: str = "http://127.0.0.1:8000/v1"
    #: Many policy servers (``--base-url`` repeated): each rollout's calls go to
    #: one of them (docs/configuration.md, "Many policy servers"). When not
    #: empty it wins over ``base_url``, which is then ignored.
    base_urls: list[str] = Field(default_factory=list)
    #: Calls in flight per policy server; the rest wait for one to end. None: no cap.
    max_calls_per_server: int | None = Field(None, ge=1)
    #: A policy server that fails this many calls in a row (unreachable, 5xx)
    #: is left out for ``eject_s``; its rollouts go on with another server.
    eject_after_failures: int = Field(2, ge=1)
    eject_s: float = Field(30.0, gt=0)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    #: Extra body fields sent with every chat completion (e.g. vLLM's top_k).
    extra_body: dict[str, Any] = Field(default_factory=dict)
    system_prompt: str | None = None
    #: Retries on 429/5xx/connection errors, inside the policy_s deadline.
    max_retries: int = Field(2, ge=0)
    #: Training data (docs/results.md, ``turns``): ask the server for the token ids
    #: of each prompt and completion (vLLM's ``return_token_ids``) and for per-token
    #: logprobs (``logprobs``; ``top_logprobs`` alternatives per token when set).
    return_token_ids: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    #: Stitch each rollout's turns into one token sequence (the result's
    #: ``trajectory``: ids, loss mask, logprobs, policy versions, drift). Asks
    #: for token ids as ``return_token_ids`` does.
    trajectory: bool = False
    #: Token-in: from the second call on, send the conversation as the token ids
    #: the server returned (plus the new observation, tokenized by the server's
    #: ``/tokenize``) to ``/chat/completions/tokens``, so a chat template that
    #: re-renders history cannot drift. Needs a server with both routes
    #: (docs/configuration.md); asks for token ids as ``return_token_ids`` does.
    #: ``"completions"``: the same on any server with ``/v1/completions``: the
    #: chat template rendered here with ``tokenizer``, tool calls parsed here
    #: with ``tool_parser``, every call's prompt sent as token ids.
    token_in: bool | Literal["completions"] = False
    #: ``token_in = "completions"``: the model's Hugging Face tokenizer (a local
    #: directory or a hub name), loaded once per process. None: ``model``.
    tokenizer: str | None = None
    #: ``token_in = "completions"``: how tool calls are read off the model's text
    #: (``hermes``: Qwen's ``<tool_call>{json}</tool_call>``, as vLLM's parser).
    tool_parser: Literal["hermes"] = "hermes"
    #: Only the last this many screenshots are sent to the model; older ones are
    #: replaced by a short text placeholder (in the transcript too). None: all.
    max_images: int | None = Field(None, ge=0)
    #: For a vision-language policy (Qwen2-VL-style): resize every image by
    #: Qwen2-VL's rule to at most this many pixels before the model sees it (the
    #: same pixels go into the turns' ``images``), and keep token-in on with
    #: images (the ids with the images' placeholders, plus the images). None:
    #: images go as they are, and a conversation with images as messages.
    image_max_pixels: int | None = Field(None, ge=56 * 56)
    #: How a journal (``fleetroll run --out``) keeps the turns' and
    #: trajectories' images: "inline", base64 PNG in each line; "files", each
    #: distinct PNG once as ``<journal>.images/<sha256>.png``, the lines holding
    #: its reference (``path``, ``sha256``, ``nbytes``). Results in memory and
    #: over HTTP always carry the bytes (docs/results.md).
    image_store: Literal["inline", "files"] = "inline"
    #: A rollout whose next prompt would pass this many tokens ends with
    #: ``context_overflow`` (scored). None: only the server's own limit applies.
    max_context_tokens: int | None = Field(None, ge=1)
    #: Bytes of one chat completion (the HTTP body) read before giving up: past
    #: it the turn is a ``policy_error``, the connection closed.
    max_answer_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    #: An agent command's (``--agent-command``) processes: SIGTERM once its
    #: rollout's deadline passes (or it is cancelled), all killed this much later.
    agent_kill_grace_s: float = Field(2.0, ge=0)
    #: The largest request an agent command may send to its gateway or its MCP relay
    #: (HTTP 413 past it).
    agent_max_request_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    #: Bytes of an agent command's answer file read as the final answer (the rest is cut).
    agent_max_answer_file_bytes: int = Field(1024 * 1024, ge=1)
    #: Bytes of an agent command's output kept in its log: past them, a marker
    #: line, then only its last 64 KiB (at most half of this), written at its end.
    agent_max_log_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    #: How an agent command's processes are contained: "namespace", a PID
    #: namespace of its own (ended whole; fleetroll's and its siblings' /proc out
    #: of its reach), "subreaper", its orphans kept and ended by its init, "auto"
    #: (the namespace where one can be made, else the subreaper with a warning).
    agent_sandbox: Literal["auto", "namespace", "subreaper"] = "auto"
    #: What a weight update (``sync_weights``, ``pool.policy_paused()``) does to
    #: generations in flight: "pause" holds new policy calls while running ones
    #: finish on the old weights; "abort" holds them too, aborts the running ones
    #: on the servers (``/abort_request``) and resumes each from its partial
    #: output on the new weights (token-in); "in_flight" holds nothing: the
    #: servers switch between tokens or between turns (docs/training.md).
    weight_update: Literal["pause", "abort", "in_flight"] = "pause"
    #: A rollout whose oldest generated token is more than this many policy
    #: versions behind when it ends is dropped as ``stale``; with "abort", a
    #: partial output older than this is not resumed but sampled again. None: no bound.
    max_token_staleness: int | None = Field(None, ge=0)

    @field_validator("token_in", mode="before")
    @classmethod
    def _token_in_mode(cls, value: object) -> object:
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off", ""):
                return False
            if lowered == "completions":
                return "completions"
        if isinstance(value, bool):
            return value
        raise ValueError(f'policy.token_in must be true, false or "completions", not {value!r}')

    @field_validator("base_urls")
    @classmethod
    def _distinct_servers(cls, urls: list[str]) -> list[str]:
        roots = [url.rstrip("/") for url in urls]
        if len(set(roots)) < len(roots):
            raise ValueError("a policy server is listed twice in policy.base_urls")
        return urls

    @property
    def servers(self) -> list[str]:
        """The policy servers' API roots: ``base_urls``, or else ``[base_url]``."""
        return list(self.base_urls) or [self.base_url]


class JudgeSettings(_Section):
    """The model that scores the rubrics of tasks' ``rewards`` (kind ``judge``).

    Any OpenAI-compatible ``/chat/completions`` endpoint. Its key is not here: it
    comes only from ``FLEETROLL_JUDGE_API_KEY`` (:attr:`Settings.judge_api_key`),
    never the policy's.
    """

    #: The API root, e.g. ``https://api.openai.com/v1``. None: no judge, and a
    #: judge component cannot be computed (``reward_error``).
    base_url: str | None = Field(None, pattern=r"^https?://[^\s]+$")
    model: str = "gpt-4o-mini"
    #: Deadline of one judgement, retries included (retries: ``[retries]`` judge_*).
    timeout_s: float = Field(60.0, gt=0)
    #: Opening a connection to the judge (inside ``timeout_s``).
    connect_timeout_s: float = Field(10.0, gt=0)
    #: ``max_tokens`` of each judge call.
    max_tokens: int = Field(256, ge=1)
    #: ``temperature`` of each judge call (None: the server's default).
    temperature: float | None = Field(0.0, ge=0)
    #: Judge calls in flight at once, across all rollouts of the process.
    max_concurrent: int = Field(16, ge=1)
    #: Judgements kept in memory by content (model, rubric, text): the same
    #: question asked again is answered from here. 0: no cache.
    cache_entries: int = Field(10_000, ge=0)
    #: Characters of the judged text (transcript or answer) sent at most; a
    #: longer one keeps its start and end with a marker between them.
    max_input_chars: int = Field(100_000, ge=1000)
    #: Bytes of one judge answer read before giving up (the call fails).
    max_answer_bytes: int = Field(1024 * 1024, ge=1024)


class TelemetrySettings(_Section):
    """Telemetry (docs/telemetry.md): the local store, Logfire cloud, the console."""

    #: The local SQLite store; ``/dev/null`` (``os.devnull``) turns it off.
    db_path: Path = STATE_ROOT / STORE_FILE
    #: ``deployment_environment`` of every record (Logfire's ``environment``);
    #: the reference's name, which existing dashboards filter on.
    environment: str = "training_rollouts"
    #: Console lines at or above this level (see fleetroll.telemetry.sinks).
    console_level: Literal["debug", "info", "warning", "error"] = "info"
    #: ``text`` for people; ``json``: every line fleetroll writes to stderr is one
    #: JSON object (events, log records, notices, progress), for a log shipper.
    console: Literal["text", "json"] = "text"
    #: On a terminal, failed rollouts are summed up per failure reason: one
    #: line with a count at most this often per reason.
    console_repeat_s: float = Field(10.0, gt=0)
    #: Send records to Logfire cloud when LOGFIRE_TOKEN is set; false keeps them local.
    send_to_logfire: bool = True
    #: One ``fleet_tool_call`` record per tool call (tool, duration, outcome):
    #: what the slowest-tools query and ``/metrics``' tool histogram read.
    tool_calls: bool = True
    #: The store commits a batch every this many seconds or records, whichever comes first.
    flush_interval_s: float = Field(0.2, gt=0)
    flush_records: int = Field(512, ge=1)
    #: Records waiting for the store; past this, new ones are dropped (and counted).
    max_queued: int = Field(100_000, ge=1)
    #: Each of the final flushes (store, Logfire cloud) gives up after this long.
    shutdown_timeout_s: float = Field(10.0, gt=0)
    #: The dashboard lists a rollout started this long ago and not completed
    #: (its process alive) as stuck.
    dashboard_stuck_after_s: float = Field(600.0, gt=0)
    #: The dashboard's ETA: the completion rate over this last stretch of the
    #: batch (not since its start, so a slow start does not skew it).
    dashboard_eta_window_s: float = Field(300.0, gt=0)
    #: The dashboard shows this many of the latest failed rollouts.
    dashboard_errors: int = Field(20, ge=1, le=500)


@dataclass(frozen=True, slots=True)
class VerifierLimits:
    """What one verifier may take and say (the emulator's verifier workers'
    section, built by :meth:`EmulatorSettings.verifier_limits`)."""

    memory_mb: int = 512
    cpu_s: int = 60
    max_output_bytes: int = 1024 * 1024
    max_answer_bytes: int = 16 * 1024 * 1024
    #: Run workers with no network (``unshare -rn``) when this machine allows it.
    isolate_network: bool = True


class EmulatorSettings(_Section):
    """The embedded emulator. Its API key is not here: it comes only from
    ``FLEETROLL_EMULATOR_API_KEY`` (:attr:`Settings.emulator_api_key`), or is
    generated at start."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    profile: str = "clean"
    #: Verifier workers (code from tasks, run on this host): address space,
    #: CPU time per run, printed output kept, answer size, and no network
    #: where ``unshare -rn`` works.
    verifier_memory_mb: int = Field(512, ge=64)
    verifier_cpu_s: int = Field(60, ge=1)
    verifier_max_output_bytes: int = Field(1024 * 1024, ge=1024)
    verifier_max_answer_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    verifier_isolate_network: bool = True
    verifier_max_parallel: int = Field(4, ge=1)
    #: Ended instances (and their SQLite files) kept for late reads; past
    #: either bound the oldest are forgotten.
    keep_ended_instances: int = Field(1024, ge=0)
    keep_ended_s: float = Field(600.0, ge=0)
    profiles: dict[str, FaultProfile] = Field(default_factory=dict)

    def verifier_limits(self) -> VerifierLimits:
        """What one verifier run may take and say."""
        return VerifierLimits(
            memory_mb=self.verifier_memory_mb,
            cpu_s=self.verifier_cpu_s,
            max_output_bytes=self.verifier_max_output_bytes,
            max_answer_bytes=self.verifier_max_answer_bytes,
            isolate_network=self.verifier_isolate_network,
        )

    def fault_profile(self, name: str | None = None) -> FaultProfile:
        """The named profile (default: ``profile``).

        Raises:
            ConfigError: no profile has that name.
        """
        name = name or self.profile
        try:
            return self.profiles[name]
        except KeyError:
            known = ", ".join(sorted(self.profiles)) or "none"
            raise ConfigError(
                f"unknown emulator profile {name!r} (known profiles: {known})"
            ) from None


class McpSettings(_Section):
    """The ``mcp`` provider: tasks whose environment is any MCP server (docs/tasks.md)."""

    #: Where per-rollout working directories are made (None: the system's temp folder).
    workdir_root: Path | None = None
    #: Keep each rollout's working directory after release (for debugging).
    keep_workdirs: bool = False
    #: Deadline of a task's ``environment.setup`` command.
    setup_s: float = Field(120.0, gt=0)
    #: Seconds between SIGTERM and SIGKILL to a server's (or verifier's) process group.
    kill_grace_s: float = Field(2.0, ge=0)
    #: Last lines of a server's stderr put in the error when it cannot start.
    stderr_lines: int = Field(20, ge=0)


class TraceSettings(_Section):
    """Fleet trace upload: each finished rollout posted to Fleet's trace API (off by default)."""

    #: Post every finished rollout (transcript, verifier execution id) as a Fleet session.
    upload: bool = False
    #: Rollouts waiting to be posted; past it a rollout's trace is dropped and counted.
    max_queued: int = Field(10_000, ge=1)
    #: Posts in flight at once.
    max_parallel: int = Field(4, ge=1)
    #: Deadline of each post (the batch's trace job, one session).
    upload_s: float = Field(30.0, gt=0)
    #: When the pool closes, how long queued traces may still take to be posted.
    flush_s: float = Field(30.0, gt=0)


class ServiceSettings(_Section):
    """``fleetroll serve``: the HTTP service for remote training controllers.

    The bearer token is not here: it comes from ``FLEETROLL_SERVICE_TOKEN``
    (:attr:`Settings.service_token`), else from ``token_file``.
    """

    host: str = "127.0.0.1"
    port: int = Field(8750, ge=0, le=65535)
    #: Largest request body accepted (413 beyond).
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    #: A session nobody steps for this long closes itself and releases its instance.
    session_idle_s: float = Field(600.0, gt=0)
    #: Rollouts one batch may hold (tasks × samples_per_task); 422 beyond.
    max_batch_rollouts: int = Field(10_000, ge=1)
    #: Finished batches whose results stay readable (oldest forgotten first,
    #: with their files in ``state_dir``).
    keep_finished_batches: int = Field(64, ge=0)
    #: ``/metrics``: environments (and, apart, tools) with a label of their own,
    #: the first seen; any later one is labelled ``other`` (bounded cardinality).
    metrics_label_values: int = Field(20, ge=1, le=1000)
    #: ``fleetroll serve`` keeps each batch's request and results here (one
    #: journal per batch), locked while it runs, and reads them back at start-up.
    state_dir: Path = STATE_ROOT / SERVICE_FOLDER
    #: Ended sessions whose result a late ``DELETE`` can still fetch.
    keep_ended_sessions: int = Field(256, ge=0)
    #: An idle results stream sends a heartbeat line this often.
    stream_heartbeat_s: float = Field(15.0, gt=0)
    #: ``tasks_file`` in a request must lie under this folder (relative: to the cwd).
    tasks_root: Path = Path(".")
    #: Largest ``tasks_file`` (a folder: its task files together) a request may
    #: name; checked before reading (422 beyond).
    max_tasks_file_bytes: int = Field(64 * 1024 * 1024, ge=1)
    #: ``POST /v1/query`` (and ``fleetroll query``): rows and bytes of values
    #: returned at most (fetching stops there), and each query's time budget.
    query_max_rows: int = Field(10_000, ge=1)
    query_max_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    query_timeout_s: float = Field(10.0, gt=0)
    #: Telemetry reads run at once (``/v1/query``, stats, the dashboard): each
    #: holds a worker thread and a SQLite reader; more wait their turn.
    max_concurrent_queries: int = Field(2, ge=1)
    #: Accept ``mcp`` tasks that run commands on this host (``environment.command``,
    #: ``verifier.command``) and batches with an ``agent_command``. Off: anyone
    #: holding the service token could run anything as the service's user; such
    #: tasks and batches are refused with a 422.
    allow_command_tasks: bool = False
    #: Longest lease of one pause of policy calls (``POST /v1/policy/pauses``):
    #: a trainer renews it to hold longer; one that crashed lets go within it.
    max_pause_ttl_s: float = Field(600.0, gt=0)
    #: Check every batch (``POST /v1/batches``, the MCP tools' rollouts) as
    #: ``fleetroll run`` does before it provisions anything: its environment
    #: versions exist, Fleet accepts the key, the policy answers. 422 otherwise.
    preflight: bool = True
    #: Pre-flight reuses Fleet's environment listing and a policy endpoint that
    #: answered for this long, in this process (0: asks on every batch).
    preflight_cache_s: float = Field(30.0, ge=0)
    #: Without ``FLEETROLL_SERVICE_TOKEN``, ``serve`` takes its bearer token from
    #: this file (made on first use, readable by this user only): every route
    #: but ``/healthz`` always needs a token.
    token_file: Path = Path("~/.local/state/fleetroll/service-token")
