"""Deadlines that follow the link (swarmd.links): pure estimates and the derived timeouts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.links import DeadlinePolicy, LinkEstimates

MB = 1 << 20


def test_unmeasured_links_get_the_slow_home_uplink_defaults() -> None:
    links = LinkEstimates(DeadlinePolicy(floor_s=1, cap_s=10_000, slack=2,
                                         default_rtt_s=0.5, default_bandwidth=1e6))
    assert links.deadline("p", 0) == pytest.approx(1.0)  # 2 x 0.5 s, the floor
    assert links.deadline("p", 10_000_000) == pytest.approx(2 * (0.5 + 10.0))


def test_100_mb_at_50_mbit_gets_more_than_the_old_30_s() -> None:
    links = LinkEstimates()
    for i in range(5):  # 8 MB in 1.3 s with 50 ms RTT: about 50 Mbit/s
        links.observe_rtt("p", 0.1, now=i)
        links.observe_transfer("p", 8_000_000, 1.38, now=i)
    assert 6e6 <= links.link("p").bandwidth <= 6.5e6
    deadline = links.deadline("p", 100 * MB)
    assert deadline > 30 and deadline == pytest.approx(3 * (0.1 + 100 * MB / links.link("p").bandwidth), rel=1e-6)


def test_a_fast_lan_gets_the_floor_not_30_s() -> None:
    links = LinkEstimates()
    links.observe_rtt("p", 0.0002, now=0)
    links.observe_transfer("p", 4 * MB, 0.004, now=0)
    assert links.deadline("p", 100_000) == DeadlinePolicy().floor_s


def test_cap_and_config_cap() -> None:
    links = LinkEstimates(DeadlinePolicy(cap_s=100))
    assert links.deadline("p", 10**12) == 100
    assert links.deadline("p", 10**12, cap_s=20) == 20
    assert links.deadline("p", 10**12, cap_s=1) == DeadlinePolicy().floor_s  # never below it


def test_small_transfers_update_the_round_trip_only() -> None:
    links = LinkEstimates()
    links.observe_transfer("p", 100, 0.05, now=0)
    assert links.link("p").rtt_s == 0.05 and links.link("p").bandwidth is None


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, 1e9])
def test_nonsense_samples_change_nothing(bad: float) -> None:
    links = LinkEstimates()
    links.observe_rtt("p", bad, now=0)
    links.observe_transfer("p", 10 * MB, bad, now=0)
    assert links.snapshot() == {}


def test_the_peer_table_is_bounded() -> None:
    links = LinkEstimates(max_peers=3)
    for i in range(10):
        links.observe_rtt(f"p{i}", 0.01, now=i)
    assert list(links.snapshot()) == ["p7", "p8", "p9"]


@pytest.mark.parametrize("kwargs", [dict(floor_s=0), dict(cap_s=math.inf), dict(slack=0.5),
                                    dict(floor_s=10, cap_s=5), dict(default_bandwidth=-1)])
def test_bad_policies_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="DeadlinePolicy"):
        DeadlinePolicy(**kwargs)


@given(samples=st.lists(st.tuples(st.integers(0, 10**10), st.floats(1e-6, 1e5)), max_size=20),
       nbytes=st.integers(0, 10**12), round_trips=st.integers(0, 10),
       extra=st.floats(0, 1e4))
def test_deadlines_are_always_within_floor_and_cap_and_grow_with_bytes(samples, nbytes,
                                                                       round_trips, extra):
    links = LinkEstimates()
    for i, (n, s) in enumerate(samples):
        links.observe_transfer("p", n, s, now=i)
    p = links.policy
    d = links.deadline("p", nbytes, round_trips=round_trips, extra_s=extra)
    assert p.floor_s <= d <= p.cap_s
    assert links.deadline("p", nbytes * 2 + 1, round_trips=round_trips, extra_s=extra) >= d
