"""The in-flight controller (pure): Little's law from the measured round trip and rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.pipeline.inflight import GAIN, InFlight, target_in_flight


def test_unknown_measurements_give_the_floor() -> None:
    assert target_in_flight(None, None, floor=4, ceiling=32) == 4
    assert target_in_flight(10.0, None, floor=4, ceiling=32) == 4
    assert target_in_flight(float("nan"), 0.3, floor=4, ceiling=32) == 4
    assert InFlight(floor=4, ceiling=32).target == 4


def test_the_bandwidth_delay_product_with_headroom() -> None:
    # 30 microbatches/s over a 0.3 s round trip: 9 in the pipe, 1.25x plus a step of 4
    assert target_in_flight(30.0, 0.3, floor=4, ceiling=64) == math.ceil(GAIN * 9) + 4
    assert target_in_flight(30.0, 0.3, floor=4, ceiling=10) == 10
    assert target_in_flight(30.0, 0.3, floor=4, ceiling=2) == 2  # the ceiling wins


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        target_in_flight(1.0, 1.0, floor=0, ceiling=4)
    with pytest.raises(ValueError):
        InFlight(floor=4, ceiling=0)


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True,
       allow_infinity=True), st.integers(1, 64), st.integers(1, 64))
def test_the_target_always_lies_within_its_bounds(rate: float, rtt: float, floor: int,
                                                  ceiling: int) -> None:
    n = target_in_flight(rate, rtt, floor=floor, ceiling=ceiling)
    assert min(floor, ceiling) <= n <= ceiling


def _simulate(window: InFlight, *, rtt: float, capacity: float, rounds: int) -> list[int]:
    """A pipeline with an unloaded round trip ``rtt`` whose slowest stage serves
    ``capacity`` microbatches per second: n in flight complete at min(n / rtt, capacity)
    per second, each after max(rtt, n / capacity) (Little's law)."""
    now, targets = 0.0, []
    for _ in range(rounds):
        n = window.target
        rate = min(n / rtt, capacity)
        life = max(rtt, n / capacity)
        for _ in range(n):
            now += 1.0 / rate
            window.completed(now, life)
        targets.append(window.target)
    return targets


def test_a_latency_bound_pipeline_fills_up_and_settles_above_its_product() -> None:
    window = InFlight(floor=4, ceiling=64)
    targets = _simulate(window, rtt=0.3, capacity=40.0, rounds=30)
    bdp = 0.3 * 40.0
    assert targets[-1] == targets[-2]  # settled
    assert bdp < targets[-1] <= math.ceil(GAIN * bdp) + 4 + 1
    assert window.round_trip_s == pytest.approx(0.3)


def test_a_compute_bound_pipeline_stays_near_the_floor() -> None:
    # already the floor queues (0.1 s round trips where 0.01 s would do): the shortest round
    # trip seen includes that queue, so the target settles at about (1 + GAIN) x the floor
    window = InFlight(floor=4, ceiling=64)
    targets = _simulate(window, rtt=0.01, capacity=40.0, rounds=20)
    assert targets[-1] == targets[-2] <= math.ceil((1 + GAIN) * 4) + 1


def test_fixed_pins_the_ceiling() -> None:
    window = InFlight(floor=4, ceiling=16, fixed=True)
    assert window.target == 16
    for i in range(11):
        window.completed(i * 0.1, 0.5)
    assert window.target == 16 and window.rate == pytest.approx(10.0)


def test_the_first_microbatches_coming_back_together_say_no_rate() -> None:
    window = InFlight(floor=4, ceiling=32)
    for _ in range(4):
        window.completed(1.0, 1.0)
    assert window.rate is None and window.target == 4


def test_a_burst_of_completions_is_not_taken_for_a_rate() -> None:
    """Ten a second, then eight processed at once (the compute thread was busy): the rate
    over the window stays near ten, and so does the target."""
    window = InFlight(floor=4, ceiling=64)
    now = 0.0
    for _ in range(20):
        now += 0.1
        window.completed(now, 0.3)
    for _ in range(8):
        window.completed(now + 1e-4, 0.3)
    assert window.rate is not None and window.rate < 20.0
    assert window.target <= 4 + 2.0 * 20.0 * 0.3 + 1


def test_a_latency_bound_pipeline_fills_within_a_few_round_trips() -> None:
    window = InFlight(floor=4, ceiling=64)
    targets = _simulate(window, rtt=0.3, capacity=40.0, rounds=6)
    assert max(targets[:4]) > 0.3 * 40.0  # past the bandwidth-delay product in 4 rounds


def test_busy_lowers_the_target_which_grows_back() -> None:
    window = InFlight(floor=4, ceiling=32, fixed=False)
    window.rate, window.round_trip_s = 100.0, 0.5  # a target at the ceiling
    assert window.target == 32
    window.busy(20)
    assert window.target == 15
    for i in range(15):  # one window's worth of completions: one more
        window.completed(float(i), 10.0)
    assert window.target == 16
    for i in range(16):
        window.completed(float(15 + i), 10.0)
    assert window.target == 17


def test_busy_lowers_the_target_below_a_steps_microbatches() -> None:
    """64 microbatches a step against one stage-0 peer that queues 16 and keeps 32 per
    trainer: with the step as a floor under busy, the trainer kept 64 out and drew 800
    refusals in 10 steps; now it backs off below the step (the step still takes 64)."""
    window = InFlight(floor=64, ceiling=256)
    window.rate, window.round_trip_s = 100.0, 0.5
    window.busy(40)
    assert window.target == 30
    window.busy(2)
    assert window.target == 1  # never none
    window.busy(0)
    assert window.target == 1


@given(st.integers(1, 64), st.integers(1, 64), st.booleans(), st.integers(0, 80))
def test_a_step_opens_with_the_ceiling_under_any_busy_cap(floor: int, ceiling: int,
                                                          fixed: bool, busy_at: int) -> None:
    # before its first microbatch comes back a synchronous step has nothing to pace on and
    # stage 0 only forwards: it opens with as many as it may have out, never past a busy cap
    window = InFlight(floor=min(floor, ceiling), ceiling=ceiling, fixed=fixed)
    window.rate, window.round_trip_s = 30.0, 0.4
    assert window.opening == ceiling >= window.target
    window.busy(busy_at)
    assert window.opening >= window.target if fixed else (
        window.opening == min(window.cap or ceiling, ceiling) >= window.target)
