from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.wiring import Kind, Wiring, WiringConfig

RNG_SEED = 7


def measured_wiring(tputs: dict[str, float], config: WiringConfig | None = None) -> Wiring:
    """A stage whose peers have each been measured once at their true throughput."""
    w = Wiring(config)
    w.update_peers({p: (t, 0) for p, t in tputs.items()}, 0.0)
    for p, t in tputs.items():
        w.success(p, 16, 16 / t, "forward", 0.0)
    return w


def run(w: Wiring, tputs: dict[str, float], n: int, now: float, rng: random.Random,
        kind: Kind = "forward", samples: int = 16) -> Counter[str]:
    """n choices, each answered by a success at the peer's true throughput."""
    picks: Counter[str] = Counter()
    for _ in range(n):
        p = w.choose(kind, samples, now, rng)
        assert p is not None
        picks[p] += 1
        w.success(p, samples, samples * w.config.cost(kind) / tputs[p], kind, now)
    return picks


# ---- the property from the issue --------------------------------------------------------

WARMUP, WINDOW = 2_000, 20_000
REL_TOL, ABS_TOL = 0.05, 0.0005


@settings(max_examples=30, deadline=None)
@given(tputs=st.lists(st.floats(1.0, 100.0), min_size=2, max_size=20),
       announce=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_each_peers_share_of_work_is_proportional_to_its_throughput(
        tputs: list[float], announce: bool, seed: int) -> None:
    """Work (samples x kind cost) over 20,000 choices after 2,000 of warm-up, mixed kinds and
    sizes, durations fed back at each peer's true throughput, announcements (if any) off by up
    to 2x: |share - ideal| <= max(5% of ideal, 0.05 percentage points)."""
    rng = random.Random(seed)
    true = {f"p{i}": t for i, t in enumerate(tputs)}
    w = Wiring()
    w.update_peers({p: (t * rng.uniform(0.5, 2.0) if announce else 0.0, 0)
                    for p, t in true.items()}, 0.0)
    work = dict.fromkeys(true, 0.0)
    now = 0.0
    for n in range(WARMUP + WINDOW):
        kind: Kind = "backward" if rng.random() < 0.5 else "forward"
        samples = rng.randint(1, 32)
        p = w.choose(kind, samples, now, rng)
        assert p is not None
        seconds = samples * w.config.cost(kind) / true[p]
        w.success(p, samples, seconds, kind, now + seconds)
        now += 0.001
        if n >= WARMUP:
            work[p] += samples * w.config.cost(kind)
    total, total_tput = sum(work.values()), sum(tputs)
    for p, t in true.items():
        ideal = t / total_tput
        assert abs(work[p] / total - ideal) <= max(REL_TOL * ideal, ABS_TOL), (p, t)


def test_shares_within_five_percent_relative_with_no_absolute_floor() -> None:
    rng = random.Random(RNG_SEED)
    tputs = {"slow": 1.0, "mid": 10.0, **{f"fast{i}": 100.0 for i in range(5)}}
    w = measured_wiring(tputs)
    run(w, tputs, 1000, 0.0, rng)
    picks = run(w, tputs, 20_000, 1.0, rng)
    for p, t in tputs.items():
        ideal = t / sum(tputs.values())
        assert abs(picks[p] / 20_000 - ideal) <= 0.05 * ideal


# ---- newcomers ---------------------------------------------------------------------------

@pytest.mark.parametrize("announced", [10.0, 0.0])
def test_a_newcomer_is_tried_soon_but_gets_no_burst(announced: float) -> None:
    rng = random.Random(RNG_SEED)
    tputs = {f"p{i}": 10.0 for i in range(4)}
    w = measured_wiring(tputs)
    run(w, tputs, 5000, 0.0, rng)
    tputs["new"] = 10.0
    w.update_peers({p: (10.0, 0) if p != "new" else (announced, 0) for p in tputs}, 1.0)
    first = [w.choose("forward", 16, 1.0, rng) for _ in range(5)]
    assert "new" in first  # within one round of the 5 peers
    picks = run(w, tputs, 100, 1.0, rng)
    assert 18 <= picks["new"] <= 22  # its fair 1/5, not a catch-up burst


def test_a_fast_newcomer_whose_prior_was_low_is_not_left_idle() -> None:
    rng = random.Random(RNG_SEED)
    tputs = {"a": 10.0, "b": 10.0}
    w = measured_wiring(tputs, WiringConfig(prior_throughput=1.0))
    w.update_peers({"a": (10.0, 0), "b": (10.0, 0), "fast": (0.0, 0)}, 0.0)
    tputs["fast"] = 100.0
    run(w, tputs, 50, 0.0, rng)  # "fast" is tried once at the prior of 1/s
    picks = run(w, tputs, 1200, 0.0, rng)
    assert picks["fast"] / 1200 == pytest.approx(100 / 120, rel=0.02)


# ---- slow, errors, bans --------------------------------------------------------------------

def test_a_timeout_lowers_a_share_without_excluding_the_peer_and_decays() -> None:
    rng = random.Random(RNG_SEED)
    cfg = WiringConfig(slow_penalty=2.0, slow_half_life_s=60.0)
    w = measured_wiring({"a": 10.0, "b": 10.0}, cfg)
    w.timeout("a", 0.0)
    state = {s.peer_id: s for s in w.snapshot(0.0)}["a"]
    assert state.slow and state.slow_factor == 2.0 and state.banned_until is None
    picks = Counter(w.choose("forward", 16, 0.0, rng) for _ in range(300))
    assert picks["a"] == pytest.approx(100, abs=2)  # half the rate: 1/3 of the tasks
    later = 60.0 * 20  # 20 half-lives
    picks = Counter(w.choose("forward", 16, later, rng) for _ in range(300))
    assert picks["a"] == pytest.approx(150, abs=2)
    assert not {s.peer_id: s for s in w.snapshot(later)}["a"].slow
    assert w.timeouts == 1 and w.banned == 0


def test_timeouts_compound_up_to_a_cap_and_a_success_clears_them() -> None:
    rng = random.Random(RNG_SEED)
    w = measured_wiring({"a": 10.0, "b": 10.0}, WiringConfig(slow_max_factor=16.0))
    for _ in range(100):
        w.timeout("a", 0.0)
    assert {s.peer_id: s for s in w.snapshot(0.0)}["a"].slow_factor == 16.0
    picks = Counter(w.choose("forward", 16, 0.0, rng) for _ in range(170))
    assert picks["a"] == pytest.approx(10, abs=1)  # 1/17: small, not zero
    w.success("a", 16, 1.6, "forward", 0.0)
    assert {s.peer_id: s for s in w.snapshot(0.0)}["a"].slow_factor == 1.0


def test_an_error_bans_for_15_s_then_30_s_and_the_peer_comes_back() -> None:
    rng = random.Random(RNG_SEED)
    tputs = {"a": 10.0, "b": 10.0}
    w = measured_wiring(tputs)
    w.error("a", 0.0)
    w.error("a", 0.5)  # another task sent before the ban: same failure, no escalation
    assert {s.peer_id: s for s in w.snapshot(0.0)}["a"].banned_until == 15.0
    assert set(run(w, tputs, 500, 14.999, rng)) == {"b"}
    assert w.earliest_unban() == 15.0
    back = Counter(w.choose("forward", 16, 15.0, rng) for _ in range(100))  # (no outcomes)
    assert back["a"] == 50  # back, at the load of the others: its share, no catch-up burst
    w.error("a", 20.0)  # second consecutive error (no success in between): 30 s
    assert {s.peer_id: s for s in w.snapshot(20.0)}["a"].banned_until == 50.0
    assert set(run(w, tputs, 100, 49.9, rng)) == {"b"}
    assert Counter(w.choose("forward", 16, 50.0, rng) for _ in range(100))["a"] == 50
    w.error("a", 60.0)  # third consecutive error (no success since): 60 s
    assert {s.peer_id: s for s in w.snapshot(60.0)}["a"].banned_until == 120.0
    assert w.banned == 3
    w.success("a", 16, 1.6, "forward", 130.0)  # a success ends the streak
    w.error("a", 130.0)
    assert {s.peer_id: s for s in w.snapshot(130.0)}["a"].banned_until == 145.0


def test_bans_are_capped() -> None:
    cfg = WiringConfig()
    assert [cfg.ban_s(k) for k in range(1, 8)] == [15, 30, 60, 120, 240, 300, 300]
    assert cfg.ban_s(10**9) == 300.0
    w = measured_wiring({"a": 1.0})
    for k in range(200):
        w.error("a", 1000.0 * k)
    assert {s.peer_id: s for s in w.snapshot(199_000.0)}["a"].banned_until == 199_300.0


def test_a_fresh_announcement_lifts_a_ban_once_the_base_is_served() -> None:
    w = measured_wiring({"a": 10.0, "b": 10.0})
    for t in (0.0, 20.0, 60.0):  # streak 3: banned 60 s from t = 60
        w.unban("a")
        w.error("a", t)
    assert not w.reannounced("a", 70.0)
    assert w.reannounced("a", 75.0)
    assert {s.peer_id: s for s in w.snapshot(75.0)}["a"].banned_until is None
    assert {s.peer_id: s for s in w.snapshot(75.0)}["a"].error_streak == 3
    assert not w.reannounced("a", 76.0)  # not banned any more


def test_all_banned_or_nobody_means_none() -> None:
    rng = random.Random(RNG_SEED)
    w = Wiring()
    assert w.choose("forward", 1, 0.0, rng) is None
    w.update_peers({"a": (1.0, 0), "b": (1.0, 0)}, 0.0)
    w.error("a", 0.0)
    w.error("b", 1.0)
    assert w.choose("forward", 1, 2.0, rng) is None
    assert w.unavailable == 2 and w.earliest_unban() == 15.0
    assert w.choose("forward", 1, 15.0, rng) == "a"


# ---- costs and queues ----------------------------------------------------------------------

def test_a_backward_task_weighs_two_and_a_half_forward_tasks() -> None:
    rng = random.Random(RNG_SEED)
    w = measured_wiring({"a": 10.0, "b": 10.0})
    first = w.choose("backward", 16, 0.0, rng)
    other = "b" if first == "a" else "a"
    assert [w.choose("forward", 16, 0.0, rng) for _ in range(4)] == [other] * 3 + [first]


def test_with_mixed_costs_peers_split_work_not_task_counts() -> None:
    rng = random.Random(RNG_SEED)
    w = measured_wiring({"a": 10.0, "b": 10.0})
    tasks: Counter[str] = Counter()
    work: Counter[str] = Counter()
    for i in range(10_000):
        kind: Kind = "backward" if (i % 7 == 0 and rng.random() < 0.9) else "forward"
        p = w.choose(kind, 16, 0.0, rng)
        assert p is not None
        tasks[(p, kind)] += 1
        work[p] += 16 * w.config.cost(kind)
    assert abs(work["a"] - work["b"]) <= 16 * 2.5
    # each backward task a peer takes costs it 2.5 forward tasks
    f_a, b_a = tasks[("a", "forward")], tasks[("a", "backward")]
    f_b, b_b = tasks[("b", "forward")], tasks[("b", "backward")]
    assert abs((f_a + 2.5 * b_a) - (f_b + 2.5 * b_b)) <= 2.5


def test_a_backward_measurement_is_normalised_by_its_cost() -> None:
    w = Wiring()
    w.update_peers({"a": (0.0, 0), "b": (0.0, 0)}, 0.0)
    w.success("a", 16, 1.6, "forward", 0.0)
    w.success("b", 16, 4.0, "backward", 0.0)
    assert [s.throughput for s in w.snapshot(0.0)] == pytest.approx([10.0, 10.0])


def test_a_queue_shifts_choices_away() -> None:
    rng = random.Random(RNG_SEED)
    tputs = {"a": 10.0, "b": 10.0}
    w = measured_wiring(tputs, WiringConfig(queue_weight=16.0))
    w.update_peers({"a": (10.0, 10), "b": (10.0, 0)}, 0.0)
    # 10 queued tasks of 16 samples: "a" is 10 tasks behind, "b" takes them
    assert [w.choose("forward", 16, 0.0, rng) for _ in range(10)] == ["b"] * 10
    # while announced, the queue keeps "a" 10 tasks behind; it does not change the shares
    picks = run(w, tputs, 1000, 0.0, rng)
    assert picks["a"] == pytest.approx(500, abs=1)
    w.update_peers({"a": (10.0, 0), "b": (10.0, 0)}, 1.0)  # queue drained: "a" catches up
    assert [w.choose("forward", 16, 1.0, rng) for _ in range(10)] == ["a"] * 10


# ---- membership, bookkeeping, stability ----------------------------------------------------

def test_announcements_count_until_measured_and_leavers_are_dropped() -> None:
    w = Wiring()
    w.update_peers({"a": (5.0, 0), "b": (20.0, 3)}, 0.0)
    w.update_peers({"a": (8.0, 0), "b": (20.0, 1)}, 1.0)
    assert [(s.throughput, s.queue) for s in w.snapshot(1.0)] == [(8.0, 0), (20.0, 1)]
    w.success("a", 8, 2.0, "forward", 1.0)
    w.update_peers({"a": (50.0, 0), "b": (-1.0, -5), "c": (math.nan, 0)}, 2.0)
    snap = {s.peer_id: s for s in w.snapshot(2.0)}
    assert snap["a"].throughput == 4.0 and snap["a"].measured
    assert (snap["b"].throughput, snap["b"].queue) == (20.0, 0)  # garbage counts as none
    assert snap["c"].throughput == pytest.approx(12.0)  # median of the others
    w.update_peers({"c": (1.0, 0)}, 3.0)
    assert len(w) == 1
    w.success("a", 1, 1.0, "forward", 3.0)  # outcomes for leavers are ignored
    w.timeout("a", 3.0)
    w.error("a", 3.0)
    assert w.banned == 0 and w.timeouts == 0


def test_exact_ties_are_broken_at_random_and_choices_are_reproducible() -> None:
    def first(seed: int) -> str | None:
        w = Wiring()
        w.update_peers({"a": (1.0, 0), "b": (1.0, 0)}, 0.0)
        return w.choose("forward", 1, 0.0, random.Random(seed))
    picks = Counter(first(seed) for seed in range(200))
    assert picks["a"] > 50 and picks["b"] > 50
    assert [first(s) for s in range(20)] == [first(s) for s in range(20)]


def test_a_million_choices_keep_loads_small_and_finite() -> None:
    rng = random.Random(RNG_SEED)
    tputs = {"a": 1.0, "b": 37.5, "c": 1000.0}
    w = measured_wiring(tputs, WiringConfig(slow_half_life_s=1.0))
    w.timeout("b", 0.0)
    n, choose = 1_000_000, w.choose
    work = dict.fromkeys(tputs, 0.0)
    for i in range(n):
        backward = i % 3 == 0
        p = choose("backward" if backward else "forward", 16, i * 1e-3, rng)
        work[p] += 40.0 if backward else 16.0  # type: ignore[index]
    snap = w.snapshot(n * 1e-3)
    assert all(math.isfinite(s.load) and 0.0 <= s.load < 1100.0 for s in snap)
    assert sum(s.chosen for s in snap) == w.chosen == n
    # the slow factor decays within seconds: the work splits in the plain ratio
    total = sum(work.values())
    assert work["c"] / total == pytest.approx(1000 / 1038.5, rel=1e-3)
    assert work["a"] / total == pytest.approx(1 / 1038.5, rel=0.02)


def test_absurd_measurements_keep_every_load_finite() -> None:
    rng = random.Random(RNG_SEED)
    w = Wiring()
    w.update_peers({"a": (1e-300, 0), "b": (1e300, 0)}, 0.0)
    assert [s.throughput for s in w.snapshot(0.0)] == [1e300, 1e300]  # 1e-300: as if none
    w.success("a", 1, 1e300, "forward", 0.0)
    w.success("b", 1, 1e-300, "forward", 0.0)
    for i in range(10_000):
        w.choose("forward", 32, float(i), rng)
    assert all(math.isfinite(s.load) and math.isfinite(s.throughput) for s in w.snapshot(0.0))


@pytest.mark.parametrize("bad", [
    {"backward_cost": 0.0}, {"backward_cost": math.nan}, {"ema_alpha": 0.0},
    {"ema_alpha": 1.5}, {"prior_throughput": 0.0}, {"prior_throughput": math.inf},
    {"slow_penalty": 0.5}, {"slow_half_life_s": 0.0}, {"slow_max_factor": 1.5},
    {"ban_base_s": 0.0}, {"ban_base_s": 400.0}, {"ban_max_s": math.inf},
    {"queue_weight": -1.0},
])
def test_bad_config_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="WiringConfig"):
        WiringConfig(**bad)


def test_bad_arguments_are_refused() -> None:
    w = measured_wiring({"a": 1.0})
    rng = random.Random(RNG_SEED)
    with pytest.raises(ValueError):
        w.choose("sideways", 1, 0.0, rng)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        w.choose("forward", 0, 0.0, rng)


def test_a_peer_never_measured_follows_the_others_and_is_not_starved() -> None:
    # all three announce nothing (0); two get measured fast before the third is ever chosen:
    # the third's prior must follow them, or it would look 100x slower and never be tried
    w = Wiring()
    rng = random.Random(0)
    peers = {"a": (0.0, 0), "b": (0.0, 0), "c": (0.0, 0)}
    w.update_peers(peers, 0.0)
    for _ in range(20):
        for p in ("a", "b"):
            w.success(p, 8, 0.08, "forward", 1.0)  # 100 samples/s
    w.update_peers(peers, 1.0)
    picks = Counter(w.choose("forward", 8, 1.0, rng) for _ in range(30))
    # tried at once, up to its probing share while unanswered (measured beats claimed)
    assert picks["c"] == w.config.probe_tasks, picks
    for _ in range(picks["c"]):
        w.success("c", 8, 0.08, "forward", 1.5)
    picks = Counter(w.choose("forward", 8, 1.5, rng) for _ in range(30))
    assert 7 <= picks["c"] <= 13, picks  # answered as fast as the others: a third


# ---- busy: backpressure, not a fault ---------------------------------------------------------
def test_busy_pauses_a_peer_briefly_without_a_ban_and_others_take_the_work() -> None:
    rng = random.Random(RNG_SEED)
    w = Wiring()
    w.update_peers({"a": (1.0, 0), "b": (1.0, 0)}, 0.0)
    w.busy("a", 0.0)
    assert [w.choose("forward", 1, 0.1, rng) for _ in range(5)] == ["b"] * 5
    (a, b) = w.snapshot(0.1)
    assert a.busy == 1 and a.busy_until == 0.25 and a.banned_until is None
    assert a.error_streak == 0 and w.banned == 0
    # back after the pause, at the others' load: no burst of the work it missed
    picks = [w.choose("forward", 1, 0.3, rng) for _ in range(10)]
    assert picks.count("a") == 5 and picks.count("b") == 5


def test_busy_pauses_double_while_a_peer_stays_busy_and_a_success_resets_them() -> None:
    w = Wiring()
    w.update_peers({"a": (1.0, 0)}, 0.0)
    w.busy("a", 0.0)
    w.busy("a", 0.1)  # sent before the pause: same episode
    assert w.available_at(0.1) == 0.25
    w.busy("a", 0.25)
    assert w.available_at(0.25) == 0.75
    w.busy("a", 0.75)
    w.busy("a", 1.75)
    w.busy("a", 3.75)
    assert w.available_at(3.75) == 5.75  # capped at busy_max_s
    assert w.choose("forward", 1, 4.0, random.Random(0)) is None
    w.success("a", 1, 0.1, "forward", 6.0)
    w.busy("a", 6.0)
    assert w.available_at(6.0) == 6.25
    assert w.banned == 0 and w.snapshot(6.0)[0].error_streak == 0


@settings(max_examples=50, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["busy", "error", "timeout", "success",
                                                   "choose"]),
                                 st.sampled_from(["a", "b", "c"]),
                                 st.floats(0.0, 5.0)), max_size=60))
def test_busy_never_bans_and_availability_is_never_in_the_past(events: list) -> None:
    w = Wiring()
    w.update_peers({"a": (1.0, 0), "b": (2.0, 0), "c": (3.0, 0)}, 0.0)
    rng, now = random.Random(0), 0.0
    errors = 0
    for what, peer, dt in events:
        now += dt
        if what == "busy":
            w.busy(peer, now)
        elif what == "error":
            errors += 1
            w.error(peer, now)
        elif what == "timeout":
            w.timeout(peer, now)
        elif what == "success":
            w.success(peer, 1, 0.5, "forward", now)
        else:
            chosen = w.choose("forward", 1, now, rng)
            at = w.available_at(now)
            assert at is not None and at >= now
            assert (chosen is None) == (at > now)
        assert w.banned <= errors
    assert all(math.isfinite(s.load) for s in w.snapshot(now))


def test_excluded_peers_are_not_chosen_and_nobody_left_means_none() -> None:
    rng = random.Random(RNG_SEED)
    w = Wiring()
    w.update_peers({"a": (100.0, 0), "b": (1.0, 0)}, 0.0)
    assert {w.choose("forward", 1, 0.0, rng, exclude={"a"}) for _ in range(5)} == {"b"}
    assert w.choose("forward", 1, 0.0, rng, exclude={"a", "b"}) is None


# ---- measured beats claimed (issue 28) ------------------------------------------------------
@given(claim=st.floats(min_value=1e-3, max_value=1e300, allow_nan=False),
       honest=st.floats(min_value=1.0, max_value=1e4), tasks=st.integers(1, 200),
       seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_no_claim_gets_an_unanswering_peer_more_than_its_probes_or_its_cap(
        claim: float, honest: float, tasks: int, seed: int) -> None:
    w = Wiring()
    rng = random.Random(seed)
    w.update_peers({"honest": (honest, 0)}, 0.0)
    w.success("honest", 8, 8 / honest, "forward", 0.0)  # measured at `honest` samples/s
    w.update_peers({"honest": (honest, 0), "liar": (claim, 0)}, 1.0)
    picks = Counter(w.choose("forward", 8, 1.0, rng) for _ in range(tasks))
    # before it answered anything: its probes at most, whatever it announced
    assert picks["liar"] <= w.config.probe_tasks
    assert picks["honest"] == tasks - picks["liar"]  # the rest went to the measured peer


def test_a_liar_claiming_1e12_gets_its_probes_then_nothing_until_it_answers() -> None:
    w = Wiring()
    rng = random.Random(RNG_SEED)
    w.update_peers({"honest": (100.0, 0)}, 0.0)
    w.success("honest", 8, 0.08, "forward", 0.0)
    w.update_peers({"honest": (100.0, 0), "liar": (1e12, 0)}, 1.0)
    picks = [w.choose("forward", 8, 1.0, rng) for _ in range(50)]
    assert picks.count("liar") == w.config.probe_tasks
    assert picks[-10:] == ["honest"] * 10
    for _ in range(w.config.probe_tasks):  # its probes time out: slow, and probes again
        w.timeout("liar", 70.0)
    picks = [w.choose("forward", 8, 70.0, rng) for _ in range(50)]
    assert picks.count("liar") <= w.config.probe_tasks
    # alone in its stage, a claim is all there is: it gets the work
    w.update_peers({"liar": (1e12, 0)}, 80.0)
    assert w.choose("forward", 8, 80.0, rng) == "liar"


def test_a_newcomer_that_answers_busy_at_first_is_tried_again_after_its_pause() -> None:
    # a peer that just migrated to the stage answers busy while it is a step behind
    # (Forward.at): each busy answer ends a probe, or after probe_tasks of them it would never
    # be chosen again beside a measured peer (seen: a mover idle for minutes)
    w = Wiring()
    rng = random.Random(RNG_SEED)
    w.update_peers({"old": (100.0, 0)}, 0.0)
    w.success("old", 8, 0.08, "forward", 0.0)
    w.update_peers({"old": (100.0, 0), "new": (100.0, 0)}, 1.0)
    now = 1.0
    for _ in range(3 * w.config.probe_tasks):  # busy every time it is tried
        picks = [w.choose("forward", 8, now, rng) for _ in range(10)]
        assert "new" in picks, picks
        for _ in range(picks.count("new")):
            w.busy("new", now)
        now += w.config.busy_max_s  # its pause is over
    picks = [w.choose("forward", 8, now, rng) for _ in range(10)]
    assert 1 <= picks.count("new") <= w.config.probe_tasks
    w.success("new", 8, 0.08, "forward", now)  # caught up: measured, a full share
    picks = [w.choose("forward", 8, now, rng) for _ in range(40)]
    assert 15 <= picks.count("new") <= 25, picks


@given(outcomes=st.lists(st.sampled_from(["busy", "timeout", "error", "released", "success"]),
                         min_size=1, max_size=40), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_every_outcome_frees_the_probe_of_the_task_it_ends(outcomes: list[str],
                                                           seed: int) -> None:
    w = Wiring(WiringConfig(ban_base_s=0.001, ban_max_s=0.001))
    rng = random.Random(seed)
    w.update_peers({"old": (100.0, 0)}, 0.0)
    w.success("old", 8, 0.08, "forward", 0.0)
    w.update_peers({"old": (100.0, 0), "new": (100.0, 0)}, 0.0)
    now = 0.0
    for outcome in outcomes:
        now += 10.0  # past any pause, ban or slow spell
        if outcome == "success":
            return  # measured: no longer a probe
        for _ in range(1000):  # the newcomer is tried again once its task ended
            picked = w.choose("forward", 8, now, rng)
            assert picked is not None
            if picked == "new":
                break
            w.success("old", 8, 0.08, "forward", now)
        else:
            raise AssertionError(f"never tried again after {outcomes}")
        if outcome == "busy":
            w.busy("new", now)
        elif outcome == "timeout":
            w.timeout("new", now)
        elif outcome == "error":
            w.error("new", now)
        else:
            w.released("new")


def test_a_claim_counts_at_most_claim_multiple_times_the_best_measured_peer() -> None:
    cfg = WiringConfig(probe_tasks=1000)
    w = Wiring(cfg)
    rng = random.Random(RNG_SEED)
    w.update_peers({"honest": (100.0, 0)}, 0.0)
    w.success("honest", 8, 0.08, "forward", 0.0)
    w.update_peers({"honest": (100.0, 0), "big": (1e12, 0)}, 1.0)
    picks = Counter(w.choose("forward", 8, 1.0, rng) for _ in range(300))
    share = picks["big"] / 300  # 2 : 1 at most, not a million to one
    assert 0.55 <= share <= 0.72, picks
