"""Fleet as an environment provider: instances through Fleet's control plane.

:class:`FleetProvider` implements :class:`fleetroll.environments.provider.Provider`
for Fleet (and the embedded emulator): with the modules it owns
(:mod:`fleetroll.environments.fleet.control`: failure classification, the SDK's clients,
browser leases, the pre-flight listing; :mod:`fleetroll.environments.fleet.control_client`:
creates and status checks, over :mod:`fleetroll.environments.fleet.direct` or the SDK
(``provisioning.control_client``), chosen once when the provider is built;
:mod:`fleetroll.environments.fleet.verification`;
:mod:`fleetroll.environments.fleet.traces`) it is the only code of the core that talks to
Fleet. It takes a :class:`FleetConfig`, what it reads of the settings
(:func:`fleetroll.pool.assembly.fleet_provider` builds one from ``Settings``).

* ``AsyncFleet(max_retries=0)``: the SDK's own transport retries (which would
  re-POST creates) are off, so every retry decision is made here, once.
* :func:`classify` decides transient vs permanent from the SDK's typed
  exceptions (``fleet._async.exceptions``, not ``fleet.FleetAPIError``), then
  status codes, then structured bodies (``"retryable"``), text last.
* Creates retry through :func:`fleetroll._internal.retrying.attempts` (full-jitter
  backoff, or the server's Retry-After when longer) inside a total budget;
  each attempt has its own hard deadline.
* Creates have their own concurrency limit and rate (a token bucket), apart
  from running rollouts, so a slow Fleet queue never starves them; with an
  :class:`~fleetroll.environments.admission.AdmissionController`, each instance also holds
  a place from before its create to its release (instance caps, Fleet's
  account limit, a 403 ``instance_limit_exceeded`` waits for a release,
  per-environment breakers).
* :meth:`FleetProvider.release` runs shielded and bounded: cancellation
  cannot leak an instance, and a hung delete cannot hang the caller.
* A create request, once sent, is Fleet's to finish whoever waits for it: it
  runs in the provider's own task group (:meth:`FleetProvider.start`), so a
  rollout cancelled meanwhile (its batch cancelled, a Ctrl-C, its provisioning
  budget) returns at once and leaves the create to end. The create keeps its
  admission place and create slot until then; what it made is released as soon
  as it is answered (``fleet_create_abandoned`` names it).
* A create that got no answer (its deadline passed, its connection broke, the
  pool closed under it) may still have made an instance nobody knows the id
  of: its tag (``run_id``) is swept once no create of that tag is in flight any
  more and its batch's own sweep (:meth:`FleetProvider.sweep`) ran, and at the
  latest when the provider's background closes (:meth:`FleetProvider.collect_unanswered`).
  An instance is held (no sweep takes it) from the moment its create is answered.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import httpx2
from anyio.abc import TaskGroup
from fleet._async import exceptions as fleet_errors
from fleet._async.client import AsyncEnv
from fleet.config import GLOBAL_BASE_URL
from fleet.runner_auth import RunnerTokenProvider

import fleetroll._internal.retrying as retrying
from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.http_transport import AiohttpTransport
from fleetroll._internal.preflight_cache import PreflightCache
from fleetroll._internal.proxies import Proxies
from fleetroll._internal.retrying import Decision, Retry
from fleetroll._internal.wire import Wire
from fleetroll.environments.admission import (
    Admission,
    CreateLimits,
    CreateSlots,
    ReadFailure,
    Ticket,
    TokenBucket,
)
from fleetroll.environments.fleet.admission import read_create_error
from fleetroll.environments.fleet.control import (
    Classification,
    Known,
    Lease,
    classify,
    create_lease,
    delete_lease,
    forget_retry_after,
    listing_problems,
    provisioning_failed,
    sdk_lanes,
)
from fleetroll.environments.fleet.control_client import ControlClient, control_client
from fleetroll.environments.fleet.direct import FleetEnv, new_request_id
from fleetroll.environments.fleet.heartbeats import Heartbeats
from fleetroll.environments.fleet.verification import Verifier
from fleetroll.environments.provider import Instance, Verdict
from fleetroll.errors import ConfigError, EnvUnavailableError, ProvisionError, RolloutError
from fleetroll.settings import (
    ModalitySettings,
    PoolSettings,
    ProvisioningSettings,
    RetrySettings,
    TimeoutSettings,
)
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.telemetry.retries import retry_emitter
from fleetroll.tools.routing import Route, route, wants_final_answer
from fleetroll.tools.session import (
    AnswerLimits,
    BoundedAnswers,
    RetryRefusedConnections,
    ToolSession,
    open_tool_session,
)

__all__ = [
    "Classification",
    "CreateGate",
    "FleetConfig",
    "FleetProvider",
    "TokenBucket",
    "classify",
]

_log = logging.getLogger(__name__)

#: What a sweep lists: running instances, and those still starting.
_SWEPT_STATUSES = ("running", "pending")


def _no_answer(exc: Exception) -> bool:
    """Whether a create that raised ``exc`` went without an answer from Fleet (its
    deadline, a broken connection) or its instance was left starting: it may have
    made an instance whose id we do not hold."""
    if isinstance(exc, TimeoutError | fleet_errors.FleetTimeoutError):
        return True
    return isinstance(exc, fleet_errors.FleetAPIError) and exc.status_code is None


class CreateGate(Protocol):
    """Admission for instance creates: a concurrency slot, then the rate.

    The pool's admission holds it (on Ray, the cluster's one, across every
    process: Fleet's limits are per account); without one, this process's own.
    """

    @property
    def adaptive(self) -> bool:
        """A 429 is the gate's to answer (it waits and slows down), not an attempt's."""
        ...

    def slot(self, read: ReadFailure) -> AbstractAsyncContextManager[None]:
        """Held for the duration of one create request (it learns from its answer,
        an error as ``read`` says: Fleet's is ``read_create_error``)."""
        ...


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """What :class:`FleetProvider` reads of the settings, split out of them where
    the provider is built (:func:`fleetroll.pool.assembly.fleet_config`)."""

    provisioning: ProvisioningSettings
    timeouts: TimeoutSettings
    retries: RetrySettings
    #: ``concurrency`` (sizes the SDK's lanes), ``max_verifier_bytes``,
    #: ``mcp_client`` and the MCP answers' caps (``max_tool_*_bytes``).
    pool: PoolSettings
    modalities: dict[str, ModalitySettings]
    #: This process's own create gate, used without an admission controller.
    create_limits: CreateLimits
    #: ``service.preflight_cache_s``: how long an environment listing is reused.
    preflight_cache_s: float
    #: ``admission.account_limit``: read Fleet's account instance limit first.
    account_limit: bool


@dataclass(eq=False, slots=True)
class _Create:
    """One create request run in the provider's task group, apart from the
    rollout that waits for it (see the module's docstring)."""

    ticket: Ticket | None
    run_id: str | None
    began: float = field(default_factory=time.monotonic)
    #: Cancelled by the rollout that leaves before the request is sent.
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    #: Its slot is taken and the request goes out: from then on it runs to its end.
    sent: bool = False
    #: Why its rollout left while it was in flight (what it makes is released).
    abandoned: str | None = None
    #: Cut short by the provider's task group closing before it was answered.
    cut: bool = False
    #: Sent and never answered (a deadline, a broken connection, a cut): it may
    #: have made an instance whose id nobody learnt (or what it made could not
    #: be released): its tag is swept again.
    unanswered: bool = False
    env: FleetEnv | None = None
    error: Exception | None = None


class FleetProvider:
    """Makes and releases instances on Fleet's control plane (its control client:
    :mod:`fleetroll.environments.fleet.control_client`)."""

    def __init__(
        self,
        config: FleetConfig,
        events: Events,
        *,
        api_key: str,
        base_url: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._config = config
        self._events = events
        self._where = base_url or "Fleet"
        self._admission = admission
        #: Each admitted instance's place, given back at its release.
        self._tickets: dict[str, Ticket] = {}
        self._account_read = False
        self._account_lock = anyio.Lock()
        t = config.timeouts
        # Built once, for the SDK's lanes, the Wire and the MCP clients: building
        # a TLS context (loading the CA bundle) costs ~30 ms of blocking work.
        # (It trusts SSL_CERT_FILE / SSL_CERT_DIR when set, as httpx does.)
        self._mcp_tls = httpx2.create_ssl_context()
        # The SDK modes' transports go through the environment's proxies as httpx
        # would (HTTP(S)_PROXY, ALL_PROXY, NO_PROXY), read once, here.
        try:
            self._proxies = Proxies.from_environment()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        proxy = self._proxies.shown_for(base_url or GLOBAL_BASE_URL)
        if proxy is not None:  # a pre-flight problem names the way it went
            self._where = f"{self._where} (through the proxy {proxy} the environment names)"
        self._clients, self._lanes = sdk_lanes(
            config.provisioning,
            t,
            concurrency=config.pool.concurrency,
            api_key=api_key,
            base_url=base_url,
            tls=self._mcp_tls,
            proxies=self._proxies,
        )
        #: For calls that belong to no instance (listing, sweeping).
        self.fleet = self._lanes[0]
        #: The environment listing, reused by pre-flights within its time to live
        #: (a service checks every batch on this one provider).
        self._listings = PreflightCache[Known](config.preflight_cache_s)
        # The SDK resolves the instance-router token once per *instance*, each
        # time building a new HTTP client (~20 ms of blocking TLS set-up on
        # the loop). One provider, resolved once, is shared by every instance.
        self._runner_tokens = RunnerTokenProvider(self.fleet.client)
        self._gate: CreateGate = admission or CreateSlots(config.create_limits, events)
        self._verifier = Verifier(
            timeout_s=t.verifier_s,
            max_source_bytes=config.pool.max_verifier_bytes,
            budget=config.retries.verify_budget,
            report=retry_emitter(events),
        )
        #: One shared connection pool for the hot path's requests without the
        #: SDKs: the control plane's (``provisioning.control_client = "direct"``)
        #: and the thin MCP client's (``pool.mcp_client = "thin"``).
        direct = config.provisioning.control_client == "direct"
        thin = config.pool.mcp_client == "thin"
        self._wire: Wire | None = None
        if direct or thin:
            self._wire = Wire(
                keepalive_s=t.http_keepalive_s,
                connect_timeout_s=t.mcp_connect_s,
                verify=self._mcp_tls,
            )
        #: Creates and status checks: the direct client or the SDK's, chosen here once.
        self._control: ControlClient = control_client(
            config.provisioning.control_client,
            lanes=self._lanes,
            runner_tokens=self._runner_tokens,
            wire=self._wire,
        )
        self._mcp_wire = self._wire if thin else None
        # Built once too, for every rollout's MCP session (fewer objects per rollout).
        self._mcp_report = retry_emitter(events)
        self._mcp_limits = AnswerLimits.from_pool(config.pool)
        self._retries = config.retries
        #: Browser leases by instance id (modalities with ``browser_lease``).
        self._leases: dict[str, Lease] = {}
        #: Keeps the instances this provider holds alive (once its loop is started).
        self.heartbeats = Heartbeats(config.provisioning.heartbeat_s, timeout_s=t.release_s)
        #: Instances provisioned and not released: a sweep leaves them alone.
        self._live: set[str] = set()
        #: Where create requests run (:meth:`start`); None: in their rollout's task.
        self._background: TaskGroup | None = None
        #: Create requests running there, and a wake-up when one ends (:meth:`settle`).
        self._creates: set[_Create] = set()
        self._create_ended: anyio.Event | None = None
        #: Places held by creates whose rollout left: given back when they end.
        self._held_by_creates: set[Ticket] = set()
        #: Tags (``run_id``) that may have an instance nobody holds since their
        #: last sweep: a create that got no answer, or whose instance's release failed.
        self._unanswered: set[str] = set()
        #: Tags whose batch's sweep ran while creates of theirs were in flight:
        #: swept again when the last of those ends, if one went unanswered.
        self._sweep_later: set[str] = set()

    def start(self, tg: TaskGroup) -> None:
        """Run the provider's background work in ``tg`` until :meth:`settle`:
        the heartbeats, and every create request (a rollout cancelled while its
        create is in flight leaves it to end there; what it makes is released)."""
        self._background = tg
        self.heartbeats.start(tg)

    async def settle(self) -> None:
        """Wait for the create requests still running in :meth:`start`'s task
        group to end and what they made to be released (shielded, at most
        ``timeouts.release_s``): for its owner, before it closes that group
        (which cuts those left; what they may have made is swept by
        :meth:`collect_unanswered` once it is closed). Creates from now on run
        in their rollout's task."""
        self._background = None
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._config.timeouts.release_s):
            while self._creates:
                ended = self._create_ended = anyio.Event()
                await ended.wait()

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()
        if self._wire is not None:
            await self._wire.aclose()

    def _env(self, instance: Instance) -> FleetEnv:
        return self._control.env_of(instance.handle)

    async def reset(self, instance: Instance, task: TaskSpec) -> None:
        """Reset the instance to its seed state, at ``task``'s ``seed`` and
        ``timestamp`` (Fleet's ``ResetRequest``; None: the platform's) (``timeouts.reset_s``).

        Raises:
            RolloutError: Fleet answered that the reset did not succeed.
        """
        with fail_after(self._config.timeouts.reset_s):
            answer = await self._env(instance).reset(seed=task.seed, timestamp=task.timestamp)
        if not answer.success:  # the instance's state is not its seed's
            raise RolloutError(
                f"Fleet could not reset the instance: {answer.message}", operation="reset"
            )

    def route(self, instance: Instance, task: TaskSpec) -> Route:
        """The MCP endpoint of ``task``'s modality on the instance (``[modalities]``)."""
        urls = self._env(instance).urls
        assert urls is not None  # provision() hands out running instances only
        chosen = route(
            task.modality,
            self._config.modalities,
            urls.root,
            final_answer=wants_final_answer(
                requires=task.requires_final_answer,
                verifier=task.verifier_func,
                prompt=task.prompt,
            ),
        )
        lease = self._leases.get(instance.instance_id)
        # The lease flow: the tools are the leased browser's, not the instance's.
        return chosen if lease is None else dataclasses.replace(chosen, url=lease.mcp_url)

    def open_tools(
        self, instance: Instance, route: Route
    ) -> AbstractAsyncContextManager[ToolSession]:
        """An MCP session on the route's endpoint.

        The thin client's requests go over the provider's one connection pool
        (``pool.mcp_client = "thin"``). The SDK's client, when the endpoint
        needs it, gets an HTTP client of its own (:meth:`mcp_client`): each
        Fleet instance is its own host anyway, and one shared pool of
        thousands of connections costs a scan of all of them on every request.
        """
        t = self._config.timeouts
        retries = self._retries
        return open_tool_session(
            route.url,
            self.mcp_client,
            connect_timeout_s=t.mcp_connect_s,
            call_timeout_s=t.call_tool_s,
            list_timeout_s=t.list_tools_s,
            budget=retries.mcp_connect_budget,
            list_budget=retries.list_tools_budget,
            report=self._mcp_report,
            limits=self._mcp_limits,
            wire=self._mcp_wire,
            request_budget=retries.mcp_request_budget,
        )

    def mcp_client(self) -> httpx2.AsyncClient:
        """An HTTP client for one rollout's MCP session (also used by the benchmarks)."""
        t = self._config.timeouts
        transport = AiohttpTransport(
            verify=self._mcp_tls,
            keepalive_s=t.http_keepalive_s,
            max_connections=8,
            proxies=self._proxies,
        )
        return httpx2.AsyncClient(
            timeout=httpx2.Timeout(
                max(t.call_tool_s, t.list_tools_s) + 5.0, connect=t.mcp_connect_s
            ),
            # A request whose connection was refused never left: sent again.
            # Answers are read up to pool.max_tool_*_bytes, counted while read.
            transport=BoundedAnswers(
                RetryRefusedConnections(
                    transport, self._retries.mcp_request_budget, self._mcp_report
                ),
                self._mcp_limits,
            ),
        )

    async def verify(self, instance: Instance, task: TaskSpec, final_answer: str | None) -> Verdict:
        """The task's verifier, run remotely by Fleet against the instance."""
        return await self._verifier.verify(task, self._env(instance), final_answer)

    async def preflight(self, tasks: Sequence[TaskSpec]) -> list[str]:
        """The control plane answers, the key is accepted, every env version exists
        (:func:`fleetroll.environments.fleet.control.listing_problems`)."""
        report = retry_emitter(self._events)
        return await listing_problems(
            self.fleet,
            tasks,
            timeout_s=self._config.timeouts.preflight_s,
            budget=self._config.provisioning.budget,
            where=self._where,
            report=report,
            cache=self._listings,
        )

    async def provision(self, task: TaskSpec, *, run_id: str | None = None) -> Instance:
        """Create a running instance for ``task``, retrying transient failures.

        Raises:
            ProvisionError: permanent failure, or the attempts or the total
                budget ran out; ``transient`` says which.
        """
        p = self._config.provisioning
        budget = self._config.timeouts.provision_total_s
        started = time.monotonic()
        attempt = 0
        last: BaseException | None = None
        emit_retry = retry_emitter(self._events)

        def decision(exc: BaseException) -> Decision:
            verdict = classify(exc, retry_instance_limit=p.retry_instance_limit)
            return Decision(verdict.transient, verdict.status_code, verdict.retry_after_s)

        def report(retry: Retry) -> None:
            # The create-only event stays (a documented contract); fleet_retry too.
            self._events.emit(
                "fleet_make_retry",
                level="warn",
                attempt=retry.attempt,
                error_type=type(retry.error).__name__,
                error_message=str(retry.error)[:500],
                status_code=retry.decision.status_code,
                retry_delay_s=round(retry.delay_s, 3),
            )
            emit_retry(retry)

        ticket: Ticket | None = None
        # One idempotency key for the create's attempts (the direct path): an
        # attempt sent again after an unknown outcome recovers what the first made.
        request_id = new_request_id()
        try:
            with fail_after(budget) as scope:
                ticket = await self._admit(task)
                async for retry in retrying.attempts(
                    "make",
                    self._config.provisioning.budget,
                    deadline=scope.deadline,
                    classify=decision,
                    report=report,
                ):
                    with retry:
                        attempt = retry.num
                        forget_retry_after()
                        try:
                            env = await self._create_admitted(task, run_id, ticket, request_id)
                        except Exception as exc:
                            last = exc
                            if isinstance(exc, fleet_errors.FleetConflictError):
                                # Its instance did not come up: the next is a new request.
                                request_id = new_request_id()
                            raise
        except EnvUnavailableError:
            raise
        except anyio.get_cancelled_exc_class():
            self._give_back(ticket)
            raise
        except Exception as exc:
            self._give_back(ticket)
            waited = ticket is None and self._admission is not None
            raise provisioning_failed(
                self._events,
                task,
                exc,
                last,
                attempt,
                provisioning=p,
                timeouts=self._config.timeouts,
                waited_for_admission=waited,
            ) from exc
        if ticket is not None and self._admission is not None:
            self._admission.started(ticket)
            self._tickets[env.instance_id] = ticket
        self.heartbeats.hold(env)
        self._live.add(env.instance_id)
        if self._config.modalities[task.modality].browser_lease:
            try:
                await self._lease_browser(env, task, attempt)
            except anyio.get_cancelled_exc_class():  # nobody will hold it: released now
                await self.release(Instance(env.instance_id, attempt, 0.0, started, env))
                raise
        elapsed = time.monotonic() - started
        self._events.emit(
            "fleet_provisioning_completed",
            provisioning_time_s=round(elapsed, 4),
            attempts=attempt,
            instance_id=env.instance_id,
        )
        # The reference's name for the same moment (existing dashboards query it).
        self._events.emit(
            "fleet_env_created",
            provisioning_time_s=round(elapsed, 4),
            instance_id=env.instance_id,
            env_key=task.env_key,
        )
        return Instance(
            instance_id=env.instance_id,
            attempts=attempt,
            provision_s=elapsed,
            created_mono=time.monotonic(),
            handle=env,
        )

    def _give_back(self, ticket: Ticket | None) -> None:
        """The ticket's place back, unless a create its rollout left holds it
        (given back when that create ends)."""
        held = ticket is None or ticket in self._held_by_creates
        if not held and self._admission is not None:
            assert ticket is not None
            self._admission.release(ticket)

    async def _admit(self, task: TaskSpec) -> Ticket | None:
        """A place for the instance (waits for room); None without admission control.

        Raises:
            EnvUnavailableError: the environment version is quarantined (fail-fast mode).
        """
        admission = self._admission
        if admission is None:
            return None
        if not self._account_read and self._config.account_limit:
            async with self._account_lock:  # every create waits for the limit, read once
                if not self._account_read:
                    await self._read_account()
                    self._account_read = True
        return await admission.acquire(task.env_spec)

    async def _read_account(self) -> None:
        """Fleet's account instance limit, into admission; unknown if it cannot be read."""
        assert self._admission is not None
        with anyio.move_on_after(self._config.timeouts.provision_create_s):
            try:
                account = await self.fleet.account()
            except Exception as exc:  # no limit known: a 403 will teach it
                _log.warning("could not read Fleet's account limit: %s", type(exc).__name__)
                return
            self._admission.learn_account(account.instance_limit, account.instance_count)

    async def _create_admitted(
        self, task: TaskSpec, run_id: str | None, ticket: Ticket | None, request_id: str
    ) -> FleetEnv:
        """One create; a 403 ``instance_limit_exceeded`` queues again for a place
        (admission learns the limit) instead of failing the attempt, and so does a
        429 when the gate learns the rate (it waits out Retry-After, slows down)."""
        while True:
            try:
                return await self._create_once(task, run_id, request_id, ticket)
            except fleet_errors.FleetRateLimitError as exc:
                if not self._gate.adaptive:
                    raise
                self._queued_again(exc, 429, classify(exc).retry_after_s or 0.0)
            except fleet_errors.FleetInstanceLimitError as exc:
                if ticket is None or self._admission is None:
                    raise
                self._queued_again(exc, 403, 0.0)
                await self._admission.limit_reached(
                    ticket, exc.instance_limit, exc.running_instances
                )

    def _queued_again(self, exc: Exception, status: int, delay_s: float) -> None:
        """A create that queues again (no attempt spent) is still a ``fleet_make_retry``."""
        self._events.emit(
            "fleet_make_retry",
            level="warn",
            attempt=0,
            error_type=type(exc).__name__,
            error_message=str(exc)[:500],
            status_code=status,
            retry_delay_s=delay_s,
        )

    async def _lease_browser(self, env: FleetEnv, task: TaskSpec, attempts: int) -> None:
        """Lease a browser for ``env`` (``timeouts.browser_lease_s`` in all). On
        failure the lease and the instance are given back.

        Raises:
            ProvisionError: the lease could not be set up.
        """
        t = self._config.timeouts
        ttl_s = task.ttl_seconds or self._config.modalities[task.modality].ttl_s
        try:
            with fail_after(t.browser_lease_s):
                assert env.urls is not None
                ui = env.urls.app[0] if env.urls.app else env.urls.root
                lease = await create_lease(
                    self.fleet, env.instance_id, ui, ttl_s=ttl_s, release_s=t.release_s
                )
        except Exception as exc:
            why = (
                f"no answer within {t.browser_lease_s:g} s"
                if isinstance(exc, TimeoutError)
                else exc
            )
            await self._close(env)
            ticket = self._tickets.pop(env.instance_id, None)
            if ticket is not None and self._admission is not None:
                self._admission.release(ticket)
            self._events.emit(
                "fleet_make_failed",
                level="error",
                attempt=attempts,
                error_type=type(exc).__name__,
                error_message=f"browser lease: {why}"[:500],
                status_code=getattr(exc, "status_code", None),
            )
            raise ProvisionError(
                f"the browser lease for {task.env_spec} could not be set up: {why}",
                transient=classify(exc).transient,
                status_code=getattr(exc, "status_code", None),
                attempts=attempts,
            ) from exc
        self._leases[env.instance_id] = lease

    async def _delete_lease(self, lease_id: str, instance_id: str) -> bool:
        """Give a browser lease back; shielded and bounded, never raises."""
        timeout = self._config.timeouts.release_s
        error = await delete_lease(self.fleet, lease_id, timeout_s=timeout)
        if error is not None:
            self._events.emit(
                "fleet_instance_release_failed",
                level="error",
                instance_id=instance_id,
                error_message=f"browser lease {lease_id}: {error}"[:500],
            )
        return error is None

    async def _create_once(
        self, task: TaskSpec, run_id: str | None, request_id: str, ticket: Ticket | None
    ) -> FleetEnv:
        """One create request (within its create slot) and a running instance out of it.

        In :meth:`start`'s task group when there is one: a cancel of the caller
        then leaves a request already sent to end there (:meth:`_run_create`).
        """
        modality = self._config.modalities[task.modality]
        create_timeout = self._config.timeouts.provision_create_s
        made: dict[str, Any] = {
            "data_key": task.data_spec,
            "region": self._config.provisioning.region,
            "env_variables": task.env_variables or None,
            "image_type": modality.image_type,
            "ttl_seconds": task.ttl_seconds or modality.ttl_s,
            "run_id": run_id,
            "heartbeat_interval": self.heartbeats.interval,
        }

        async def make() -> FleetEnv:
            with fail_after(create_timeout):
                env = await self._control.make(
                    task.env_spec, **made, create_timeout_s=create_timeout, request_id=request_id
                )
            return env

        tg = self._background
        create = _Create(ticket, run_id)
        if tg is None:  # no task group of ours: in the caller's task, cut by its cancel
            await self._run_create(create, make)
        else:
            self._creates.add(create)
            tg.start_soon(self._run_create, create, make)
            try:
                await create.done.wait()
            except anyio.get_cancelled_exc_class():
                self._abandon(create, tg, "cancelled")
                raise
        if create.error is not None:
            raise create.error
        assert create.env is not None
        return create.env

    async def _run_create(self, create: _Create, make: Callable[[], Awaitable[FleetEnv]]) -> None:
        """Send the create (once its slot is free), then make sure what it made runs.

        The outcome goes to ``create`` (its ``env`` or ``error``); if its rollout
        left meanwhile, what it made is released and its place given back here.
        """
        try:
            with create.scope:
                async with self._gate.slot(read_create_error):
                    create.sent, create.began = True, time.monotonic()
                    try:
                        create.env = await make()
                    except Exception as exc:
                        create.unanswered = _no_answer(exc)
                        raise
                    except anyio.get_cancelled_exc_class():
                        create.unanswered = True  # sent, then cut: Fleet may make it
                        raise
                # Held from now on: no sweep takes it before its rollout does.
                self._live.add(create.env.instance_id)
                await self._share_runner_token(create.env)
                if create.env.status != "running" or create.env.urls is None:
                    # Not usable: give it back before trying again.
                    env, create.env = create.env, None
                    await self._close(env)
                    raise fleet_errors.FleetEnvironmentError(
                        f"instance {env.instance_id} came up {env.status!r}, not running"
                    )
        except Exception as exc:  # the caller's to raise
            create.error = exc
            if create.env is not None:  # made, then something failed: not handed out
                env, create.env = create.env, None
                await self._close(env)
        except anyio.get_cancelled_exc_class():
            if create in self._creates:  # our task group closes under it
                create.cut = True
                create.error = ProvisionError(
                    "the pool closed while the instance's create was in flight",
                    transient=False,
                    attempts=0,
                )
                create.abandoned = create.abandoned or "closing"
            elif create.env is not None:  # a bare provider's caller, cancelled
                with anyio.CancelScope(shield=True):
                    await self._close(create.env)
            raise
        finally:
            create.done.set()
            if create.abandoned is None:
                self._ended(create)
            else:
                await self._end_abandoned(create)

    def _ended(self, create: _Create) -> None:
        self._creates.discard(create)
        tag = create.run_id
        if create.unanswered and tag is not None:
            self._unanswered.add(tag)
        if tag in self._sweep_later and not self._in_flight(tag):
            # Its batch's sweep ran before this create ended: sweep again now.
            self._sweep_later.discard(tag)
            if tag in self._unanswered and self._background is not None:
                self._background.start_soon(self._sweep_unanswered, tag)
        if self._create_ended is not None:
            self._create_ended.set()

    def _in_flight(self, tag: str) -> bool:
        return any(create.run_id == tag for create in self._creates)

    async def _sweep_unanswered(self, tag: str) -> None:
        self._unanswered.discard(tag)
        await self._sweep([tag], f"sweep of {tag} (a create without an answer)")

    def _abandon(self, create: _Create, tg: TaskGroup, why: str) -> None:
        """The rollout waiting for ``create`` left: a create not sent yet is called
        off; one sent runs to its end, which releases what it made."""
        if not create.sent:
            create.scope.cancel()
            return
        create.abandoned = why
        if create.ticket is not None:
            self._held_by_creates.add(create.ticket)
        if create.done.is_set():  # answered, but its rollout left before it took it
            self._creates.add(create)
            tg.start_soon(self._end_abandoned, create)

    async def _end_abandoned(self, create: _Create) -> None:
        """Release what a create its rollout left made, give its place back, and
        say so (``fleet_create_abandoned``). Shielded; bounded by the release."""
        with anyio.CancelScope(shield=True):
            try:
                await self._give_back_abandoned(create)
            finally:
                self._ended(create)

    async def _give_back_abandoned(self, create: _Create) -> None:
        env, create.env = create.env, None
        outcome = "cut" if create.cut else "failed"
        if env is not None:
            self.heartbeats.drop(env.instance_id)
            self._live.discard(env.instance_id)
            instance = Instance(env.instance_id, 0, 0.0, time.monotonic(), env)
            outcome = "released" if await self._release(instance) else "release_failed"
            # Tried again by the sweep of its tag (at the latest as the background closes).
            create.unanswered = create.unanswered or outcome == "release_failed"
        ticket = create.ticket
        if ticket is not None:
            self._held_by_creates.discard(ticket)
            if self._admission is not None:
                self._admission.release(ticket)
        error = create.error if env is None else None
        self._events.emit(
            "fleet_create_abandoned",
            level="info" if outcome in ("released", "failed") else "warn",
            instance_id=None if env is None else env.instance_id,
            run_id=create.run_id,
            reason=create.abandoned,
            outcome=outcome,
            create_s=round(time.monotonic() - create.began, 4),
            error_type=None if error is None else type(error).__name__,
            error_message=None if error is None else str(error)[:500],
        )

    async def _share_runner_token(self, env: FleetEnv) -> None:
        """The instance-router token, resolved once (bounded) for every instance."""
        if not getattr(self._runner_tokens, "_resolved", False):  # resolved: nothing to wait for
            with anyio.move_on_after(self._config.timeouts.mcp_connect_s):
                await self._control.runner_token()
        self._control.adopt(env)

    async def is_alive(self, instance: Instance) -> bool:
        """Whether Fleet still reports the instance running.

        Used to tell "the instance died" from "a call failed". When the control
        plane cannot be asked in time, the instance is presumed alive.
        """
        with anyio.move_on_after(min(10.0, self._config.timeouts.release_s)):
            try:
                current = await self._control.instance(instance.instance_id)
            except fleet_errors.FleetAPIError as exc:
                return bool(exc.status_code != 404)  # 404: gone; anything else: presume alive
            except Exception:
                return True
            return bool(current.status == "running")
        return True

    async def release(self, instance: Instance, *, reuse: bool = False) -> bool:
        """Delete the instance; shielded from cancellation and bounded in time.

        Returns whether Fleet confirmed the release (a 404 counts: it is gone).
        Never raises. Its admission place is given back either way. (``reuse``
        is decided around this provider: :mod:`fleetroll.environments.fleet.warm`.)
        """
        self.heartbeats.drop(instance.instance_id)
        self._live.discard(instance.instance_id)
        try:
            return await self._release(instance)
        finally:
            ticket = self._tickets.pop(instance.instance_id, None)
            if ticket is not None and self._admission is not None:
                self._admission.release(ticket)

    async def _release(self, instance: Instance) -> bool:
        lease = self._leases.pop(instance.instance_id, None)
        if lease is not None:  # the browser first: it shows the instance
            await self._delete_lease(lease.lease_id, instance.instance_id)
        timeout = self._config.timeouts.release_s
        error: str | None = None
        error_type = "TimeoutError"
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout) as scope:
            try:
                await self._env(instance).close()
            except fleet_errors.FleetAPIError as exc:
                if exc.status_code != 404:  # 404: it is gone already, as asked
                    error, error_type = f"{type(exc).__name__}: {exc}", type(exc).__name__
            except Exception as exc:  # a failed release is reported, never raised
                error, error_type = f"{type(exc).__name__}: {exc}", type(exc).__name__
        if scope.cancelled_caught:
            error, error_type = f"release timed out after {timeout:g} s", "TimeoutError"
        lifetime = round(time.monotonic() - instance.created_mono, 3)
        if error is None:
            self._events.emit(
                "fleet_instance_released", instance_id=instance.instance_id, lifetime_s=lifetime
            )
            return True
        self._events.emit(
            "fleet_instance_release_failed",
            level="error",
            instance_id=instance.instance_id,
            lifetime_s=lifetime,
            error_message=error[:500],
        )
        # The reference's event, only when the instance is really still there.
        with anyio.CancelScope(shield=True):
            still_there = await self.is_alive(instance)
        if still_there:
            self._events.emit(
                "fleet_env_close_failed",
                level="error",
                instance_id=instance.instance_id,
                error_type=error_type,
                error_message=error[:500],
            )
        return False

    async def sweep(self, run_id: str) -> int:
        """Release every running instance tagged with ``run_id`` that this provider
        does not hold (a live rollout's); never raises.

        Instances nobody knows about end up there: a create whose answer never
        came back (our deadline fired first), or those of a worker that died.
        A create of ``run_id`` still in flight (its rollout left it) is swept
        after again when it ends without an answer. Returns how many were released.
        """
        if self._in_flight(run_id):
            self._sweep_later.add(run_id)
        else:
            self._unanswered.discard(run_id)  # this sweep comes after all of them
        return len(await self._sweep([run_id], f"sweep of {run_id}"))

    async def collect_unanswered(self) -> list[str]:
        """Sweep every tag with a create that got no answer since its last sweep,
        once no create is in flight (the provider's background closed); never
        raises. Returns the ids released.

        Such a create may have made an instance whose id never came back (its
        answer came after our deadline, or the pool closed under it): nothing
        else would release it. What cannot be released is reported
        (``fleet_instance_release_failed``).
        """
        tags = sorted(self._unanswered)
        self._unanswered.clear()
        self._sweep_later.clear()
        if not tags:
            return []
        return await self._sweep(tags, "collecting the instances of creates without an answer")

    async def collect(self, run_id: str) -> list[str]:
        """Release the running instances of ``run_id`` and of every tag under it
        (``run_id-…``: a service's batches, a Ray actor's) that this provider does
        not hold; never raises. Returns the ids released.

        A process's start-up (``run --resume``, ``serve``) and ``fleetroll gc``:
        what a killed process of the same run id left behind.
        """
        with anyio.move_on_after(self._config.timeouts.release_s):
            try:
                runs = await self.fleet.list_runs(status="active")
            except Exception as exc:  # best effort: report it
                self._events.emit(
                    "fleet_instance_release_failed",
                    level="warn",
                    error_message=f"listing the runs of {run_id} failed: {exc}"[:500],
                )
                return []
            mine = (r.run_id for r in runs)
            tags = [tag for tag in mine if tag == run_id or tag.startswith(f"{run_id}-")]
            return await self._sweep(sorted(tags), f"collecting {run_id}")
        return []

    async def _sweep(self, tags: Sequence[str], what: str) -> list[str]:
        """Release the instances of ``tags`` this provider does not hold (shielded,
        ``timeouts.release_s`` twice at most); what is left is reported, never raised."""
        released: list[str] = []
        limit = self._config.timeouts.release_s * 2
        orphans: list[AsyncEnv] = []
        listed = False
        with anyio.CancelScope(shield=True), anyio.move_on_after(limit) as scope:
            try:
                for tag in tags:
                    # Starting ones too: Fleet goes on making what a create began.
                    for status in _SWEPT_STATUSES:
                        orphans += await self.fleet.instances(status=status, run_id=tag)
            except Exception as exc:  # best effort: report it
                self._events.emit(
                    "fleet_instance_release_failed",
                    level="warn",
                    error_message=f"{what} failed: {exc}"[:500],
                )
                return released
            listed = True
            for env in orphans:
                if env.instance_id in self._live:
                    continue  # a live rollout's (or a warm instance's)
                try:
                    await env.close()
                except Exception as exc:  # best effort, per instance
                    self._events.emit(
                        "fleet_instance_release_failed",
                        level="warn",
                        instance_id=env.instance_id,
                        error_message=str(exc)[:500],
                    )
                    continue
                released.append(env.instance_id)
                self._events.emit(
                    "fleet_instance_released", instance_id=env.instance_id, orphan=True
                )
        if scope.cancelled_caught:  # out of time: say what may be left running
            why = f"{what} ran out of its {limit:g} s (timeouts.release_s twice)"
            if not listed:
                self._events.emit(
                    "fleet_instance_release_failed",
                    level="error",
                    error_message=f"{why} listing the instances of {', '.join(tags)}"[:500],
                )
            for env in orphans:
                if env.instance_id not in self._live and env.instance_id not in released:
                    self._events.emit(
                        "fleet_instance_release_failed",
                        level="error",
                        instance_id=env.instance_id,
                        error_message=why[:500],
                    )
        return released

    async def _close(self, env: FleetEnv) -> None:
        self.heartbeats.drop(env.instance_id)
        self._live.discard(env.instance_id)
        timeout = self._config.timeouts.release_s
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            try:
                await env.close()
            except Exception as exc:  # best effort; the instance was unusable anyway
                self._events.emit(
                    "fleet_instance_release_failed",
                    level="error",
                    instance_id=env.instance_id,
                    error_message=str(exc)[:500],
                )
