"""The control client: how :class:`~fleetroll.environments.fleet.provider.FleetProvider`
makes instances and asks after them, one protocol over two ways of talking to
Fleet's control plane (``provisioning.control_client``).

* ``"direct"``: :class:`~fleetroll.environments.fleet.direct.DirectControl`
  itself (the benchmarked hot path: no adapter in between, its instances are
  :class:`~fleetroll.environments.fleet.direct.DirectEnv`);
* ``"sdk"``: :class:`SdkControl`, over the SDK's ``AsyncFleet`` lanes (its
  instances are the SDK's ``AsyncEnv``).

The provider chooses one when it is built (:func:`control_client`) and never
asks which it holds. Listing, the account, runs, leases and sweeps stay on
the SDK either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import anyio
from fleet._async.client import AsyncEnv, AsyncFleet
from fleet.runner_auth import RunnerTokenProvider

from fleetroll._internal.wire import Wire
from fleetroll.environments.fleet.direct import DirectControl, FleetEnv

__all__ = ["ControlClient", "SdkControl", "control_client"]


class ControlClient(Protocol):
    """An instance's control-plane calls the provider makes (its life's other
    calls, reset, verify, heartbeat and close, are the instance handle's own)."""

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
    ) -> FleetEnv:
        """Create an instance (``AsyncFleet.make``'s request), under the caller's deadline.

        ``request_id`` is the create's idempotency key where the client sends
        one (the direct client; the SDK makes its own per call).
        """
        ...

    async def instance(self, instance_id: str) -> FleetEnv:
        """One instance as the control plane reports it now (``AsyncFleet.instance``)."""
        ...

    async def runner_token(self) -> str | None:
        """Resolve the instance-router token once, into the shared
        ``RunnerTokenProvider`` (a failure is remembered too)."""
        ...

    def adopt(self, env: FleetEnv) -> None:
        """Give a new instance what every instance shares (the runner-token provider)."""
        ...

    def env_of(self, handle: object) -> FleetEnv:
        """An :class:`~fleetroll.environments.provider.Instance`'s handle, as this
        client's instance (it is one of this provider's)."""
        ...


class SdkControl:
    """The control client over the SDK: creates spread over its lanes
    (:func:`~fleetroll.environments.fleet.control.sdk_lanes`; an instance stays
    on the lane that made it), its ``AsyncEnv`` handles sharing one runner-token
    provider."""

    def __init__(self, lanes: Sequence[AsyncFleet], runner_tokens: RunnerTokenProvider) -> None:
        self._lane = itertools.cycle(lanes)
        self._fleet = lanes[0]
        self._runner_tokens = runner_tokens
        self._runner_lock = anyio.Lock()

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
    ) -> AsyncEnv:
        """``AsyncFleet.make`` on the next lane (``request_id`` unused: the SDK makes its own)."""
        return await next(self._lane).make(
            env_key,
            data_key=data_key,
            region=region,
            env_variables=env_variables,
            image_type=image_type,
            ttl_seconds=ttl_seconds,
            run_id=run_id,
            heartbeat_interval=heartbeat_interval,
            timeout=create_timeout_s,
        )

    async def instance(self, instance_id: str) -> AsyncEnv:
        return await self._fleet.instance(instance_id)

    async def runner_token(self) -> str | None:
        async with self._runner_lock:
            token: str | None = await self._runner_tokens.token_async()
            return token

    def adopt(self, env: FleetEnv) -> None:
        assert isinstance(env, AsyncEnv)
        env._runner_token_provider = self._runner_tokens

    def env_of(self, handle: object) -> AsyncEnv:
        assert isinstance(handle, AsyncEnv), "an instance of another provider"
        return handle


def control_client(
    kind: Literal["direct", "sdk"],
    *,
    lanes: Sequence[AsyncFleet],
    runner_tokens: RunnerTokenProvider,
    wire: Wire | None,
) -> ControlClient:
    """The control client ``provisioning.control_client`` names: the direct one
    sends over ``wire`` (required then) with the first lane's credentials."""
    if kind == "direct":
        assert wire is not None, "the direct control client sends over a Wire"
        return DirectControl(wire, lanes[0].client, runner_tokens)
    return SdkControl(lanes, runner_tokens)
