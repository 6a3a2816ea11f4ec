"""Provisioning: the one retry policy, its classifier, limits and release."""

from __future__ import annotations

import anyio
import httpx
import pytest
from fleet._async import exceptions as fe

from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.environments.fleet.provider import FleetProvider, TokenBucket, classify
from fleetroll.errors import ProvisionError
from fleetroll.pool.assembly import fleet_provider
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Events, MemorySink

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

TASK = TaskSpec(key="t", prompt="p", env_key="ledger", env_version="v1", data_key="seed")
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05}


def api_error(status: int | None, body: object = None) -> fe.FleetAPIError:
    return fe.FleetAPIError("boom", status_code=status, response_data=body)  # type: ignore[arg-type]


CASES = [
    # (exception the SDK can raise from make, transient?)
    (fe.FleetAuthenticationError("bad key"), False),
    (fe.FleetPermissionError("no"), False),
    (fe.FleetEnvironmentAccessError("no access to 'x'", env_key="x"), False),
    (fe.FleetTeamNotFoundError("team not found"), False),
    (fe.FleetBadRequestError("bad"), False),
    (fe.FleetRegionError("Region mars not supported"), False),
    (fe.FleetEnvironmentNotFoundError("Environment 'x' not found", env_key="x"), False),
    (fe.FleetVersionNotFoundError("Version 'v9' not found"), False),
    (fe.FleetConfigurationError("no"), False),
    (fe.FleetInstanceLimitError("limit", running_instances=5, instance_limit=5), False),
    (fe.FleetRateLimitError("slow down"), True),
    (fe.FleetTimeoutError("Request timed out"), True),
    (fe.FleetEnvironmentError("health check failed"), True),
    (fe.FleetConflictError("duplicate", instance_id="abc"), True),
    (fe.FleetConflictError("already exists 'x'"), False),
    (api_error(500), True),
    (api_error(502), True),
    (api_error(503), True),
    (api_error(504), True),
    (api_error(None), True),  # the SDK's wrapper of connection errors
    (api_error(404), False),
    (api_error(422), False),
    (api_error(500, {"detail": {"message": "no", "retryable": False}}), False),
    (api_error(400, {"detail": {"message": "burst cap", "retryable": True}}), True),
    (fe.FleetError("Burst limit hit, please try again"), True),
    (fe.FleetError("malformed request"), False),
    (TimeoutError(), True),
    (httpx.ConnectError("refused"), True),
    (ValueError("Provide api_key, provide jwt/team_id, or run `flt login`"), False),
]


@pytest.mark.parametrize(
    ("exc", "transient"),
    CASES,
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_every_error_the_sdk_can_raise_is_classified(exc: BaseException, transient: bool) -> None:
    assert classify(exc).transient is transient


def test_the_instance_limit_is_transient_only_when_configured() -> None:
    exc = fe.FleetInstanceLimitError("limit")
    assert classify(exc, retry_instance_limit=True).transient
    assert classify(exc).status_code == 403


async def provider(emu: Emulator, sink: MemorySink, **provisioning: object) -> FleetProvider:
    settings = load_settings(provisioning={**FAST, **provisioning})
    return fleet_provider(settings, Events([sink]), api_key=emu.api_key, base_url=emu.base_url)


async def test_retry_after_from_a_429_sets_the_backoff() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_create_429=1.0, retry_after_s=0.05)) as emu:
        # At a fixed create rate a 429 is a failed attempt (the learnt rate's
        # gate answers it instead: tests/test_create_rate.py).
        p = await provider(emu, sink, max_attempts=2, adaptive_creates=False)
        with pytest.raises(ProvisionError) as err:
            await p.provision(TASK)
        await p.aclose()
    retry = sink.named("fleet_make_retry")[0].attributes
    assert retry["retry_delay_s"] == 0.05 and retry["status_code"] == 429
    assert err.value.transient and err.value.status_code == 429 and err.value.attempts == 2
    # The same retry, as every operation reports one.
    (same,) = sink.named("fleet_retry")
    assert same.attributes["operation"] == "make" and same.attributes["attempt"] == 1
    assert same.attributes["retry_delay_s"] == 0.05 and same.attributes["status_code"] == 429


async def test_the_sdks_own_retries_are_off_so_one_attempt_is_one_request() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_create_5xx=1.0)) as emu:
        p = await provider(emu, sink, max_attempts=3)
        with pytest.raises(ProvisionError):
            await p.provision(TASK)
        await p.aclose()
        assert sum(emu.ledger.creates_by_outcome.values()) == 3


async def test_transient_failures_are_retried_until_a_create_succeeds() -> None:
    sink = MemorySink()
    # Seeded: the first creates fail, a later one succeeds.
    async with Emulator(FaultProfile(seed=3, p_create_5xx=0.6)) as emu:
        p = await provider(emu, sink, max_attempts=20)
        made = await p.provision(TASK)
        assert made.attempts == len(sink.named("fleet_make_retry")) + 1
        assert await p.release(made)
        await p.aclose()
        assert emu.ledger.running == 0


async def test_the_total_budget_bounds_provisioning() -> None:
    async with Emulator(FaultProfile(create_latency=Latency(min_s=3600))) as emu:
        settings = load_settings(timeouts={"provision_total_s": 0.3})
        p = fleet_provider(settings, Events(), api_key=emu.api_key, base_url=emu.base_url)
        with anyio.fail_after(10), pytest.raises(ProvisionError) as err:
            await p.provision(TASK)
        await p.aclose()
    assert "budget" in str(err.value) and err.value.transient


async def test_concurrent_creates_are_limited_apart_from_rollouts() -> None:
    async with Emulator(FaultProfile(create_latency=Latency(min_s=0.05))) as emu:
        p = await provider(emu, MemorySink(), max_concurrent_creates=2, creates_per_second=1000)
        made = []

        async def one() -> None:
            made.append(await p.provision(TASK))

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(one)
        assert emu.ledger.peak_concurrent_creates == 2 and emu.ledger.running == 8
        for m in made:
            await p.release(m)
        await p.aclose()
        assert emu.ledger.running == 0


async def test_the_token_bucket_lets_a_burst_through_then_holds() -> None:
    bucket = TokenBucket(rate=1 / 3600, burst=3)
    with anyio.fail_after(5):
        for _ in range(3):
            await bucket.acquire()
    with anyio.move_on_after(0.2) as scope:
        await bucket.acquire()
    assert scope.cancelled_caught


async def test_release_is_shielded_from_cancellation() -> None:
    sink = MemorySink()
    async with Emulator() as emu:
        p = await provider(emu, sink)
        made = await p.provision(TASK)
        with anyio.CancelScope() as scope:
            scope.cancel()
            assert await p.release(made)
        await p.aclose()
        assert emu.ledger.running == 0
    assert sink.named("fleet_instance_released")[0].attributes["instance_id"] == made.instance_id


async def test_releasing_an_instance_that_is_already_gone_is_fine() -> None:
    async with Emulator() as emu:
        p = await provider(emu, MemorySink())
        made = await p.provision(TASK)
        await p.fleet.delete(made.instance_id)  # gone before the release
        assert await p.release(made)
        await p.aclose()


async def test_error_messages_never_carry_the_api_key() -> None:
    sink = MemorySink()
    secret = "sk-live-0123456789abcdef"
    async with Emulator(api_key="the-right-one") as emu:
        settings = load_settings(provisioning=FAST)
        from fleetroll.telemetry import Redactor

        p = fleet_provider(
            settings, Events([sink], Redactor([secret])), api_key=secret, base_url=emu.base_url
        )
        with pytest.raises(ProvisionError) as err:
            await p.provision(TASK)
        await p.aclose()
    assert secret not in str(err.value)
    assert all(secret not in str(e.attributes) for e in sink.events)


async def test_a_create_that_never_answers_says_which_deadline_it_passed() -> None:
    async with Emulator(FaultProfile(p_create_hang=1.0, create_hang_s=30.0)) as emu:
        settings = load_settings(
            provisioning={**FAST, "max_attempts": 2}, timeouts={"provision_create_s": 0.2}
        )
        p = fleet_provider(settings, Events(), api_key=emu.api_key, base_url=emu.base_url)
        with pytest.raises(ProvisionError) as err:
            await p.provision(TASK)
        await p.aclose()
    assert "no answer within 0.2 s (timeouts.provision_create_s)" in str(err.value)
    assert err.value.transient and err.value.attempts == 2
