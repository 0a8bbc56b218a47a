"""Routing follows a peer's capped throughput (issue 15): the wiring never believes more of a
peer than its ceiling (what it announces, which ``[limits]`` caps to what its upload carries),
however fast its hops look. Pure: no loop for the wiring; the router with a fake host and a
virtual clock (tests/test_router.py's)."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.wiring import Kind, Wiring
from transport.frames import Message
from test_router import MSG, OK, _router


def _run(w: Wiring, true: dict[str, float], n: int, rng: random.Random) -> Counter[str]:
    """``n`` choices of mixed kinds and sizes, each answered at the peer's true rate (what a
    hop shows: compute and our link, never the peer's upload)."""
    work: Counter[str] = Counter()
    now = 0.0
    for _ in range(n):
        kind: Kind = "backward" if rng.random() < 0.5 else "forward"
        samples = rng.randint(1, 32)
        p = w.choose(kind, samples, now, rng)
        assert p is not None
        seconds = samples * w.config.cost(kind) / true[p]
        w.success(p, samples, seconds, kind, now + seconds)
        work[p] += samples * w.config.cost(kind)
        now += 0.001
    return work


def _shares(work: Counter[str]) -> dict[str, float]:
    total = sum(work.values())
    return {p: w / total for p, w in work.items()}


def test_a_capped_peer_gets_its_capped_share_however_fast_its_hops_look() -> None:
    rng = random.Random(3)
    true = {"capped": 100.0, "free": 100.0}  # equally fast hops
    ceilings = {"capped": 10.0, "free": 100.0}  # what each announces
    w = Wiring()
    w.update_peers({p: (c, 0) for p, c in ceilings.items()}, 0.0, ceilings=ceilings)
    _run(w, true, 500, rng)
    shares = _shares(_run(w, true, 10_000, rng))
    assert shares["capped"] == pytest.approx(10 / 110, rel=0.05)
    state = {s.peer_id: s for s in w.snapshot(0.0)}
    assert state["capped"].ceiling == 10.0 and state["capped"].throughput > 10.0  # measured


def test_without_ceilings_the_measured_rate_decides_as_before() -> None:
    rng = random.Random(3)
    true = {"capped": 100.0, "free": 100.0}
    w = Wiring()
    w.update_peers({"capped": (10.0, 0), "free": (100.0, 0)}, 0.0)
    _run(w, true, 500, rng)
    assert _shares(_run(w, true, 10_000, rng))["capped"] == pytest.approx(0.5, rel=0.05)


def test_a_ceiling_above_the_measured_rate_changes_nothing() -> None:
    rng = random.Random(4)
    true = {"a": 10.0, "b": 30.0}
    w = Wiring()
    w.update_peers({"a": (50.0, 0), "b": (50.0, 0)}, 0.0, ceilings={"a": 50.0, "b": 50.0})
    _run(w, true, 500, rng)
    assert _shares(_run(w, true, 10_000, rng))["a"] == pytest.approx(0.25, rel=0.05)


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan, math.inf, 1e-300])
def test_an_unusable_ceiling_is_no_ceiling(bad: float) -> None:
    rng = random.Random(5)
    true = {"a": 100.0, "b": 100.0}
    w = Wiring()
    w.update_peers({"a": (100.0, 0), "b": (100.0, 0)}, 0.0, ceilings={"a": bad, "b": 100.0})
    assert {s.peer_id: s.ceiling for s in w.snapshot(0.0)}["a"] is None
    _run(w, true, 500, rng)
    assert _shares(_run(w, true, 5_000, rng))["a"] == pytest.approx(0.5, rel=0.05)


def test_a_ceiling_follows_the_latest_announcement_and_goes_with_it() -> None:
    rng = random.Random(6)
    true = {"a": 100.0, "b": 100.0}
    w = Wiring()
    w.update_peers({"a": (10.0, 0), "b": (100.0, 0)}, 0.0, ceilings={"a": 10.0, "b": 100.0})
    _run(w, true, 500, rng)
    # the cap was lifted: its next announcement carries its full speed
    w.update_peers({"a": (100.0, 0), "b": (100.0, 0)}, 1.0, ceilings={"a": 100.0, "b": 100.0})
    _run(w, true, 500, rng)
    assert _shares(_run(w, true, 5_000, rng))["a"] == pytest.approx(0.5, rel=0.05)
    w.update_peers({"a": (100.0, 0), "b": (100.0, 0)}, 2.0)  # no ceilings given: none
    assert all(s.ceiling is None for s in w.snapshot(2.0))


def test_a_capped_newcomer_is_recharged_at_its_ceiling_not_its_hop_rate() -> None:
    """The first measurement re-charges the work sent so far at the rate routing uses: a capped
    newcomer measured fast must not owe less than its cap lets it carry (no burst to it)."""
    rng = random.Random(7)
    true = {"a": 100.0, "b": 100.0, "new": 100.0}
    w = Wiring()
    w.update_peers({"a": (100.0, 0), "b": (100.0, 0)}, 0.0)
    _run(w, {"a": 100.0, "b": 100.0}, 300, rng)
    ceilings = {"a": 100.0, "b": 100.0, "new": 10.0}
    w.update_peers({p: (c, 0) for p, c in ceilings.items()}, 1.0, ceilings=ceilings)
    shares = _shares(_run(w, true, 2_100, rng))
    assert shares["new"] == pytest.approx(10 / 210, rel=0.1)


def _run_hops(w: Wiring, compute: dict[str, float], latency: dict[str, float], n: int,
              rng: random.Random) -> Counter[str]:
    """``n`` forwards of 8 samples; a hop on ``p`` takes its compute and a fixed latency (the
    trio bridge, the wire), and says its compute."""
    picks: Counter[str] = Counter()
    for _ in range(n):
        p = w.choose("forward", 8, 0.0, rng)
        assert p is not None
        picks[p] += 1
        c = 8 / compute[p]
        w.success(p, 8, c + latency[p], "forward", 0.0, compute_s=c)
    return picks


def test_a_capped_peer_gets_its_cap_s_fraction_when_hops_are_mostly_latency() -> None:
    """A tiny model: 15 ms of compute per hop, 18 ms of latency. The free peer announces what
    it computes (533/s); the capped one computes as fast but announces 46/s (its cap). Its
    share follows the announcements (46 / 579), not min(hop rate 242, 46) (16%)."""
    rng = random.Random(8)
    compute = {"capped": 533.0, "free": 533.0}
    latency = {"capped": 0.018, "free": 0.018}
    ceilings = {"capped": 46.0, "free": 533.0}
    w = Wiring()
    w.update_peers({p: (c, 0) for p, c in ceilings.items()}, 0.0, ceilings=ceilings)
    _run_hops(w, compute, latency, 500, rng)
    picks = _run_hops(w, compute, latency, 5_000, rng)
    assert picks["capped"] / 5_000 == pytest.approx(46 / 579, rel=0.1)
    share = {s.peer_id: s.compute_share for s in w.snapshot(0.0)}
    assert share["capped"] == pytest.approx(0.015 / 0.033, rel=0.02)


def test_an_uncapped_peer_s_ceiling_does_not_bind_and_latency_still_counts() -> None:
    """Announcing what they compute, equal peers share by their hop rates: the far one (more
    latency) gets less, as without ceilings."""
    rng = random.Random(9)
    compute = {"near": 100.0, "far": 100.0}
    latency = {"near": 0.01, "far": 0.09}
    w = Wiring()
    w.update_peers({p: (100.0, 0) for p in compute}, 0.0, ceilings=dict.fromkeys(compute, 100.0))
    _run_hops(w, compute, latency, 500, rng)
    picks = _run_hops(w, compute, latency, 5_000, rng)
    # hop rates 8/0.09 = 88.9 and 8/0.17 = 47.1
    assert picks["near"] / 5_000 == pytest.approx(88.9 / 136.0, rel=0.05)


@settings(max_examples=25, deadline=None)
@given(tputs=st.lists(st.tuples(st.floats(1.0, 100.0), st.floats(0.5, 200.0)),
                      min_size=2, max_size=12),
       seed=st.integers(0, 2**32 - 1))
def test_each_peers_share_is_proportional_to_its_rate_at_most_its_ceiling(
        tputs: list[tuple[float, float]], seed: int) -> None:
    """Peers of true hop rates and ceilings drawn at random (some above, some below): after
    warm-up, each one's share of work is within 5% (relative; 0.05 points absolute) of
    min(rate, ceiling) / sum of those."""
    rng = random.Random(seed)
    true = {f"p{i}": t for i, (t, _) in enumerate(tputs)}
    ceilings = {f"p{i}": c for i, (_, c) in enumerate(tputs)}
    w = Wiring()
    w.update_peers({p: (c, 0) for p, c in ceilings.items()}, 0.0, ceilings=ceilings)
    _run(w, true, 2_000, rng)
    shares = _shares(_run(w, true, 20_000, rng))
    rate = {p: min(true[p], ceilings[p]) for p in true}
    total = sum(rate.values())
    for p in true:
        ideal = rate[p] / total
        assert abs(shares.get(p, 0.0) - ideal) <= max(0.05 * ideal, 0.0005), (p, rate[p])


# ---- the router gives the wiring what each peer announced as its ceiling --------------------

def test_the_router_holds_each_peer_to_what_it_announces() -> None:
    """Both fake peers answer equally fast; one announces a tenth of the other's throughput
    (its upload cap): it gets about a tenth of the other's share, not half."""
    router, host, clock = _router({"capped": lambda n: OK, "free": lambda n: OK},
                                  tput={"capped": 30.0, "free": 300.0})

    async def many() -> None:
        for _ in range(440):
            await router.send(MSG, timeout=30.0)
            clock.now += 0.01

    asyncio.run(many())
    share = host.requests.count("capped") / len(host.requests)
    assert share == pytest.approx(30 / 330, rel=0.3)
    rows = {s.peer_id: s for s in router.wiring.snapshot(clock.now)}
    assert rows["capped"].ceiling == 30.0 and rows["capped"].throughput > 30.0


def test_a_relayed_peer_is_held_to_its_full_announcement_not_the_relay_share() -> None:
    relayed = ("/ip4/198.18.0.2/tcp/4001/p2p/R/p2p-circuit/p2p/B",)
    router, host, clock = _router({"direct": lambda n: OK, "relayed": lambda n: OK},
                                  tput={"direct": 100.0, "relayed": 100.0})
    peers = router.peers_of(1)
    router.peers_of = lambda s: {**peers, "relayed": (100.0, 0, relayed)}
    asyncio.run(router.send(MSG, timeout=30.0))
    rows = {s.peer_id: s for s in router.wiring.snapshot(clock.now)}
    assert rows["relayed"].ceiling == 100.0 and rows["relayed"].throughput == 25.0


# ---- what a hop costs the peer: its compute and the transfer, not its queue ----------------

def test_a_hop_costs_its_compute_and_transfer_not_the_wait_in_the_peer_s_queue() -> None:
    from swarmd.pipeline.messages import HopReply, hop_seconds, parse_hop_reply

    reply = HopReply(service_s=0.05, held_s=0.08, compute_s=0.02)
    assert parse_hop_reply(Message(**reply.wire())) == reply
    # 20 ms of compute (30 ms waiting for the compute thread) and 20 ms on the wire
    assert reply.seconds(0.10) == pytest.approx(0.04)
    # an older peer says no compute time: its service time counts, as before
    assert HopReply(service_s=0.05, held_s=0.08).seconds(0.10) == pytest.approx(0.07)
    for bad in (-1, "x", True, math.nan, 0.06):  # unusable, or more than its service time
        meta = {"service_s": 0.05, "held_s": 0.08, "compute_s": bad}
        assert hop_seconds(Message(kind="ok", meta=meta), 0.10) == pytest.approx(0.07)


def test_a_loaded_peer_keeps_its_share_when_its_replies_say_its_compute() -> None:
    """Two peers of equal compute, one of them with a long queue (its service time 5x its
    compute): counted by compute they share equally; counted by service time, the queued
    one would get 30%."""
    slow_queue = Message(kind="ok", meta={"service_s": 0.005, "held_s": 0.008,
                                          "compute_s": 0.001})
    no_queue = Message(kind="ok", meta={"service_s": 0.001, "held_s": 0.008,
                                        "compute_s": 0.001})
    router, host, clock = _router({"queued": lambda n: slow_queue, "idle": lambda n: no_queue},
                                  tput={"queued": 1e6, "idle": 1e6})

    async def many() -> None:
        for _ in range(400):
            await router.send(MSG, timeout=30.0)
            clock.now += 0.01

    asyncio.run(many())
    assert host.requests.count("queued") / len(host.requests) == pytest.approx(0.5, rel=0.1)


def test_a_hop_that_waited_in_the_peer_s_upload_does_not_lower_its_rate_twice() -> None:
    """Some replies waited 0.4 s in the peer's saturated upload: the hop rate falls (8 / 0.433),
    the compute share the ceiling converts by stays that of its hops without a wait while
    fewer than half its recent hops waited, so the rate is the lower of the two, not their
    product; once most of them wait (a saturated upload), the share follows."""
    w = Wiring()
    w.update_peers({"capped": (46.0, 0)}, 0.0, ceilings={"capped": 46.0})
    w.success("capped", 8, 0.033, "forward", 0.0, compute_s=0.015)  # 15 ms + 18 ms
    w.success("capped", 8, 0.433, "forward", 0.0, compute_s=0.015)  # and a 0.4 s wait
    (row,) = w.snapshot(0.0)
    assert row.compute_share == pytest.approx(0.015 / 0.033)
    for _ in range(5):  # 6 of 12 recent hops waited: still the share without a wait
        w.success("capped", 8, 0.033, "forward", 0.0, compute_s=0.015)
        w.success("capped", 8, 0.433, "forward", 0.0, compute_s=0.015)
    (row,) = w.snapshot(0.0)
    assert row.compute_share == pytest.approx(0.015 / 0.033)
    assert row.rate == pytest.approx(min(row.throughput, 46.0 * 0.015 / 0.033))
    for _ in range(200):  # a saturated upload for 200 hops: the share forgets the good ones
        w.success("capped", 8, 0.433, "forward", 0.0, compute_s=0.015)
    (row,) = w.snapshot(0.0)
    assert row.compute_share == pytest.approx(0.015 / 0.433)


def test_noisy_hops_give_a_capped_peer_its_capped_share_not_more() -> None:
    """Both peers compute alike and their hops' latency varies alike (a loaded machine); one
    announces a tenth of what it computes. Its share of the work stays at a tenth of the
    other's (the largest recent compute share gave it about 1.4 times that)."""
    rng = random.Random(7)
    w = Wiring()
    w.update_peers({"capped": (10.0, 0), "free": (100.0, 0)}, 0.0,
                   ceilings={"capped": 10.0, "free": 100.0})
    work: Counter[str] = Counter()
    now = 0.0
    for i in range(20_000):
        p = w.choose("forward", 4, now, rng)
        assert p is not None
        compute = 4 / 100.0  # 100 samples/s of compute each
        seconds = compute + rng.uniform(0.0, 0.08)  # and 0-80 ms of latency
        w.success(p, 4, seconds, "forward", now, compute_s=compute)
        if i >= 2_000:
            work[p] += 4
        now += 0.001
    assert _shares(work)["capped"] == pytest.approx(10 / 110, rel=0.15)


def test_the_snapshot_shows_the_routing_ceiling_the_rate_and_whether_the_cap_binds() -> None:
    w = Wiring()
    w.update_peers({"capped": (10.0, 0), "free": (100.0, 0)}, 0.0,
                   ceilings={"capped": 10.0, "free": 100.0})
    for p in ("capped", "free"):  # 4 samples in 0.04 s, 0.01 s of it compute: share 0.25
        w.success(p, 4, 0.04, "forward", 1.0, compute_s=0.01)
    state = {s.peer_id: s for s in w.snapshot(1.0)}
    capped, free = state["capped"], state["free"]
    assert capped.compute_s == 0.01 and capped.compute_share == pytest.approx(0.25)
    assert capped.routing_ceiling == pytest.approx(2.5) and capped.rate == pytest.approx(2.5)
    assert capped.capped and capped.throughput == pytest.approx(100.0)
    assert free.routing_ceiling == pytest.approx(25.0) and free.rate == pytest.approx(25.0)
    assert free.capped  # 100 announced for 400/s of compute: its ceiling binds too
    w2 = Wiring()
    w2.update_peers({"a": (10.0, 0)}, 0.0)
    (a,) = w2.snapshot(0.0)
    assert a.routing_ceiling is None and a.rate == 10.0 and not a.capped and a.compute_s is None


def test_swarmd_peers_prints_the_wiring_column_only_when_it_has_wiring_figures() -> None:
    from swarmd.api.types import ConnectedPeer
    from swarmd.cli.client import text_peers

    text = text_peers([
        ConnectedPeer(peer_id="c", stage=1, state="online", routing="ok", throughput=300.0,
                      measured=True, ceiling=46.0, compute_share=0.45, compute_s=0.015,
                      routing_ceiling=20.7, rate=20.7, capped=True),
        ConnectedPeer(peer_id="f", stage=1, state="online", routing="ok", throughput=300.0,
                      rate=300.0),
        ConnectedPeer(peer_id="t")])
    lines = text.splitlines()
    assert lines[0].split()[-2:] == ["ROUTING", "WIRING"]
    assert "20.7/s, capped 46.0 x 0.45 = 20.7, compute 15.0 ms" in lines[1]
    assert lines[2].split()[4:] == ["300.0/s", "(unmeasured)"]
    assert "WIRING" not in text_peers([ConnectedPeer(peer_id="t", routing="ok")])
