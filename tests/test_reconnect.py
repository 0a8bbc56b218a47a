from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.node.reconnect import Backoff, Redialer


@given(st.integers(0, 200), st.integers(0, 2**32))
def test_delays_grow_and_stay_bounded(failures: int, seed: int) -> None:
    b = Backoff(initial_s=1, max_s=60, jitter=0.2)
    d = b.delay(failures, random.Random(seed))
    assert d == 0 if failures == 0 else 0.8 <= d <= 72


def test_delay_sequence_doubles_until_the_cap() -> None:
    b = Backoff(initial_s=1, max_s=8, jitter=0)
    assert [b.delay(n, random.Random(0)) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]


def test_redialer_waits_after_failures_and_resets_on_success() -> None:
    r, rng = Redialer(Backoff(initial_s=1, max_s=8, jitter=0)), random.Random(0)
    assert r.should_dial(0.0, connected_peers=0, has_bootstrap=True)
    assert not r.should_dial(0.0, connected_peers=3, has_bootstrap=True)
    assert not r.should_dial(0.0, connected_peers=0, has_bootstrap=False)
    assert r.failed(0.0, rng) == 1 and not r.should_dial(0.5, 0, True) and r.should_dial(1.0, 0, True)
    assert r.failed(1.0, rng) == 2 and r.next_attempt == 3.0
    r.succeeded()
    assert r.should_dial(1.5, 0, True)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(initial_s=0)
    with pytest.raises(ValueError):
        Backoff(initial_s=10, max_s=1)
    with pytest.raises(ValueError):
        Backoff(jitter=1.5)
