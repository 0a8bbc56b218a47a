"""Deadlines of requests whose reply waits on the peer's work (swarmd.pipeline.held)."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.links import LinkEstimates
from swarmd.pipeline.held import DOWNSTREAM_RETRY_S, HELD_SLACK, HOP_TIMEOUT_S, HeldTimes


def test_an_unmeasured_peer_gets_the_whole_cap_and_a_measured_one_what_it_held() -> None:
    links, held = LinkEstimates(), HeldTimes()
    assert held.deadline(links, "a", 1000) == HOP_TIMEOUT_S
    held.observe("a", 0.5)
    d = held.deadline(links, "a", 1000)
    assert HELD_SLACK * 0.5 + DOWNSTREAM_RETRY_S <= d < HOP_TIMEOUT_S
    assert held.deadline(links, "b", 1000) == HOP_TIMEOUT_S  # per peer


def test_slower_holds_lengthen_the_deadline_up_to_the_cap() -> None:
    links, held = LinkEstimates(), HeldTimes()
    held.observe("a", 0.1)
    fast = held.deadline(links, "a", 1000)
    for _ in range(20):
        held.observe("a", 8.0)
    slow = held.deadline(links, "a", 1000)
    assert fast < slow <= HOP_TIMEOUT_S
    for _ in range(20):
        held.observe("a", 100.0)
    assert held.deadline(links, "a", 1000) == HOP_TIMEOUT_S
    assert held.deadline(links, "a", 1000, cap_s=20.0) == 20.0


def test_bad_measurements_are_ignored_and_the_table_is_bounded() -> None:
    held = HeldTimes(keep=3)
    for bad in (math.nan, math.inf, -1.0):
        held.observe("a", bad)
    assert held.get("a") is None
    for i in range(10):
        held.observe(f"p{i}", 1.0)
    assert [held.get(f"p{i}") for i in (6, 7, 8, 9)] == [None, 1.0, 1.0, 1.0]
    held.observe("p7", 1.0)  # recently seen: kept over the older ones
    held.observe("new", 1.0)
    assert held.get("p7") == 1.0 and held.get("p8") is None
    held.forget("p7")
    assert held.get("p7") is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1,
                max_size=30), st.integers(0, 1 << 30))
def test_the_deadline_always_lies_between_the_floor_and_the_cap(
        holds: list[float], nbytes: int) -> None:
    links, held = LinkEstimates(), HeldTimes()
    for h in holds:
        held.observe("a", h)
    d = held.deadline(links, "a", nbytes)
    assert links.policy.floor_s <= d <= HOP_TIMEOUT_S
    assert min(holds) * (1 - 1e-9) <= held.get("a") <= max(holds) * (1 + 1e-9)
