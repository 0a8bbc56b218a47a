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


def test_a_request_unanswered_for_long_raises_the_round_trip_at_once_answers_bring_it_down(
        ) -> None:
    links = LinkEstimates()
    links.observe_rtt("p", 0.05, now=0.0)
    links.observe_rtt_at_least("p", 1.0, now=1.0)  # no reply within 1 s: a congested link
    assert links.link("p").rtt_s == 1.0
    links.observe_rtt_at_least("p", 0.5, now=2.0)  # a lower bound below it: nothing new
    assert links.link("p").rtt_s == 1.0
    for t in range(20):
        links.observe_rtt("p", 0.05, now=3.0 + t)
    assert links.link("p").rtt_s < 0.1
    links.observe_rtt_at_least("p", float("nan"), now=30.0)
    assert links.link("p").rtt_s < 0.1


def test_the_peers_heard_since_a_time_are_the_most_recently_measured() -> None:
    links = LinkEstimates()
    links.observe_rtt("a", 0.05, now=1.0)
    links.observe_rtt("b", 0.05, now=2.0)
    links.observe_transfer("c", 10 * MB, 1.0, now=3.0)
    links.observe_rtt("a", 0.05, now=4.0)
    assert links.heard_since(2.5) == {"a": 4.0, "c": 3.0}
    assert links.heard_since(5.0) == {}
    assert set(links.heard_since(0.0)) == {"a", "b", "c"}


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


# ---- shared estimates, rounds and the status (issue 11: deadlines that follow the link) ----

def test_one_host_shares_one_estimate_table_and_two_hosts_do_not() -> None:
    from swarmd.links import links_for

    class FakeHost:
        pass

    a, b = FakeHost(), FakeHost()
    assert links_for(a) is links_for(a)
    assert links_for(a) is not links_for(b)
    links_for(a).observe_rtt("p", 0.2, now=1.0)
    assert links_for(b).link("p").rtt_s is None


def test_a_round_deadline_adds_up_what_the_peer_moves_with_each_mate() -> None:
    from swarmd.links import Transfer

    links = LinkEstimates(DeadlinePolicy(floor_s=1, slack=2, default_rtt_s=0.1,
                                         default_bandwidth=1e6))
    transfers = [Transfer("a", 4_000_000, 3), Transfer("b", 2_000_000, 2)]
    assert links.deadline_all(transfers, extra_s=5) == pytest.approx(
        2 * (0.3 + 4.0 + 0.2 + 2.0) + 5)
    assert links.deadline_all(transfers, cap_s=3) == pytest.approx(3)
    assert links.deadline_all([]) == pytest.approx(1)  # the floor


@given(st.lists(st.integers(1 << 17, 1 << 28), min_size=1, max_size=6),
       st.floats(0.5, 500))
def test_a_round_recorded_as_shared_is_expected_to_take_as_long_again(sizes, seconds) -> None:
    from swarmd.links import Transfer

    links = LinkEstimates(alpha=1.0)
    transfers = [Transfer(f"p{i}", n, 0) for i, n in enumerate(sizes)]
    links.observe_shared(transfers, seconds, now=1.0)
    expected = sum(links.expected_s(t.peer, t.nbytes, round_trips=0) for t in transfers)
    assert expected == pytest.approx(seconds, rel=1e-6)


def test_the_plan_says_what_each_peer_moves_with_each_mate() -> None:
    from swarmd.averaging.plan import RoundPlan

    plan = RoundPlan.build("r", ["a", "b", "c"], 3000, parts=[1000, 1000, 1000], chunk=500)
    moves = plan.transfers(plan.index("b"), 4.0)
    assert [t.peer for t in moves] == ["a", "c"]
    assert all(t.nbytes == (1000 + 1000) * 4 and t.round_trips == 2 + 2 + 1 for t in moves)
    assert sum(t.nbytes for t in plan.transfers(0, 2.0)) == 2 * 2 * 2000


def test_the_status_shows_each_peer_and_its_derived_deadlines_under_the_caps() -> None:
    links = LinkEstimates()
    links.observe_rtt("p", 0.05, now=1.0)
    links.observe_transfer("p", 8_000_000, 1.3, now=1.0)
    status = links.status(hop_cap_s=60, round_cap_s=30)
    row = status["peers"]["p"]
    assert row["rtt_s"] == pytest.approx(0.05) and row["bandwidth_bytes_s"] > 6e6
    deadlines = row["deadlines_s"]
    assert 5 <= deadlines["hop"] <= 60 and deadlines["round"] == pytest.approx(30)
    assert deadlines["state_chunk"] == pytest.approx(links.deadline("p", 16 << 20))
    assert status["policy"]["floor_s"] == 5.0 and set(status["typical_bytes"]) == {
        "hop", "round", "state_chunk"}


# ---- the router's hop deadline follows the link and what the peer held before ----

def test_a_hop_deadline_is_the_cap_until_a_peer_answered_then_follows_its_link() -> None:
    import asyncio
    import random

    import torch

    from swarmd.pipeline.held import HOP_TIMEOUT_S
    from swarmd.pipeline.router import Router
    from transport.frames import Message

    timeouts: list[float] = []
    now = [0.0]

    class Host:
        async def connect(self, peer: str, addrs: object, *, timeout: float) -> None:
            pass

        async def request(self, peer: str, protocol: str, message: Message, *, codec: object,
                          timeout: float) -> Message:
            timeouts.append(timeout)
            now[0] += 0.3  # a 0.3 s round trip, 0.2 s of it held by the peer
            return Message(kind="ok", meta={"service_s": 0.01, "held_s": 0.2})

    message = Message(kind="forward", meta={}, tensors=(torch.zeros(64, 1024),))
    links = LinkEstimates()
    router = Router(Host(), stage=1, protocol="/p", codec=None, rng=random.Random(0),
                    peers_of=lambda s: {"p": (1.0, 0, ())}, links=links,
                    clock=lambda: now[0])

    async def two() -> None:
        for _ in range(2):
            await router.send(message, timeout=1000.0)

    asyncio.run(two())
    assert timeouts[0] == pytest.approx(HOP_TIMEOUT_S)  # nothing known of that peer yet
    assert links.link("p").bandwidth is not None or links.link("p").rtt_s is not None
    assert links.policy.floor_s <= timeouts[1] < HOP_TIMEOUT_S / 2
    assert timeouts[1] == pytest.approx(router.hop_timeout("p", 64 * 1024 * 4))
