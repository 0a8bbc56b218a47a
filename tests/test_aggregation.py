"""The pure cores of averaging: aggregators, the finite check, part planning, repair rules,
the table of rounds (no event loop, no network)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.averaging.aggregation import (
    Aggregator,
    BadGradient,
    centered_clip,
    check_finite,
    coordinate_median,
    weighted_mean,
)
from swarmd.averaging.plan import PartState, PartValue, RoundPlan, pick_relayed, plan_parts
from swarmd.averaging.rounds import AveragerOptions, Refusal, RoundTable
from transport.counters import Counters

weights_st = st.lists(st.floats(min_value=0.1, max_value=100.0), min_size=1, max_size=6)


def _vectors(n: int, d: int = 64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=g) for _ in range(n)]


# ---- weighted mean ------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(weights=weights_st, seed=st.integers(0, 2**16))
def test_weighted_mean_matches_float64_reference(weights: list[float], seed: int) -> None:
    xs = _vectors(len(weights), seed=seed)
    got = weighted_mean(xs, weights)
    ref = sum(w * x.double() for w, x in zip(weights, xs)) / sum(weights)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6)


def test_weighted_mean_of_equal_vectors_is_that_vector_and_inputs_untouched() -> None:
    x = torch.randn(100)
    copies = [x.clone() for _ in range(3)]
    assert torch.equal(weighted_mean(copies, [1.0, 2.0, 5.0]), x)
    assert all(torch.equal(c, x) for c in copies)


def test_weights_are_respected() -> None:
    a, b = torch.zeros(4), torch.ones(4)
    assert torch.allclose(weighted_mean([a, b], [3.0, 1.0]), torch.full((4,), 0.25))
    assert torch.equal(weighted_mean([a, b], [0.0, 1.0]), b)  # weight 0 contributes nothing


@pytest.mark.parametrize("weights", [[0.0, 0.0], [-1.0, 2.0], [math.nan, 1.0], [math.inf, 1.0]])
def test_bad_weights_are_refused(weights: list[float]) -> None:
    with pytest.raises(ValueError):
        weighted_mean(_vectors(2), weights)


def test_mismatched_shapes_and_dtypes_are_refused() -> None:
    with pytest.raises(ValueError):
        weighted_mean([torch.zeros(3), torch.zeros(4)], [1.0, 1.0])
    with pytest.raises(ValueError):
        weighted_mean([torch.zeros(3, dtype=torch.float64)], [1.0])
    with pytest.raises(ValueError):
        weighted_mean([], [])


# ---- non-finite contributions ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_is_refused_with_a_typed_error(bad: float) -> None:
    x = torch.randn(50)
    check_finite(x)
    x[7] = bad
    with pytest.raises(BadGradient) as info:
        check_finite(x, who="peer-x")
    assert info.value.code == "bad_gradient" and info.value.reason == "non_finite"
    assert "peer-x" in str(info.value)


# ---- CenteredClip ---------------------------------------------------------------------------

def test_coordinate_median_odd_and_even() -> None:
    xs = [torch.tensor([1.0, 5.0]), torch.tensor([2.0, -1.0]), torch.tensor([9.0, 0.0])]
    assert torch.equal(coordinate_median(xs), torch.tensor([2.0, 0.0]))
    assert torch.equal(coordinate_median(xs[:2]), torch.tensor([1.5, 2.0]))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_centered_clip_equals_the_mean_when_all_agree(n: int, seed: int) -> None:
    base = torch.randn(256, generator=torch.Generator().manual_seed(seed))
    xs = [base + 0.01 * v for v in _vectors(n, d=256, seed=seed + 1)]
    weights = [1.0 + i for i in range(n)]
    assert torch.allclose(centered_clip(xs, weights), weighted_mean(xs, weights), atol=1e-5)
    same = [base.clone() for _ in range(n)]
    assert torch.allclose(centered_clip(same, weights), base)


@pytest.mark.parametrize("scale", [1e3, 1e6])
@pytest.mark.parametrize("who", [0, 1, 2])
def test_centered_clip_bounds_a_1000x_outlier(scale: float, who: int) -> None:
    """Three equal-weight peers, one sends its gradient ``scale`` times too large: the result
    moves from the honest mean by at most the honest peers' own spread, whatever ``scale`` is;
    the plain mean is wrecked."""
    honest = _vectors(3, d=1000, seed=7)
    xs = list(honest)
    xs[who] = honest[who] * scale
    good = [x for i, x in enumerate(honest) if i != who]
    honest_mean = weighted_mean(good, [1.0, 1.0])
    spread = float(torch.dist(good[0], good[1]))
    robust = centered_clip(xs, [1.0, 1.0, 1.0])
    assert float(torch.dist(robust, honest_mean)) <= spread
    assert float(torch.dist(weighted_mean(xs, [1.0] * 3), honest_mean)) > 100 * spread


def test_centered_clip_with_explicit_tau_moves_at_most_tau_per_step() -> None:
    xs = [torch.zeros(10), torch.zeros(10), torch.full((10,), 1e9)]
    out = centered_clip(xs, [1.0, 1.0, 1.0], tau=1.0, iters=3)
    assert float(out.norm()) <= 3.0


def test_aggregator_by_name() -> None:
    xs, ws = _vectors(3), [1.0, 2.0, 3.0]
    assert torch.equal(Aggregator.parse("mean")(xs, ws), weighted_mean(xs, ws))
    assert torch.equal(Aggregator.parse("centered_clip")(xs, ws), centered_clip(xs, ws))
    with pytest.raises(ValueError):
        Aggregator.parse("median-of-means")
    with pytest.raises(ValueError):
        Aggregator(name="centered_clip", tau=-1.0)


# ---- part planning --------------------------------------------------------------------------

bandwidth_st = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e4),
                         st.sampled_from([math.nan, math.inf, -5.0]))


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 10**8), bws=st.lists(bandwidth_st, min_size=1, max_size=12),
       min_part=st.integers(0, 10**4))
def test_plan_parts_sums_exactly_and_respects_the_minimum(total: int, bws: list, min_part: int
                                                         ) -> None:
    parts = plan_parts(total, bws, min_part=min_part)
    assert len(parts) == len(bws) and sum(parts) == total
    assert min(parts) >= min(min_part, total // len(bws))


@settings(max_examples=200, deadline=None)
@given(total=st.integers(10**5, 10**8),
       bws=st.lists(st.floats(min_value=1.0, max_value=100.0), min_size=1, max_size=8))
def test_plan_parts_is_proportional(total: int, bws: list[float]) -> None:
    parts = plan_parts(total, bws, min_part=0)
    for p, b in zip(parts, bws):
        assert abs(p - total * b / sum(bws)) <= 1.0


def test_plan_parts_equal_when_unknown_and_floor_for_slow_peers() -> None:
    assert plan_parts(10, [None, None, None], min_part=0) == [4, 3, 3]
    assert plan_parts(9, [None] * 3) == [3, 3, 3]
    # a peer 1000x slower still gets the floor; the others share the rest 1:2
    assert plan_parts(100_000, [0.001, 1.0, 2.0], min_part=1000) == [1000, 33000, 66000]


def test_units_cut_parts_into_chunks_listed_round_robin() -> None:
    plan = RoundPlan.build("r", ["a", "b"], 10, parts=[7, 3], chunk=3)
    assert [(u.owner, u.start, u.length) for u in plan.units] == [
        (0, 0, 3), (1, 7, 3), (0, 3, 2), (0, 5, 2)]
    assert plan.chain(1) == [(1, 0)] and plan.chain(3) == [(1, 1)]
    empty = RoundPlan.build("r", ["a", "b"], 4, parts=[0, 4])
    assert [u.owner for u in empty.units] == [1]
    assert plan.digest != RoundPlan.build("r", ["a", "b"], 10, parts=[7, 3], chunk=4).digest


def test_round_plan_sorts_the_group_and_checks_parts() -> None:
    plan = RoundPlan.build("r", ["c", "a", "b"], 10, bandwidths=[1.0, 3.0, 1.0], min_part=0)
    assert plan.group == ("a", "b", "c") and plan.parts == (6, 2, 2)  # a had bandwidth 3
    assert plan.units[1].span == slice(6, 8) and plan.index("c") == 2
    assert plan.chain(2) == [(1, 0), (2, 1)]
    assert plan.digest == RoundPlan.build("r", ["a", "b", "c"], 10, parts=[6, 2, 2]).digest
    assert plan.digest != RoundPlan.build("r2", ["a", "b", "c"], 10, parts=[6, 2, 2]).digest
    with pytest.raises(ValueError):
        RoundPlan.build("r", ["a", "b"], 10, parts=[5, 4])
    with pytest.raises(ValueError):
        RoundPlan(round_id="r", group=("b", "a"), parts=(1, 1))
    with pytest.raises(ValueError):
        plan.index("z")


# ---- the repair rules -----------------------------------------------------------------------

def _value(epoch: int) -> PartValue:
    return PartValue(torch.zeros(2), epoch, 1.0, (0,))


def test_a_probed_peer_refuses_older_values_and_keeps_the_first() -> None:
    state = PartState()
    state.raise_floor(1)
    assert not state.offer(_value(0)) and state.value is None and state.refused == [0]
    first = _value(1)
    assert state.offer(first) and not state.offer(_value(2)) and state.value is first


def test_a_repairer_relays_the_latest_value_found() -> None:
    assert pick_relayed([]) is None
    assert pick_relayed([_value(0), _value(2), _value(1)]).epoch == 2  # type: ignore[union-attr]


# ---- the round table: bounded buffering, no reuse of round ids ------------------------------

def _table(**options: float) -> RoundTable:
    return RoundTable(AveragerOptions(**options), Counters())  # type: ignore[arg-type]


def test_messages_for_unknown_rounds_are_buffered_within_bounds() -> None:
    table = _table(max_pending_rounds=2, max_pending_bytes=100)
    a = table.lookup("a", "d1", "contribute", 10, now=0.0)
    assert a.plan is None and table.lookup("a", "d1", "probe", 0, now=0.0) is a
    table.lookup("b", "d1", "probe", 0, now=0.0)
    with pytest.raises(Refusal) as full:
        table.lookup("c", "d1", "contribute", 10, now=0.0)
    assert full.value.code == "busy"
    a.pending_bytes = 95
    with pytest.raises(Refusal) as heavy:
        table.lookup("a", "d1", "contribute", 10, now=0.0)
    assert heavy.value.code == "busy"
    with pytest.raises(Refusal) as repair:  # nothing to repair before joining
        table.lookup("z", "d1", "repair", 0, now=0.0)
    assert repair.value.code == "not_joined"
    with pytest.raises(Refusal) as other:
        table.lookup("a", "d2", "probe", 0, now=0.0)
    assert other.value.code == "plan_mismatch"
    table.expire(now=1e6)  # nobody joined them: gone
    assert table.lookup("c", "d1", "contribute", 10, now=1e6).plan is None


def test_a_declined_round_refuses_its_messages_at_once_and_wakes_what_it_buffered() -> None:
    """The local peer refused the round's start: a member's contribution waiting in the
    buffer is refused now, and later ones at once (their units are repaired, not waited
    for until a deadline); a round declined before any message came is refused too."""
    table = _table()
    pending = table.lookup("r", "d", "contribute", 10, now=0.0)

    async def scenario() -> str:
        waiting = asyncio.ensure_future(table.wait_joined(pending, 30.0))
        await asyncio.sleep(0)
        table.decline("r")
        try:
            await asyncio.wait_for(waiting, 5.0)
        except Refusal as exc:
            return exc.code
        return "joined"

    assert asyncio.run(scenario()) == "not_joined"
    table.decline("s")
    for r in ("r", "s"):
        with pytest.raises(Refusal) as later:
            table.lookup(r, "d", "probe", 0, now=1.0)
        assert later.value.code == "not_joined"


def test_joining_takes_over_what_was_buffered_and_round_ids_are_never_reused() -> None:
    plan = RoundPlan.build("r", ["a", "b", "c"], 12, parts=[4, 4, 4])
    table = _table(retain_s=1.0)
    pending = table.lookup("r", plan.digest, "contribute", 16, now=0.0)
    pending.pending[(0, "b")] = (torch.ones(4), 2.0)  # b's slice of a's unit
    pending.pending[(1, "b")] = (torch.ones(4), 2.0)  # not for a: dropped
    pending.pending[(0, "c")] = (torch.ones(4), 99.0)  # more samples than possible: dropped
    pending.pending[(0, "zz")] = (torch.ones(4), 1.0)  # not a member: dropped
    pending.pending_floors[(1, "c")] = 1  # c repairs b's unit at epoch 1
    pending.pending_floors[(2, "c")] = 2  # but not unit 2 (its own) at epoch 2: dropped
    pending.pending_floors[(1, "zz")] = 2  # an outsider's probe: dropped
    rnd = table.join(plan, 0, now=1.0, deadline_s=10.0, max_weight=10.0)
    assert rnd is pending and list(rnd.units[0].contributions) == ["b"]
    assert not rnd.units[1].contributions and rnd.units[1].state.floor == 1
    assert rnd.units[2].state.floor == 0
    assert table.counters.get("bad_requests.not_repairer") == 2
    assert table.counters.get("bad_requests.bad_weight") == 1
    assert table.counters.get("bad_requests.wrong_part") == 2
    assert rnd.gather_at == 6.0 and rnd.reply_at == 8.0 and rnd.deadline == 11.0
    with pytest.raises(ValueError):
        table.join(plan, 0, now=2.0, deadline_s=10.0)
    table.finish(rnd)
    assert table.lookup("r", plan.digest, "probe", 0, now=5.0) is rnd  # still answers
    table.expire(now=20.0)
    with pytest.raises(Refusal) as gone:
        table.lookup("r", plan.digest, "contribute", 16, now=20.0)
    assert gone.value.code == "round_finished"
    with pytest.raises(ValueError):
        table.join(plan, 0, now=20.0, deadline_s=10.0)
