"""Membership timing: the adaptive period, pulls, the gossip budget. Pure, time is a number."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.membership import PullOrder, Schedule, ScheduleConfig, SwarmEstimate, plan
from swarmd.membership.schedule import gossip_cost, refresh_traffic

NOW = 1_700_000_000.0
CONFIG = ScheduleConfig()
BUDGET = CONFIG.refresh_share * CONFIG.budget_bytes_per_s


def est(peers: int, events: float = 0.0, size: float = 205.0) -> SwarmEstimate:
    return SwarmEstimate(peers=peers, wire_bytes=size, events_per_s=events)


def independent_traffic(n: int, period: float, pull: float, window: float, size: float,
                        events: float) -> float:
    """The traffic model written out again from the module docstring, term by term."""
    versions = (n / period + events) * (size + 3)
    digest_entries = n * min(1.0, window / period) + events * window
    return (versions + CONFIG.fingerprint_bytes * digest_entries / pull
            + 2 * CONFIG.message_overhead_bytes / pull)


# ------------------------------------------------------------------------------------ plan

@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10_000), st.floats(0, 2.0), st.floats(120, 400))
def test_adaptive_period_keeps_modelled_traffic_within_budget(n: int, events: float,
                                                              size: float) -> None:
    p = plan(est(n, events, size), CONFIG)
    size = float(round(size))
    events = float(f"{events:.2g}")
    modelled = independent_traffic(n, p.period_s, p.pull_s, p.window_s, size, events)
    assert modelled == pytest.approx(p.bytes_per_s)
    if p.period_s < CONFIG.max_period_s:
        assert modelled <= BUDGET * 1.0001
    else:  # churn too high for any period: announce as rarely as allowed (see below)
        assert p.bytes_per_s > BUDGET
    assert CONFIG.base_period_s <= p.period_s <= CONFIG.max_period_s
    assert p.expiry_s == pytest.approx(3 * p.period_s)
    if p.period_s > CONFIG.base_period_s * 1.01:  # and it is the shortest period that fits
        assert refresh_traffic(n, p.period_s * 0.99, CONFIG, size, events) > BUDGET


def test_figures_at_a_few_sizes() -> None:
    periods = {n: plan(est(n), CONFIG).period_s for n in (2, 10, 100, 1000, 10_000)}
    assert periods[2] == CONFIG.base_period_s           # small swarms: the base period
    assert periods[10] < 3.0                            # 10 daemons: killed one gone in < 9 s
    assert 100 < periods[1000] < 250 and 1200 < periods[10_000] < 2400
    assert list(periods.values()) == sorted(periods.values())
    # churn costs budget: the period grows with the event rate
    assert plan(est(10_000, events=1.4), CONFIG).period_s > periods[10_000] * 1.2


def test_pull_interval_and_window_keep_propagation_inside_a_period() -> None:
    for n in (2, 10, 50, 200, 1000, 10_000, 50_000):
        p = plan(est(n), CONFIG)
        assert CONFIG.min_pull_s <= p.pull_s <= CONFIG.max_pull_s
        # a version reaches a given peer after ~pull_s ln n; the window covers ln n + 7 rounds
        assert p.window_s == pytest.approx((math.log(n) + 7) * p.pull_s + CONFIG.skew_s)
        assert p.pull_s * math.log(n) < p.period_s


def test_impossible_budget_announces_as_rarely_as_allowed() -> None:
    p = plan(est(10_000_000), CONFIG)
    assert p.period_s == CONFIG.max_period_s and p.bytes_per_s > BUDGET


def test_gossip_cost_counts_mesh_duplicates_and_ihave() -> None:
    c = CONFIG
    assert gossip_cost(c, 200) == c.gossip_degree * (200 + c.gossip_envelope_bytes) + \
        c.gossip_degree * c.gossip_history * c.gossip_id_bytes
    p = plan(est(10), CONFIG)
    # one event per interval from each of n peers stays within the gossip share
    assert 10 * gossip_cost(c, 205) / p.gossip_interval_s == pytest.approx(
        c.gossip_share * c.budget_bytes_per_s)


@pytest.mark.parametrize("changes", [
    {"base_period_s": 0}, {"max_period_s": 1.0}, {"min_pull_s": 10.0},
    {"refresh_share": 0.95, "gossip_share": 0.1}, {"jitter": 0.6},
])
def test_config_is_validated(changes: dict) -> None:
    with pytest.raises(ValueError):
        ScheduleConfig(**changes)


# -------------------------------------------------------------------------------- announce

def test_announce_at_once_then_within_the_declared_period() -> None:
    rng = random.Random(1)
    s = Schedule(CONFIG, now=NOW, rng=rng)
    assert s.announce_due(NOW) and s.next_wakeup() == NOW
    t = NOW
    for _ in range(50):
        period = s.announce(t, est(1000))
        assert period == plan(est(1000), CONFIG).period_s
        gap = s.next_announce_at - t
        assert period * (1 - CONFIG.jitter) <= gap <= period
        assert not s.announce_due(s.next_announce_at - 0.001)
        t = s.next_announce_at
        assert s.announce_due(t)


def test_a_change_is_announced_soon_but_never_within_the_minimum_gap() -> None:
    s = Schedule(CONFIG, now=NOW, rng=random.Random(2))
    s.announce(NOW, est(1000))
    s.changed(NOW + 0.1)
    assert s.next_announce_at == NOW + CONFIG.min_gap_s
    with pytest.raises(ValueError):
        s.announce(NOW + 0.2, est(1000))
    s.announce(NOW + CONFIG.min_gap_s, est(1000))
    s.changed(NOW + 60)
    assert s.announce_due(NOW + 60)


def test_same_seed_same_decisions() -> None:
    def run(seed: int) -> list[float]:
        s = Schedule(CONFIG, now=NOW, rng=random.Random(seed))
        out, t = [], NOW
        for _ in range(20):
            s.announce(t, est(500))
            order = s.pull(t, est(500), ["a", "b", "c"])
            out += [s.next_announce_at, s.next_pull_at, hash(order)]
            t = s.next_wakeup()
        return out
    assert run(3) == run(3) != run(4)


# ------------------------------------------------------------------------------------ pull

def test_full_view_first_then_deltas() -> None:
    s = Schedule(CONFIG, now=NOW, rng=random.Random(3))
    assert s.pull_due(NOW)
    first = s.pull(NOW, est(1), ["bootstrap"])
    assert first == PullOrder(peer_id="bootstrap", cutoff=None) and first.full
    s.pulled(NOW + 1, first, ok=False)                      # failed: retried soon, still full
    assert s.next_pull_at <= NOW + 1 + CONFIG.min_pull_s
    again = s.pull(NOW + 2, est(1), ["bootstrap"])
    assert again is not None and again.full
    s.pulled(NOW + 3, again, ok=True)
    p = plan(est(1000), CONFIG)
    delta = s.pull(NOW + 10, est(1000), ["x", "y"])
    assert delta is not None and delta.cutoff == pytest.approx(NOW + 10 - p.window_s)
    assert abs(s.next_pull_at - (NOW + 10 + p.pull_s)) <= CONFIG.jitter * p.pull_s + 1e-9
    assert s.pull(NOW + 20, est(1000), []) is None          # nobody to ask: wait
    assert s.pull(NOW + 30, est(1), ["x"]).full            # alone again: full view


def test_pull_targets_are_uniform() -> None:
    s = Schedule(CONFIG, now=NOW, rng=random.Random(4))
    candidates = [f"p{i}" for i in range(10)]
    counts = dict.fromkeys(candidates, 0)
    for k in range(5000):
        counts[s.pull(NOW + k, est(11), candidates).peer_id] += 1
    assert min(counts.values()) > 400 and max(counts.values()) < 600


# ---------------------------------------------------------------------------------- gossip

@pytest.mark.parametrize("n", [10, 100])
def test_gossip_token_bucket_starts_empty_and_holds_the_rate(n: int) -> None:
    s = Schedule(CONFIG, now=NOW, rng=random.Random(5))
    interval = plan(est(n), CONFIG).gossip_interval_s
    assert not s.may_gossip(NOW, est(n))
    assert not s.may_gossip(NOW + interval * 0.9, est(n))
    assert s.may_gossip(NOW + interval * 1.01, est(n))
    assert not s.may_gossip(NOW + interval * 1.02, est(n))
    allowed = sum(s.may_gossip(NOW + interval + k, est(n)) for k in range(int(20 * interval)))
    assert 19 <= allowed <= 21


def test_never_gossip_at_ten_thousand_peers() -> None:
    s = Schedule(CONFIG, now=NOW, rng=random.Random(6))
    assert not any(s.may_gossip(NOW + 60 * k, est(10_000)) for k in range(24 * 60))
