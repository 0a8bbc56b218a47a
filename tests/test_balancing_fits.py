"""The balancer and placement skip stages a peer cannot hold (``limits.device_memory_bytes``,
issue 15). Pure."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_balancing import CONFIG, load_of, swarms

from swarmd.balancing.placement import choose_stage
from swarmd.balancing.policy import (
    Balancer, BalancingConfig, SwarmLoad, decide, fill_plan, swarm_gain,
)


def test_a_peer_whose_target_does_not_fit_goes_to_the_next_deficit_that_fits() -> None:
    load = load_of([[10.0] * 14, [10.0] * 9, [10.0] * 7])  # level 100: deficits 10 (1), 30 (2)
    assert decide(load, "s0-000", CONFIG).move_to == 2
    d = decide(load, "s0-000", CONFIG, fits={0, 1})  # stage 2 is too big for it
    assert (d.move_to, d.reason) == (1, "move")
    assert decide(load, "s0-003", CONFIG, fits={0, 2}).move_to == 2  # and the other way


def test_a_peer_that_fits_no_deficit_stays() -> None:
    load = load_of([[10.0] * 14, [10.0] * 9, [10.0] * 7])
    d = decide(load, "s0-000", CONFIG, fits={0})
    assert (d.move_to, d.reason) == (None, "does_not_fit")
    # a deficit that fits but is too close to its stage's total to be worth the move stays
    # subject to the overshoot rule: nothing is forced
    near = load_of([[10.0] * 12, [10.0] * 9, [10.0] * 9])  # level 100
    assert decide(near, "s0-000", CONFIG).move_to == 1
    for fits in ({0, 2}, {0}):
        d = decide(near, "s0-000", CONFIG, fits=fits)
        assert d.move_to in (None, 2) and (d.move_to is None) == (d.reason != "move")


def test_the_balancer_passes_what_fits_on() -> None:
    load = load_of([[10.0] * 14, [10.0] * 9, [10.0] * 7])
    b = Balancer("s0-000", BalancingConfig(confirmations=1))
    assert b.check(load, 0.0, fits={0, 1}) == 1
    assert b.check(load, 1.0, fits={0}) is None and b.last is not None
    assert b.last.reason == "does_not_fit"


@settings(max_examples=300, deadline=None)
@given(swarms(), st.sampled_from([0.0, 0.05, 0.3]), st.data())
def test_no_move_goes_to_a_stage_that_does_not_fit_and_every_move_is_safe(
        load: SwarmLoad, threshold: float, data: st.DataObject) -> None:
    assume(not fill_plan(load))  # filling an empty stage: test_balancing_empty.py
    config = BalancingConfig(threshold=threshold)
    fits = data.draw(st.sets(st.integers(0, load.stages - 1)))
    planned = load.planned_totals()
    level = sum(planned) / len(planned)
    for p in load.peers():
        unfiltered = decide(load, p.peer_id, config)
        d = decide(load, p.peer_id, config, fits=fits)
        assert decide(load, p.peer_id, config, fits=range(load.stages)) == unfiltered
        if d.move_to is None:
            continue
        assert d.move_to in fits
        assert unfiltered.move_to is not None  # fits only narrows who moves where
        a, t = p.stage, p.throughput
        assert swarm_gain(load) > threshold
        assert planned[a] > level > planned[d.move_to]  # from above the level to below it
        assert planned[a] - t > planned[d.move_to]     # the lower of the two rises


def test_a_newcomer_is_placed_on_the_bottleneck_it_can_hold() -> None:
    rng = random.Random(0)
    assert choose_stage([5.0, 1.0, 3.0], [2, 1, 1], rng) == 1
    assert choose_stage([5.0, 1.0, 3.0], [2, 1, 1], rng, fits={0, 2}) == 2
    assert choose_stage([5.0, 1.0, 3.0], [2, 1, 1], rng, fits=range(3)) == 1
    with pytest.raises(ValueError):
        choose_stage([5.0, 1.0, 3.0], [2, 1, 1], rng, fits=set())


def test_stages_that_fit_sizes_each_stage_without_memory() -> None:
    """The demo model in 2 stages: stage 1 1.59 MB of parameters, stage 0 1.75 MB (it holds
    the embedding), 4x that with gradients and AdamW's moments (6.3 and 7.0 MB): a 7.5 MB
    cap holds either, a 7 MB one stage 1 only, a 6 MB one neither."""
    import os

    import torch

    from swarmd.config import load_config
    from swarmd.local.demo import DEMO_ENV
    from swarmd.node.host_options import stages_that_fit

    env = {**os.environ, **DEMO_ENV, "SWARMD_SWARM_STAGES": "2"}
    assert stages_that_fit(load_config(None, env), torch.float32) is None  # no cap
    assert stages_that_fit(load_config(None, {**env, "SWARMD_LIMITS_DEVICE_MEMORY_BYTES":
                                              "7500000"}), torch.float32) == {0, 1}
    assert stages_that_fit(load_config(None, {**env, "SWARMD_LIMITS_DEVICE_MEMORY_BYTES":
                                              "7000000"}), torch.float32) == {1}
    assert stages_that_fit(load_config(None, {**env, "SWARMD_LIMITS_DEVICE_MEMORY_BYTES":
                                              "6000000"}), torch.float32) == frozenset()
