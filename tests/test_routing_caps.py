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
from hypothesis import example, given, settings
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


def test_a_reply_s_wait_in_the_peer_s_upload_is_not_in_the_hop_s_cost() -> None:
    """A capped peer's ``ok`` says it waits 0.4 s in its upload (averaging fills it): the hop
    costs its compute and the transfer without that wait; a wait longer than the transfer
    leaves none; an unusable one counts as not said."""
    from swarmd.pipeline.messages import HopReply, hop_seconds, parse_hop_reply

    reply = HopReply(service_s=0.015, held_s=0.016, compute_s=0.015, upload_wait_s=0.4)
    assert parse_hop_reply(Message(**reply.wire())) == reply
    assert reply.seconds(0.434) == pytest.approx(0.015 + 0.018)
    assert HopReply(service_s=0.015, held_s=0.016, compute_s=0.015,
                    upload_wait_s=9.0).seconds(0.434) == pytest.approx(0.015)
    assert "upload_wait_s" not in HopReply(service_s=0.1, held_s=0.1).wire()["meta"]
    for bad in (-1, "x", True, math.nan, math.inf, 1e9, None):
        meta = {"service_s": 0.015, "held_s": 0.016, "compute_s": 0.015, "upload_wait_s": bad}
        assert parse_hop_reply(Message(kind="ok", meta=meta)).upload_wait_s is None
        assert hop_seconds(Message(kind="ok", meta=meta), 0.434) == pytest.approx(0.433)


def test_a_hop_that_waited_in_the_peer_s_upload_counts_once() -> None:
    """The wait said: the rate is that of the hops without it (the announcement, the ceiling,
    has the cap and what filled it already). Not said (an older peer): it lowers the hop rate,
    and the rate routing uses in proportion (``t_p x ceiling / c_p``), not twice."""
    from swarmd.pipeline.messages import HopReply

    said, unsaid, plain = Wiring(), Wiring(), Wiring()
    for w in (said, unsaid, plain):
        w.update_peers({"capped": (46.0, 0)}, 0.0, ceilings={"capped": 46.0})
    for _ in range(50):  # 15 ms of compute, 18 ms on the wire, and a 0.4 s wait in its upload
        for w, wait in ((said, 0.4), (unsaid, None), (plain, 0.0)):
            reply = HopReply(service_s=0.015, held_s=0.016, compute_s=0.015, upload_wait_s=wait)
            rtt = 0.034 + (0.4 if w is not plain else 0.0)
            w.success("capped", 8, reply.seconds(rtt), "forward", 0.0, compute_s=0.015)
    rows = {name: w.snapshot(0.0)[0] for name, w in
            (("said", said), ("unsaid", unsaid), ("plain", plain))}
    assert rows["said"].rate == pytest.approx(rows["plain"].rate)
    assert rows["plain"].rate == pytest.approx(8 / 0.033 * 46.0 / (8 / 0.015))
    assert rows["unsaid"].rate == pytest.approx(rows["plain"].rate * 0.033 / 0.433)
    assert rows["unsaid"].compute_share == pytest.approx(0.015 / 0.433)


def test_the_router_takes_the_said_wait_out_of_the_hop_time() -> None:
    """Through the router (fake host, virtual clock: a request takes 10 ms): a peer that held
    the request 8 ms, 5 of them its compute, and says its reply waited 2 ms in its upload, is
    measured at 2 samples / 5 ms."""
    waited = Message(kind="ok", meta={"service_s": 0.005, "held_s": 0.008, "compute_s": 0.005,
                                      "upload_wait_s": 0.002})
    router, host, clock = _router({"capped": lambda n: waited}, tput={"capped": 10.0})
    asyncio.run(router.send(MSG, timeout=30.0))
    (row,) = router.wiring.snapshot(clock.now)
    assert row.measured and row.throughput == pytest.approx(2 / 0.005)


def test_a_capped_host_s_ok_says_how_long_it_waits_in_its_upload() -> None:
    """The handler asks the host's throttle what an ``ok`` built now would wait (the bucket's
    debt, reading it only); an uncapped host, or one without a throttle, says nothing."""
    from swarmd.pipeline.handlers import OK_REPLY_BYTES, _upload_wait
    from transport.counters import Counters
    from transport.throttle import Throttle

    capped = Throttle(1000, None, 100, Counters())
    assert capped.upload is not None
    capped.upload.take(1100, 5.0)  # 1000 bytes of debt at t = 5
    assert capped.upload_wait(OK_REPLY_BYTES, 5.0) == pytest.approx((1000 + OK_REPLY_BYTES)
                                                                    / 1000)
    assert capped.upload_wait(0, 6.5) == 0.0  # paid off and refilled
    assert capped.upload.granted_bytes == 1100  # nothing taken by asking

    class Host:
        throttle = capped

    assert 0 < (_upload_wait(Host()) or 0) <= (1000 + OK_REPLY_BYTES) / 1000
    Host.throttle = Throttle(None, 1000, None, Counters())
    assert _upload_wait(Host()) is None
    assert _upload_wait(object()) is None


def _noisy_share(f: float, compute_cv: float, latency_cv: float, latency_s: float,
                 waits: float, seed: int, n: int = 4_000, warm: int = 1_000) -> float:
    """Two peers that compute alike (15 ms a hop, lognormal noise), with alike noisy links; one
    announces ``f`` of what the other does (its cap) and its replies wait in its upload, said,
    with probability ``waits``. The capped peer's share of forwards after ``warm`` of ``n``,
    over its ceiling's share ``f / (1 + f)``."""
    from swarmd.pipeline.messages import HopReply

    rng = random.Random(seed)
    base = 0.015
    free = 8 / base * math.exp(compute_cv ** 2 / 2)  # the mean rate the free peer announces
    ceilings = {"capped": f * free, "free": free}
    w = Wiring()
    w.update_peers({p: (c, 0) for p, c in ceilings.items()}, 0.0, ceilings=ceilings)
    picks: Counter[str] = Counter()
    for i in range(n):
        p = w.choose("forward", 8, 0.0, rng)
        assert p is not None
        compute = base * math.exp(rng.gauss(0.0, compute_cv))
        transfer = latency_s * math.exp(rng.gauss(0.0, latency_cv))
        wait = rng.uniform(0.0, 0.5) if p == "capped" and rng.random() < waits else 0.0
        reply = HopReply(service_s=compute, held_s=compute, compute_s=compute,
                         upload_wait_s=wait if p == "capped" else None)
        w.success(p, 8, reply.seconds(compute + transfer + wait), "forward", 0.0,
                  compute_s=compute)
        if i >= warm:
            picks[p] += 1
    return picks["capped"] / (n - warm) / (f / (1 + f))


@settings(max_examples=20, deadline=None)
@example(f=0.05078125, compute_cv=0.5, latency_cv=1.0, latency_s=0.05, waits=0.5, seed=2**32 - 1)
@given(f=st.floats(0.05, 0.8), compute_cv=st.floats(0.0, 0.8), latency_cv=st.floats(0.0, 1.2),
       latency_s=st.floats(0.005, 0.05), waits=st.floats(0.0, 0.9),
       seed=st.integers(0, 2**32 - 1))
def test_a_capped_peer_s_long_run_share_converges_to_its_ceiling_s_share_under_noisy_hops(
        f: float, compute_cv: float, latency_cv: float, latency_s: float, waits: float,
        seed: int) -> None:
    """Noisy compute and heavy-tailed links alike for both peers, and the capped one's replies
    often waiting in its saturated upload: its share of forwards stays within 12% of its
    ceiling's share (the per-hop median share, or ``min(t_p, ...)``, gave it up to +19% and
    more)."""
    # enough hops that the capped peer takes ~1,500 after the warm-up whatever f: with 4,000
    # hops in all, f = 0.05 left it ~145 picks, whose sampling spread alone (sd 0.094 over
    # seeds) put one seed in five outside 12% (hypothesis found seed 2**32 - 1 at 0.74)
    n = 1_000 + math.ceil(1_500 * (1 + f) / f)
    assert _noisy_share(f, compute_cv, latency_cv, latency_s, waits, seed, n=n) == \
        pytest.approx(1.0, abs=0.12)


def test_the_median_share_s_bias_is_gone_on_a_loaded_machine() -> None:
    """The case the median got wrong most (noisy compute and links): within 5%."""
    assert _noisy_share(0.07, 0.67, 0.67, 0.034, 0.17, seed=7, n=8_000) == \
        pytest.approx(1.0, abs=0.05)


def test_one_wild_compute_time_does_not_starve_a_peer() -> None:
    """A reply that says almost no compute (a bug, a liar) moves its compute rate at most 4x
    the average, once: its rate falls by 1.6 at most, it keeps being chosen and recovers."""
    rng = random.Random(11)
    compute = {"a": 533.0, "b": 533.0}
    latency = {"a": 0.018, "b": 0.018}
    w = Wiring()
    w.update_peers({p: (533.0, 0) for p in compute}, 0.0, ceilings=dict.fromkeys(compute, 533.0))
    _run_hops(w, compute, latency, 200, rng)
    before = {s.peer_id: s.rate for s in w.snapshot(0.0)}["a"]
    w.success("a", 8, 0.033, "forward", 0.0, compute_s=1e-9)
    after = {s.peer_id: s.rate for s in w.snapshot(0.0)}["a"]
    assert after >= before / 1.6 - 1e-9
    picks = _run_hops(w, compute, latency, 2_000, rng)
    assert picks["a"] / 2_000 == pytest.approx(0.5, rel=0.1)


def test_a_peer_announcing_more_than_it_computes_gets_at_most_twice_its_hop_rate() -> None:
    w = Wiring()
    w.update_peers({"big": (1e6, 0)}, 0.0, ceilings={"big": 1e6})
    w.success("big", 8, 0.033, "forward", 0.0, compute_s=0.015)
    (row,) = w.snapshot(0.0)
    assert row.rate == pytest.approx(2 * 8 / 0.033) and not row.capped
    older = Wiring()  # says no compute time: its hop rate, at most its ceiling, as before
    older.update_peers({"old": (1e6, 0)}, 0.0, ceilings={"old": 1e6})
    older.success("old", 8, 0.033, "forward", 0.0)
    assert older.snapshot(0.0)[0].rate == pytest.approx(8 / 0.033)


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
