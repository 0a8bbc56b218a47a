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
