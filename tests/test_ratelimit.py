"""transport.ratelimit.TokenBucket: a pure byte-rate bucket, time passed in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.ratelimit import MIN_BURST_BYTES, TokenBucket, default_burst


def test_a_full_bucket_grants_its_burst_at_once_then_makes_callers_wait():
    b = TokenBucket(1000, burst=500)
    assert b.take(500, now=10.0) == 0.0
    assert b.take(100, now=10.0) == pytest.approx(0.1)
    assert b.throttled_bytes == 100
    assert b.waited_s == pytest.approx(0.1)


def test_a_take_larger_than_the_burst_waits_for_the_difference():
    b = TokenBucket(1000, burst=500)
    assert b.take(3000, now=0.0) == pytest.approx(2.5)


def test_later_takes_wait_for_the_debt_of_earlier_ones():
    b = TokenBucket(1000, burst=100)
    b.take(100, now=0.0)
    first = b.take(1000, now=0.0)
    second = b.take(1000, now=0.0)
    assert first == pytest.approx(1.0)
    assert second == pytest.approx(2.0)


def test_refill_stops_at_the_burst():
    b = TokenBucket(1000, burst=200)
    b.take(200, now=0.0)
    assert b.available(now=100.0) == pytest.approx(200)
    assert b.take(200, now=100.0) == 0.0
    assert b.take(1, now=100.0) > 0


def test_a_clock_going_back_neither_refills_nor_returns_a_negative_wait():
    b = TokenBucket(1000, burst=100)
    b.take(100, now=5.0)
    wait = b.take(100, now=4.0)
    assert wait == pytest.approx(0.1)


def test_a_3_mb_send_at_1_mb_s_takes_about_2_s_of_bucket_time():
    b = TokenBucket(1_000_000)
    now, chunk, sent = 0.0, 1 << 20, 0
    while sent < 3_000_000:
        n = min(chunk, 3_000_000 - sent)
        now += b.take(n, now)
        sent += n
    assert now >= (3_000_000 - b.burst) / 1_000_000 - 1e-9
    assert b.started_at == 0.0 and b.paid_until == pytest.approx(now)
    assert b.granted_bytes == 3_000_000


@pytest.mark.parametrize("rate, burst", [(0, 10), (-1, 10), (float("nan"), 10),
                                         (float("inf"), 10), (10, 0), (10, -5), (10, 1.5)])
def test_bad_rates_and_bursts_are_refused(rate, burst):
    with pytest.raises(ValueError):
        TokenBucket(rate, burst=burst)


def test_a_negative_take_is_refused():
    with pytest.raises(ValueError):
        TokenBucket(10).take(-1, now=0.0)


def test_default_burst_is_a_quarter_second_but_never_tiny():
    assert default_burst(1_000_000) == 250_000
    assert default_burst(100) == MIN_BURST_BYTES


takes = st.lists(st.tuples(st.integers(min_value=0, max_value=5_000_000),  # bytes
                           st.floats(min_value=0.0, max_value=3.0)),  # gap before the take
                 min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(rate=st.floats(min_value=1.0, max_value=1e8), burst=st.integers(1, 10_000_000),
       seq=takes, waits=st.booleans())
def test_bytes_granted_by_any_time_never_exceed_burst_plus_rate_times_t(rate, burst, seq,
                                                                         waits):
    """Each take is granted at ``now + wait``; whether or not callers wait (``waits``: each
    caller waits out its reservation before the next take), the bytes granted by time t stay
    within burst + rate * t, and a caller that waited is granted (grants come in order)."""
    b = TokenBucket(rate, burst=burst)
    now = 0.0
    t0 = seq[0][1]  # the bucket's clock starts at its first take
    grants: list[tuple[float, int]] = []
    for n, gap in seq:
        now += gap
        wait = b.take(n, now)
        assert wait >= 0.0
        grants.append((now + wait, n))
        if waits:
            now += wait
    granted = 0
    previous = -1.0
    for at, n in grants:
        assert at >= previous - 1e-9  # first come, first served
        previous = at
        granted += n
        assert granted <= burst + rate * (at - t0) + 1e-6 * max(1.0, granted)
    assert b.granted_bytes == sum(n for n, _ in seq)
    assert b.started_at == t0
    assert b.paid_until == pytest.approx(max(at for at, _ in grants))
    assert b.granted_bytes <= burst + rate * (b.paid_until - t0) + 1e-6 * max(1.0, granted)
    # and over any window: what is granted after one grant and up to a later one fits in one
    # burst plus the rate times the time between them (the bucket never holds more than a burst)
    for i in range(len(grants)):
        after = 0
        for j in range(i + 1, len(grants)):
            after += grants[j][1]
            span = grants[j][0] - grants[i][0]
            assert after <= burst + rate * span + 1e-6 * max(1.0, after)


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(min_value=1.0, max_value=1e8), burst=st.integers(1, 10_000_000),
       n=st.integers(0, 10_000_000), later=st.floats(min_value=0.0, max_value=100.0))
def test_after_waiting_the_returned_time_the_debt_is_paid(rate, burst, n, later):
    b = TokenBucket(rate, burst=burst)
    wait = b.take(n, now=0.0)
    assert b.available(now=wait) >= -1e-6 * max(1.0, n)
    assert b.available(now=wait + later) <= burst
