"""The learnt create rate: AIMD over Fleet's answers (fleetroll.environments.admission.creates,
Fleet's answers read by fleetroll.environments.fleet.admission)."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
from fleet._async import exceptions as fe

from fleetroll.environments.admission import (
    AdmissionController,
    CreateAnswer,
    CreateLimits,
    CreateSlots,
)
from fleetroll.environments.fleet.admission import read_create_error
from fleetroll.settings import load_settings
from fleetroll.telemetry import Events, MemorySink

LIMITS = CreateLimits(
    max_in_flight=32,
    max_per_second=8.0,
    adaptive=True,
    start_in_flight=4,
    start_per_second=2.0,
    min_per_second=0.1,
    slow_s=60.0,
    backoff_s=0.01,
)
FAST = CreateAnswer(0.1)


def test_a_window_of_fast_answers_doubles_the_rate_until_the_first_pressure_then_adds() -> None:
    sink = MemorySink()
    gate = CreateSlots(LIMITS, Events([sink]))
    for _ in range(4):  # one window (4 in flight) of fast answers
        gate.learn(FAST)
    assert (gate.state().per_second, gate.state().in_flight_limit) == (4.0, 8)
    gate.learn(CreateAnswer(0.1, "timeout"))  # the first pressure halves at once
    assert (gate.state().per_second, gate.state().in_flight_limit) == (2.0, 4)
    for _ in range(4):  # after it: additive increase
        gate.learn(FAST)
    assert (gate.state().per_second, gate.state().in_flight_limit) == (3.0, 5)
    reasons = [e.attributes["reason"] for e in sink.named("fleet_create_rate")]
    assert reasons == ["fast_answers", "timeout", "fast_answers"]


def test_the_ceilings_and_the_floor_bound_the_learnt_rate() -> None:
    gate = CreateSlots(LIMITS)
    for _ in range(200):
        gate.learn(FAST)
    assert (gate.state().per_second, gate.state().in_flight_limit) == (8.0, 32)
    for _ in range(200):
        gate.learn(CreateAnswer(0.1, "throttled", 0.0))
    assert (gate.state().per_second, gate.state().in_flight_limit) == (0.1, 1)


def test_a_stray_pressure_changes_little_and_sustained_pressure_halves_the_rate() -> None:
    limits = dataclasses.replace(LIMITS, max_per_second=100.0)

    def after(windows: int, pressured_each: int) -> tuple[float, float]:
        gate = CreateSlots(limits)
        gate.learn(CreateAnswer(0.1, "timeout"))  # ends the slow start
        for _ in range(20):  # additive increase, window by window
            for _ in range(gate.state().in_flight_limit):
                gate.learn(FAST)
        before = gate.state().per_second
        for _ in range(windows):
            for i in range(gate.state().in_flight_limit):
                gate.learn(CreateAnswer(0.1, "unavailable", 0.0) if i < pressured_each else FAST)
        return before, gate.state().per_second

    before, stray = after(windows=1, pressured_each=1)
    assert abs(stray - before) < 0.05 * before  # one 503 in a window of 22
    before, sustained = after(windows=3, pressured_each=1000)
    assert sustained < before / 2


def test_a_fixed_rate_gate_learns_nothing_but_still_honours_retry_after() -> None:
    fixed = CreateLimits(max_in_flight=3, max_per_second=5.0)
    gate = CreateSlots(fixed)
    for answer in (FAST, FAST, FAST, CreateAnswer(0.1, "throttled", 0.0)):
        gate.learn(answer)
    assert (gate.state().per_second, gate.state().in_flight_limit) == (5.0, 3)
    assert not gate.adaptive


def test_the_instance_cap_bounds_the_creates_in_flight() -> None:
    gate = CreateSlots(LIMITS)
    gate.cap(2)
    assert gate.state().in_flight_limit == 2
    gate.cap(None)
    assert gate.state().in_flight_limit == 4


def test_the_account_limit_caps_the_creates_in_flight_through_admission() -> None:
    settings = load_settings(provisioning={"start_concurrent_creates": 16})
    admission = AdmissionController(
        settings.admission, CreateLimits.from_settings(settings.provisioning), Events()
    )
    admission.learn_account(instance_limit=3, instance_count=0)
    assert admission.state().creates_in_flight_limit == 3


def test_without_a_start_of_their_own_the_learner_starts_at_a_quarter_of_the_ceilings() -> None:
    settings = load_settings(provisioning={"creates_per_second": 8.0, "max_concurrent_creates": 32})
    limits = CreateLimits.from_settings(settings.provisioning)
    state = AdmissionController(settings.admission, limits, Events()).state()
    assert (state.creates_per_second, state.creates_in_flight_limit) == (2.0, 8)


async def test_retry_after_holds_every_create_until_it_passed() -> None:
    gate = CreateSlots(LIMITS)
    async with gate.slot(read_create_error):
        pass
    gate.learn(CreateAnswer(0.1, "throttled", 3600.0))
    with anyio.move_on_after(0.2) as scope:
        async with gate.slot(read_create_error):
            pass
    assert scope.cancelled_caught


async def test_a_slot_reads_the_answer_of_the_create_it_held() -> None:
    sink = MemorySink()
    gate = CreateSlots(LIMITS, Events([sink]))
    with pytest.raises(fe.FleetRateLimitError):
        async with gate.slot(read_create_error):
            raise fe.FleetRateLimitError("slow down")
    [event] = sink.named("fleet_create_rate")
    assert event.attributes["reason"] == "throttled"
    assert gate.state() == gate.state().__class__(1.0, 2, 0)


@pytest.mark.parametrize(
    ("exc", "pressure", "neutral"),
    [
        (None, None, False),
        (fe.FleetRateLimitError("slow down"), "throttled", False),
        (fe.FleetAPIError("busy", status_code=503), "unavailable", False),
        (fe.FleetAPIError("gateway", status_code=504), "timeout", False),
        (TimeoutError(), "timeout", False),
        (fe.FleetTimeoutError("timed out"), "timeout", False),
        (fe.FleetBadRequestError("bad"), None, True),
        (fe.FleetInstanceLimitError("limit"), None, True),
        (fe.FleetAPIError("boom", status_code=500), None, True),
    ],
)
def test_what_each_answer_says_of_fleets_load(
    exc: BaseException | None, pressure: str | None, neutral: bool
) -> None:
    answer = CreateAnswer.of(exc, 1.0, slow_s=60.0, read=read_create_error)
    assert (answer.pressure, answer.neutral) == (pressure, neutral)


def test_a_success_slower_than_slow_create_s_is_pressure() -> None:
    assert CreateAnswer.of(None, 61.0, slow_s=60.0, read=read_create_error).pressure == "slow"


async def test_a_slot_learns_what_any_provider_s_reader_says_of_its_error() -> None:
    def read(exc: Exception, elapsed_s: float) -> CreateAnswer:  # a provider of its own
        return CreateAnswer(elapsed_s, "throttled", 0.0)

    gate = CreateSlots(LIMITS)
    with pytest.raises(ValueError):
        async with gate.slot(read):
            raise ValueError("this provider's way of saying 429")
    assert gate.state().per_second == LIMITS.start_per_second / 2
