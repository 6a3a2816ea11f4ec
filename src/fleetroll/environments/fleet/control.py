"""Talking to Fleet's control plane, apart from an instance's life: what a failure
means, browser leases, and the pre-flight listing.

Used by :class:`fleetroll.environments.fleet.provider.FleetProvider`, which owns the SDK
clients; nothing here holds state but the Retry-After of the last error answer
(a context variable set by an HTTP response hook, since the SDK's exceptions do
not carry headers).
"""

from __future__ import annotations

import contextvars
import math
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import anyio
import httpx
from fleet._async import exceptions as fleet_errors
from fleet._async.client import AsyncFleet

import fleetroll._internal.retrying as retrying
from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.http_transport import SdkAiohttpTransport
from fleetroll._internal.preflight_cache import PreflightCache
from fleetroll._internal.proxies import Proxies
from fleetroll._internal.retrying import Decision, Report, decide, retry_after_s, transient_status
from fleetroll.errors import ProvisionError
from fleetroll.settings import ProvisioningSettings, TimeoutSettings
from fleetroll.tasks import TaskSpec
from fleetroll.tasks.names import missing_environments
from fleetroll.telemetry.events import Events

__all__ = [
    "Classification",
    "Known",
    "Lease",
    "classify",
    "create_lease",
    "delete_lease",
    "forget_retry_after",
    "listing_problems",
    "provisioning_failed",
    "remember_retry_after",
    "remember_retry_after_of",
    "sdk_lanes",
]

_retry_after: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "fleetroll_retry_after", default=None
)


@dataclass(frozen=True, slots=True)
class Classification:
    """What one failed create means for the next attempt."""

    transient: bool
    status_code: int | None = None
    retry_after_s: float | None = None


_PERMANENT_TYPES: tuple[type[Exception], ...] = (
    fleet_errors.FleetAuthenticationError,
    fleet_errors.FleetPermissionError,  # includes environment access, team not found
    fleet_errors.FleetBadRequestError,  # includes region, env and version not found
    fleet_errors.FleetConfigurationError,
)
_TRANSIENT_TEXT = (
    "retryable",
    "try again",
    "temporarily",
    "timed out",
    "timeout",
    "unavailable",
    "overloaded",
    "rate limit",
)


def classify(exc: BaseException, *, retry_instance_limit: bool = False) -> Classification:
    """Decide whether a failed create is worth another attempt.

    Order: our own deadline, the SDK's exception type, the HTTP status, a
    structured ``retryable`` flag in the body, and only then the message text.
    """
    retry_after = _retry_after.get()
    status: int | None = getattr(exc, "status_code", None)
    if isinstance(exc, TimeoutError | fleet_errors.FleetTimeoutError):
        return Classification(True, status)
    if isinstance(exc, fleet_errors.FleetRateLimitError):
        return Classification(True, 429, retry_after)
    if isinstance(exc, fleet_errors.FleetInstanceLimitError):
        return Classification(retry_instance_limit, 403, retry_after)
    if isinstance(exc, fleet_errors.FleetConflictError):
        # A duplicate-create 409 that the SDK could not recover: a new request may work.
        return Classification(exc.instance_id is not None, 409)
    if isinstance(exc, _PERMANENT_TYPES):
        return Classification(False, status)
    if isinstance(exc, fleet_errors.FleetEnvironmentError):  # health / readiness failures
        return Classification(True, status)
    if isinstance(exc, fleet_errors.FleetAPIError):
        body = getattr(exc, "response_data", None) or {}
        detail = body.get("detail") if isinstance(body, dict) else None
        flag = detail.get("retryable") if isinstance(detail, dict) else None
        if isinstance(flag, bool):
            return Classification(flag, status, retry_after)
        if status is None:  # the SDK's wrapper of transport errors (connection refused...)
            return Classification(True, None)
        if transient_status(status):
            return Classification(True, status, retry_after)
        if 400 <= status < 500:
            return Classification(False, status)
    if decide(exc).transient:  # transport failures of the HTTP clients
        return Classification(True, None)
    text = str(exc).lower()
    return Classification(any(word in text for word in _TRANSIENT_TEXT), status, retry_after)


def provisioning_failed(
    events: Events,
    task: TaskSpec,
    exc: Exception,
    last: BaseException | None,
    attempt: int,
    *,
    provisioning: ProvisioningSettings,
    timeouts: TimeoutSettings,
    waited_for_admission: bool,
) -> ProvisionError:
    """The error a failed provisioning raises, after ``fleet_make_failed``.

    ``exc`` ended it; ``last`` is the last attempt's error, the cause when the
    total budget ran out; ``waited_for_admission``: it never got a place.
    """
    p = provisioning
    budget = timeouts.provision_total_s
    p_create_s = timeouts.provision_create_s
    failure = last if isinstance(exc, TimeoutError) and last is not None else exc
    verdict = classify(failure, retry_instance_limit=p.retry_instance_limit)
    if isinstance(exc, TimeoutError) and waited_for_admission:
        message = (
            f"provisioning {task.env_spec} waited its whole {budget:g} s budget "
            "for admission (instance limits, or the environment's breaker)"
        )
    elif isinstance(exc, TimeoutError) and exc is not last:
        message = (
            f"provisioning {task.env_spec} ran out of its "
            f"{budget:g} s budget after {attempt} attempt(s)"
        )
    else:
        why = f"{type(failure).__name__}: {failure}"
        if isinstance(failure, TimeoutError) and not str(failure):
            why = f"no answer within {p_create_s:g} s (timeouts.provision_create_s)"
        message = f"provisioning {task.env_spec} failed after {attempt} attempt(s): {why}"
    events.emit(
        "fleet_make_failed",
        level="error",
        attempt=attempt,
        error_type=type(failure).__name__,
        error_message=str(failure)[:500],
        status_code=verdict.status_code,
    )
    return ProvisionError(
        message,
        transient=verdict.transient,
        status_code=verdict.status_code,
        retry_after_s=verdict.retry_after_s,
        attempts=attempt,
    )


async def remember_retry_after(response: httpx.Response) -> None:
    """An httpx response hook: keep the Retry-After of an error answer for :func:`classify`."""
    if response.status_code >= 400:
        remember_retry_after_of(response.headers)


def remember_retry_after_of(headers: Mapping[str, str]) -> None:
    """Keep an error answer's Retry-After (its headers) for :func:`classify`."""
    _retry_after.set(retry_after_s(headers))


def forget_retry_after() -> None:
    """Before a new attempt: the last answer's Retry-After no longer applies."""
    _retry_after.set(None)


# -- the SDK's clients -------------------------------------------------------------

#: Connections one SDK client (a "lane") keeps; more instances get more lanes.
_CONNECTIONS_PER_LANE = 64


def sdk_lanes(
    provisioning: ProvisioningSettings,
    timeouts: TimeoutSettings,
    *,
    concurrency: int,
    api_key: str,
    base_url: str | None,
    tls: ssl.SSLContext | None = None,
    proxies: Proxies | None = None,
) -> tuple[list[httpx.AsyncClient], list[AsyncFleet]]:
    """The SDK clients a provider spreads its instances over, and their HTTP clients.

    Several small HTTP clients ("lanes") instead of one big one: httpcore
    scanned every connection of a pool on each request, so one pool of
    hundreds of connections made the control plane cost grow with the
    square of concurrency. Each lane now sends over aiohttp
    (:class:`fleetroll._internal.http_transport.SdkAiohttpTransport`), whose pool does
    not scan; the lanes stay, as a bound on connections per client. An
    instance stays on the lane that made it (reset, verify, delete). The
    SDK's own retries are off (``max_retries=0``): every retry is decided
    once, by fleetroll. ``concurrency`` is the pool's (``pool.concurrency``): the
    instances held at once, besides those being created.
    """
    t = timeouts
    held = concurrency + provisioning.max_concurrent_creates
    lanes = max(1, math.ceil(held / _CONNECTIONS_PER_LANE))
    # One TLS context for every lane (the caller's, if given): building one costs
    # ~50 ms of CPU (loading the CA bundle), a second and a half at 1,000 rollouts.
    tls = tls or httpx.create_ssl_context()
    proxies = Proxies.from_environment() if proxies is None else proxies
    clients = [
        httpx.AsyncClient(
            timeout=httpx.Timeout(t.provision_create_s, connect=t.mcp_connect_s),
            transport=SdkAiohttpTransport(
                verify=tls,
                keepalive_s=t.http_keepalive_s,
                max_connections=_CONNECTIONS_PER_LANE * 2,
                proxies=proxies,
            ),
            event_hooks={"response": [remember_retry_after]},
        )
        for _ in range(lanes)
    ]
    fleets = [
        AsyncFleet(api_key=api_key, base_url=base_url, max_retries=0, httpx_client=client)
        for client in clients
    ]
    return clients, fleets


# -- browser leases (browser_use's lease flow) ---------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    """A browser leased for one instance."""

    lease_id: str
    mcp_url: str


async def create_lease(
    fleet: AsyncFleet, instance_id: str, ui: str, *, ttl_s: float, release_s: float
) -> Lease:
    """Lease a browser for the instance: create it, navigate it to the environment's
    UI (``ui``), check its health. A lease made before a later step failed is given
    back (shielded, bounded by the caller's scope) before the error goes on.

    The caller bounds the whole with its own deadline.
    """
    client = fleet.client
    made = await client.request(
        "POST", "/v1/browser/leases", json={"instance_id": instance_id, "ttl_seconds": ttl_s}
    )
    body = made.json()
    lease = Lease(str(body["lease_id"]), str(body["mcp_url"]))
    try:
        path = f"/v1/browser/leases/{lease.lease_id}"
        await client.request("POST", f"{path}/navigate", json={"url": ui})
        await client.request("GET", f"{path}/health")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await delete_lease(fleet, lease.lease_id, timeout_s=release_s)
        raise
    return lease


async def delete_lease(fleet: AsyncFleet, lease_id: str, *, timeout_s: float) -> str | None:
    """Give a browser lease back; shielded and bounded, never raises.

    Returns:
        Why it could not be deleted, or None (a lease gone already counts as deleted).
    """
    error: str | None = None
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s) as scope:
        try:
            await fleet.client.request("DELETE", f"/v1/browser/leases/{lease_id}")
        except fleet_errors.FleetAPIError as exc:
            if exc.status_code != 404:  # 404: gone already
                error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # reported, never raised
            error = f"{type(exc).__name__}: {exc}"
    if scope.cancelled_caught:
        error = f"timed out after {timeout_s:g} s"
    return error


# -- pre-flight ------------------------------------------------------------------


async def listing_problems(
    fleet: AsyncFleet,
    tasks: Sequence[TaskSpec],
    *,
    timeout_s: float,
    budget: retrying.Budget,
    where: str,
    report: Report,
    cache: PreflightCache[Known] | None = None,
) -> list[str]:
    """The control plane answers, the key is accepted, every env version exists.

    One environment listing (``GET /v1/env/``), under ``timeout_s``
    (``timeouts.preflight_s``); a 429 or 5xx answer is asked again (``budget``:
    ``provisioning.budget``) within that time, while an address that does not
    answer is reported at once.

    With a ``cache``, a listing fetched within its time to live is used
    instead, unless it lacks something the tasks name (then it is fetched
    again: a version published since is found, a typo costs one listing).
    """
    if cache is None:
        known = await _listing(fleet, timeout_s, budget, where=where, report=report)
        return known if isinstance(known, list) else missing_environments(tasks, known)
    key = f"listing {where}"
    async with cache.lock(key):
        kept = cache.get(key)
        if kept is not None and not missing_environments(tasks, kept):
            return []
        known = await _listing(fleet, timeout_s, budget, where=where, report=report)
        if isinstance(known, list):
            return known
        cache.put(key, known)
    return missing_environments(tasks, known)


#: Each environment key of a listing, with its versions (and what its tags name).
Known = dict[str, set[str]]


async def _listing(
    fleet: AsyncFleet, timeout_s: float, budget: retrying.Budget, *, where: str, report: Report
) -> Known | list[str]:
    """The environment listing as :data:`Known`, or the problem lines of not getting it."""
    timeout = timeout_s

    def decision(exc: BaseException) -> Decision:
        verdict = classify(exc)
        busy = verdict.status_code is not None and transient_status(verdict.status_code)
        return Decision(busy, verdict.status_code, verdict.retry_after_s)

    try:
        with fail_after(timeout) as scope:
            async for attempt in retrying.attempts(
                "preflight",
                budget,
                deadline=scope.deadline,
                classify=decision,
                report=report,
            ):
                with attempt:
                    listing = await fleet.list_envs()
    except TimeoutError:
        return [
            f"the Fleet control plane at {where} did not answer within {timeout:g} s"
            " (timeouts.preflight_s; is FLEET_BASE_URL right?)"
        ]
    except fleet_errors.FleetAuthenticationError:
        return [f"FLEET_API_KEY was refused by the Fleet control plane at {where} (401)"]
    except fleet_errors.FleetAPIError as exc:
        status = exc.status_code
        if status in (401, 403):
            return [f"FLEET_API_KEY was refused by the Fleet control plane at {where} ({status})"]
        if status is None:
            return [
                f"cannot reach a Fleet control plane at {where}: {exc} (is FLEET_BASE_URL right?)"
            ]
        return [
            f"{where} answered {status} to the environment listing (GET /v1/env/):"
            " not a Fleet control plane? (is FLEET_BASE_URL right?)"
        ]
    except (ValueError, TypeError) as exc:  # not JSON, or not a list of environments
        return [
            f"{where} does not answer like a Fleet control plane"
            f" ({type(exc).__name__} reading its environment listing;"
            " is FLEET_BASE_URL right?)"
        ]
    except httpx.HTTPError as exc:
        return [
            f"cannot reach a Fleet control plane at {where}: {type(exc).__name__}: {exc}"
            " (is FLEET_BASE_URL right?)"
        ]
    return {env.env_key: {*env.versions, *env.versions.values()} for env in listing}
