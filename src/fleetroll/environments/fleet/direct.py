"""A rollout's control-plane calls without the SDK's layers (``provisioning.control_client``).

Per rollout the SDK builds pydantic models, ``AsyncEnv`` objects and their
clients, and sends through httpx; :class:`DirectControl` sends the same
requests over one shared :class:`~fleetroll._internal.wire.Wire` and keeps
what the hot path needs in a :class:`DirectEnv`. Only the hot path: create
(``POST /v1/env/instances``, with the SDK's duplicate-create recovery),
reset, the verifier's bundle check and execution, heartbeat, one instance's
status, release. Listing, account, runs, leases and sweeps stay on the SDK.

The contract is the SDK's (``tests/environments/test_fleet_direct.py`` checks
it against the emulator's request log):

* the same method, URL, JSON body and headers that matter: the SDK's
  identification and credentials on control-plane calls (read once from the
  SDK's own wrapper), an ``X-Request-ID`` per create, none of them on an
  instance's routes but its runner token;
* the same exceptions: an error answer goes through the SDK's own
  ``_handle_error_response`` (so :func:`~fleetroll.environments.fleet.control.classify`
  and admission see the SDK's typed errors and statuses, with the answer's
  Retry-After remembered), a request that got no answer is the SDK's
  ``FleetAPIError("Request failed: ...")``, and an answer of an unexpected
  shape is parsed by the SDK's model (which raises what it raises);
* one difference on purpose: a create keeps its request id across the
  provider's attempts (the SDK makes one per call), so an attempt sent again
  after an unknown outcome (a deadline, a broken connection) is answered 409
  ``duplicate_request_id`` and recovers the instance the first one made
  instead of leaving it to run unseen; the provider takes a new id after a
  409 (the old one points at an instance that did not come up).

Secrets: the API key is in the headers only; no error message holds headers.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
import cloudpickle
import httpx
from fleet import runner_auth
from fleet._async import exceptions as fleet_errors
from fleet._async.base import AsyncWrapper
from fleet._async.client import (
    DUPLICATE_RECOVERY_MIN_BUDGET_S,
    DUPLICATE_RECOVERY_POLL_INTERVAL_S,
    AsyncEnv,
)
from fleet.config import CREATE_MAX_WAIT_MARGIN_S, GLOBAL_BASE_URL, REGION_BASE_URL
from fleet.instance.models import ResetResponse
from fleet.models import InstanceResponse, VerifiersCheckResponse, VerifiersExecuteResponse
from fleet.runner_auth import RUNNER_TOKEN_HEADER, RunnerTokenProvider

from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.wire import ProxyError, Response, Wire, WireError
from fleetroll.environments.fleet.control import remember_retry_after_of

__all__ = ["DirectControl", "DirectEnv", "DirectUrls", "FleetEnv", "new_request_id"]

_log = logging.getLogger(__name__)

_JSON = "application/json"
#: What the SDK's instance client sends to an instance's routes (its own fixed version).
_INSTANCE_HEADERS = {"X-Fleet-SDK-Language": "Python", "X-Fleet-SDK-Version": "1.0.0"}
#: Control-plane answers are small; a verifier's is bounded by its stdout.
_MAX_ANSWER_BYTES = 64 * 2**20


def new_request_id() -> str:
    """A create's idempotency key (``X-Request-ID``), as the SDK makes one."""
    return str(uuid.uuid4())


@dataclass(frozen=True, slots=True)
class DirectUrls:
    """The instance's addresses the hot path uses (``urls`` of the SDK's answer)."""

    root: str
    app: list[str]
    #: The instance manager's API (``urls.manager.api``): reset is under it.
    manager: str


@dataclass(frozen=True, slots=True)
class Reset:
    """A reset's answer (the SDK's ``ResetResponse``)."""

    success: bool
    message: str


@dataclass(frozen=True, slots=True)
class Checked:
    """A bundle check's answer (the SDK's ``VerifiersCheckResponse``)."""

    success: bool


@dataclass(frozen=True, slots=True)
class Executed:
    """A verifier execution's answer: what the verifier's caller reads of the SDK's."""

    success: bool
    result: Any = None
    execution_id: str | None = None
    stdout: str | None = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class DirectEnv:
    """One instance, as the hot path needs it (in place of the SDK's ``AsyncEnv``).

    Its methods are the ``AsyncEnv`` ones the provider, the heartbeats and the
    SDK's verifier function call, with the same requests.
    """

    instance_id: str
    env_key: str
    version: str
    status: str
    urls: DirectUrls | None
    heartbeat_interval: int | None
    heartbeat_region: str | None
    control: DirectControl

    async def reset(self, seed: int | None = None, timestamp: int | None = None) -> Reset:
        return await self.control.reset(self, seed=seed, timestamp=timestamp)

    async def close(self) -> None:
        await self.control.delete(self.instance_id)

    async def heartbeat(self) -> None:
        body = {"region": self.heartbeat_region} if self.heartbeat_region else {}
        await self.control.call(
            "POST", f"/v1/env/instances/{self.instance_id}/heartbeat", body=body
        )

    async def check_bundle_exists(self, bundle_hash: str) -> Checked | Any:
        return await self.control.check_bundle(bundle_hash)

    async def execute_verifier_remote(
        self,
        bundle_data: bytes,
        bundle_sha: str,
        key: str,
        function_name: str,
        args: tuple[Any, ...],
        args_array: list[Any],
        kwargs: dict[str, Any],
        timeout: int | None = 30,  # noqa: ASYNC109  # the SDK's name: the verifier's own limit
        needs_upload: bool = True,
        verifier_runtime_version: str | None = None,
    ) -> Executed | Any:
        # The request of the SDK's _execute_verifier_remote, field for field.
        pickled = cloudpickle.dumps({"args": (None, *args), "kwargs": kwargs})
        request: dict[str, Any] = {
            "key": key,
            "sha256": bundle_sha,
            "args": base64.b64encode(pickled).decode("utf-8"),
            "args_array": args_array,
            "function_name": function_name,
            "timeout": timeout,
            "region": "us-west-1",
        }
        if needs_upload:
            request["bundle"] = base64.b64encode(bundle_data).decode("utf-8")
        if verifier_runtime_version:
            request["verifier_runtime_version"] = verifier_runtime_version
        return await self.control.execute(request)


#: An instance's handle: the SDK's object, or the direct path's.
FleetEnv: TypeAlias = AsyncEnv | DirectEnv


def _dumps(body: Any) -> bytes:
    """JSON as httpx encodes a ``json=`` body."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _version(part: str) -> str:
    """``1`` → ``v1``, as the SDK normalises an env or data version."""
    return f"v{part}" if part and not part.startswith("v") and part[0].isdigit() else part


def _split_key(key: str | None) -> tuple[str | None, str | None]:
    if key is not None and ":" in key:
        name, version = key.split(":", 1)
        return name, _version(version)
    return key, None


class DirectControl:
    """The hot path's control-plane calls over one shared :class:`Wire`.

    Args:
        wire: the connection pool (the caller owns and closes it).
        sdk: the SDK's control-plane wrapper of the same account: its base URL
            and its headers (identification, credentials), read once.
        runner_tokens: the instance-router token, resolved once and shared.
    """

    def __init__(self, wire: Wire, sdk: AsyncWrapper, runner_tokens: RunnerTokenProvider) -> None:
        self._wire = wire
        self._base = str(sdk.base_url)
        self._global = self._base == GLOBAL_BASE_URL
        fixed = sdk.get_headers()
        fixed.pop("X-Request-Timestamp", None)
        self._headers: dict[str, str] = fixed
        self._runner_tokens = runner_tokens
        self._runner_lock = anyio.Lock()

    def _control_headers(self, request_id: str | None, body: bool) -> dict[str, str]:
        headers = dict(self._headers)
        # Every control-plane request carries an id, as the SDK's do.
        headers["X-Request-ID"] = request_id or new_request_id()
        headers["X-Request-Timestamp"] = str(int(time.time() * 1000))
        if body:
            headers["Content-Type"] = _JSON
        return headers

    async def _send(
        self,
        method: str,
        url: str,
        body: Any,
        headers: dict[str, str],
        *,
        idempotent: bool = False,
    ) -> Response:
        data = None if body is None else _dumps(body)
        try:
            return await self._wire.request(
                method,
                url,
                body=data,
                headers=headers,
                max_bytes=_MAX_ANSWER_BYTES,
                idempotent=idempotent,
            )
        except ProxyError as exc:
            # A refused tunnel (407, 403) is a setting to fix, not a network
            # blip; a 5xx (the proxy could not reach Fleet) may pass.
            detail = {"detail": {"retryable": exc.transient}}
            raise fleet_errors.FleetAPIError(
                f"Request failed: {exc}", response_data=detail
            ) from exc
        except WireError as exc:  # the SDK's wrapper of httpx.RequestError
            raise fleet_errors.FleetAPIError(f"Request failed: {exc}") from exc

    async def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        request_id: str | None = None,
        base: str | None = None,
    ) -> Any:
        """One control-plane request; its JSON answer.

        Raises:
            FleetAPIError: (and its subclasses) as the SDK raises them: the
                answer's status, or no answer (``status_code`` None).
        """
        headers = self._control_headers(request_id, body is not None)
        # Only a request with the caller's own id (a create) may go twice: Fleet
        # answers a repeated id with the first one's outcome. The ids made here
        # for other calls are the SDK's tracing ids, not idempotency keys.
        response = await self._send(
            method, f"{base or self._base}{path}", body, headers, idempotent=request_id is not None
        )
        if response.status >= 400:
            _raise_as_the_sdk(response)
        return response.json()

    # -- the calls ------------------------------------------------------------

    async def make(
        self,
        env_key: str,
        *,
        data_key: str | None,
        region: str | None,
        env_variables: Mapping[str, Any] | None,
        image_type: str | None,
        ttl_seconds: float | None,
        run_id: str | None,
        heartbeat_interval: int | None,
        create_timeout_s: float,
        request_id: str,
    ) -> DirectEnv:
        """``AsyncFleet.make`` (its request), under the caller's deadline.

        Raises:
            FleetConflictError: a duplicate create whose instance did not come up.
            FleetTimeoutError: a duplicate create's instance was still starting
                when the create's budget ran out.
        """
        env_name, env_version = _split_key(env_key)
        data_name, data_version = _split_key(data_key)
        fields = {
            "env_key": env_name,
            "env_version": env_version,
            "data_key": data_name,
            "data_version": data_version,
            "region": region,
            "env_variables": dict(env_variables) if env_variables else env_variables,
            "image_type": image_type,
            "created_from": "sdk",
            "ttl_seconds": None if ttl_seconds is None else int(ttl_seconds),
            "run_id": run_id,
            "heartbeat_interval": heartbeat_interval,
            # As the SDK: the server waits a little less than the client does.
            "max_wait_seconds": min(max(int(create_timeout_s) - CREATE_MAX_WAIT_MARGIN_S, 0), 3600),
        }
        body = {k: v for k, v in fields.items() if v is not None}
        base = REGION_BASE_URL.get(region) if region and self._global else None
        started = time.monotonic()
        try:
            answer = await self.call(
                "POST", "/v1/env/instances", body=body, request_id=request_id, base=base
            )
        except fleet_errors.FleetConflictError as exc:
            if not exc.instance_id:
                raise
            remaining = create_timeout_s - (time.monotonic() - started)
            return await self._recover_duplicate(exc.instance_id, remaining)
        return self._env(answer)

    async def _recover_duplicate(self, instance_id: str, budget_s: float) -> DirectEnv:
        """The SDK's ``_recover_duplicate_create``: running → it; error or
        stopped → a conflict (a new request may work); starting → asked again."""
        deadline = time.monotonic() + max(budget_s, DUPLICATE_RECOVERY_MIN_BUDGET_S)
        while True:
            env = await self.instance(instance_id)
            if env.status == "running":
                _log.warning(
                    "Create request was already processed; recovered running instance %s",
                    instance_id,
                )
                return env
            if env.status in ("error", "stopped"):
                raise fleet_errors.FleetConflictError(
                    f"Duplicate create request points at instance '{instance_id}' in state "
                    f"'{env.status}': the original attempt did not produce a usable "
                    "environment. Retry the create as a new request.",
                    instance_id=instance_id,
                )
            if time.monotonic() >= deadline:
                raise fleet_errors.FleetTimeoutError(
                    f"Instance '{instance_id}' recovered from a duplicate create request "
                    f"was still '{env.status}' when the create budget ran out."
                )
            await anyio.sleep(DUPLICATE_RECOVERY_POLL_INTERVAL_S)

    async def instance(self, instance_id: str) -> DirectEnv:
        """``GET /v1/env/instances/{id}`` (``AsyncFleet.instance``)."""
        return self._env(await self.call("GET", f"/v1/env/instances/{instance_id}"))

    async def delete(self, instance_id: str) -> None:
        """``DELETE /v1/env/instances/{id}`` (``AsyncEnv.close``)."""
        await self.call("DELETE", f"/v1/env/instances/{instance_id}")

    async def reset(
        self, env: DirectEnv, *, seed: int | None = None, timestamp: int | None = None
    ) -> Reset:
        """``POST {manager}/reset`` (``AsyncEnv.reset(seed, timestamp)``: its
        ``ResetRequest``, both fields always sent, null when not given).

        An error answer is not raised as a status, as with the SDK's instance
        client: its body is read as a reset answer (which fails to parse).
        """
        assert env.urls is not None
        headers = dict(_INSTANCE_HEADERS)
        token = await self.runner_token()
        if token:
            headers[RUNNER_TOKEN_HEADER] = token
        headers["Content-Type"] = _JSON
        body = {"timestamp": timestamp, "seed": seed}  # ResetRequest's order
        url = f"{env.urls.manager}/reset"
        data = _dumps(body)
        response = await self._wire.request(
            "POST", url, body=data, headers=headers, max_bytes=_MAX_ANSWER_BYTES
        )
        answer = response.json()
        if (
            isinstance(answer, dict)
            and isinstance(answer.get("success"), bool)
            and isinstance(answer.get("message"), str)
        ):
            return Reset(answer["success"], answer["message"])
        return ResetResponse(**answer)  # type: ignore[no-any-return]  # raises as the SDK does

    def adopt(self, env: FleetEnv) -> None:
        """Nothing to hand on: a :class:`DirectEnv` reads the shared token through its control."""

    def env_of(self, handle: object) -> DirectEnv:
        """An instance's handle, as a :class:`DirectEnv` (one this control made)."""
        assert isinstance(handle, DirectEnv), "an instance of another provider"
        return handle

    async def runner_token(self) -> str | None:
        """The instance-router token: ``RunnerTokenProvider.token_async`` over the
        Wire (the same GET; no HTTP client and TLS set-up of its own), resolved
        once under one lock, its answer (a failure too) remembered in the SDK's
        provider, which the rest of the provider reads."""
        tokens = self._runner_tokens
        if tokens._resolved:  # the SDK remembers the answer, a failure too
            return tokens._token  # type: ignore[no-any-return]
        async with self._runner_lock:
            if not tokens._resolved:  # not while this waited for the lock
                tokens._token, tokens._resolved = await self._fetch_runner_token(), True
        return tokens._token  # type: ignore[no-any-return]

    async def _fetch_runner_token(self) -> str | None:
        tokens = self._runner_tokens
        token: str | None = runner_auth._token_from_env()
        endpoint, headers = tokens._endpoint(), tokens._headers()
        if token is None and endpoint and headers:
            try:
                with fail_after(runner_auth._FETCH_TIMEOUT):
                    response = await self._wire.request("GET", endpoint, headers=headers)
                if response.status == 200:
                    token = runner_auth._token_from_payload(response.json())
            except Exception:  # as the SDK: no token, remembered
                token = None
        return token

    async def check_bundle(self, sha256: str) -> Checked | Any:
        """``GET /v1/verifiers/check?sha256=`` (``AsyncEnv.check_bundle_exists``)."""
        answer = await self.call("GET", f"/v1/verifiers/check?sha256={sha256}")
        if isinstance(answer, dict) and isinstance(answer.get("success"), bool):
            return Checked(answer["success"])
        return VerifiersCheckResponse(**answer)

    async def execute(self, request: dict[str, Any]) -> Executed | Any:
        """``POST /v1/verifiers/execute`` (``AsyncEnv.execute_verifier_remote``)."""
        answer = await self.call("POST", "/v1/verifiers/execute", body=request)
        if isinstance(answer, dict) and isinstance(answer.get("success"), bool):
            error = answer.get("error")
            stdout = answer.get("stdout")
            execution_id = answer.get("execution_id")
            if (
                (error is None or isinstance(error, dict))
                and (stdout is None or isinstance(stdout, str))
                and (execution_id is None or isinstance(execution_id, str))
            ):
                return Executed(
                    answer["success"], answer.get("result"), execution_id, stdout, error
                )
        return VerifiersExecuteResponse(**answer)

    def _env(self, answer: Any) -> DirectEnv:
        """A :class:`DirectEnv` of an instance answer; one of another shape is
        parsed by the SDK's model (which raises what it raises)."""
        try:
            urls = answer.get("urls")
            env = DirectEnv(
                instance_id=str(answer["instance_id"]),
                env_key=str(answer["env_key"]),
                version=str(answer["version"]),
                status=str(answer["status"]),
                urls=None
                if urls is None
                else DirectUrls(str(urls["root"]), list(urls["app"]), str(urls["manager"]["api"])),
                heartbeat_interval=answer.get("heartbeat_interval"),
                heartbeat_region=answer.get("heartbeat_region"),
                control=self,
            )
        except (AttributeError, KeyError, TypeError):
            InstanceResponse(**answer)  # the SDK's error for this answer
            raise
        return env


def _raise_as_the_sdk(response: Response) -> None:
    """Raise the SDK's exception for an error answer (its own code decides), with
    the answer's Retry-After remembered for :func:`classify`."""
    remember_retry_after_of(response.headers)
    # Only error answers take this path: the SDK's classification, whole.
    as_httpx = httpx.Response(response.status, headers=response.headers, content=response.body)
    AsyncWrapper._handle_error_response(None, as_httpx)  # raises
    raise AssertionError("unreachable: the SDK raises for every error status")
