from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.balancing.placement import choose_stage


def test_lowest_throughput_wins() -> None:
    assert choose_stage([30.0, 11.3, 40.5], [2, 2, 2], random.Random(0)) == 1


def test_before_measurements_the_emptiest_stage_wins() -> None:
    assert choose_stage([0.0, 0.0, 0.0], [3, 0, 1], random.Random(0)) == 1


def test_newcomers_joining_one_by_one_fill_every_stage() -> None:
    peers, rng = [0, 0, 0, 0], random.Random(1)
    for _ in range(8):
        peers[choose_stage([0.0] * 4, peers, rng)] += 1
    assert peers == [2, 2, 2, 2]


def test_exact_ties_are_spread_at_random() -> None:
    picks = Counter(choose_stage([1.0, 1.0], [1, 1], random.Random(seed)) for seed in range(200))
    assert picks[0] > 50 and picks[1] > 50


@given(st.lists(st.tuples(st.floats(0, 1e6), st.integers(0, 100)), min_size=1, max_size=16),
       st.integers(0, 2**32))
def test_the_choice_is_never_beaten(stages: list[tuple[float, int]], seed: int) -> None:
    totals, peers = [t for t, _ in stages], [p for _, p in stages]
    s = choose_stage(totals, peers, random.Random(seed))
    assert all((totals[s], peers[s]) <= (totals[i], peers[i]) for i in range(len(stages)))


def test_mismatched_input_is_refused() -> None:
    with pytest.raises(ValueError):
        choose_stage([], [], random.Random(0))
    with pytest.raises(ValueError):
        choose_stage([1.0], [1, 2], random.Random(0))


# ---- a restart with checkpoints in the home -----------------------------------------------------

def test_a_restarting_peer_serves_its_checkpoint_stage_again() -> None:
    from swarmd.balancing.placement import place

    # a whole swarm restarting: nobody is back yet, or the others are on their own stages
    for seed in range(20):
        assert place({1}, [0.0, 0.0, 0.0], [0, 0, 0], random.Random(seed)).stage == 1
    # the peer of stage 1 is back but still loading its state: stage 1 is not empty
    assert place({2}, [5.0, 0.0, 9.0], [1, 0, 1], random.Random(0),
                 present=[1, 1, 1]).stage == 2
    # its stage is the bottleneck or not: the checkpoint wins over throughput
    assert place({0}, [50.0, 3.0], [2, 1], random.Random(0)).stage == 0
    assert place({0}, [50.0, 3.0], [2, 1], random.Random(0)).reason == "checkpoint"


def test_it_goes_where_the_swarm_clearly_needs_it_while_its_stage_is_held() -> None:
    from swarmd.balancing.placement import place

    moved = place({0}, [50.0, 0.0, 8.0], [2, 0, 1], random.Random(0))
    assert (moved.stage, moved.reason) == (1, "needed")
    # but not when its stage's state would be lost: nobody else holds stage 0
    kept = place({0}, [0.0, 0.0, 8.0], [0, 0, 1], random.Random(0))
    assert (kept.stage, kept.reason) == (0, "checkpoint")


def test_of_several_checkpoints_the_neediest_stage_and_only_stages_that_fit() -> None:
    from swarmd.balancing.placement import place

    assert place({0, 2}, [9.0, 9.0, 1.0], [3, 1, 1], random.Random(0)).stage == 2
    # a checkpoint of a stage this swarm does not have, or that does not fit: the bottleneck
    other = place({7}, [4.0, 1.0], [1, 1], random.Random(0))
    assert (other.stage, other.reason) == (1, "bottleneck")
    assert place({0}, [4.0, 1.0], [1, 1], random.Random(0), fits={1}).stage == 1
