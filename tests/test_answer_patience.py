"""AnswerPatience: how long a stage peer waits for a mate's round answer. Pure: answer times
are parameters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.averaging.patience import AnswerPatience

TIMES = st.lists(st.floats(0.0, 10.0), max_size=40)


@given(times=TIMES)
def test_the_wait_stays_between_floor_and_ceiling_whatever_was_measured(times: list[float]
                                                                        ) -> None:
    p = AnswerPatience()
    for t in times:
        p.observe("b", t)
    assert p.floor_s <= p.seconds("b") <= p.ceiling_s


@given(times=st.lists(st.floats(0.0, 10.0), max_size=3))
def test_a_mate_with_too_few_answers_measured_gets_the_ceiling(times: list[float]) -> None:
    p = AnswerPatience(min_seen=4)
    for t in times:
        p.observe("b", t)
    assert p.seconds("b") == p.ceiling_s
    assert p.seconds("never-heard") == p.ceiling_s


@given(times=st.lists(st.floats(0.0, 10.0), min_size=4, max_size=40))
def test_the_wait_is_factor_times_the_slowest_recent_answer_clamped(times: list[float]) -> None:
    p = AnswerPatience(window=16)
    for t in times:
        p.observe("b", t)
    slowest = max(times[-16:])
    assert p.seconds("b") == min(p.ceiling_s, max(p.floor_s, p.factor * slowest))


def test_a_frozen_mate_that_answered_fast_costs_the_floor_not_the_ceiling() -> None:
    p = AnswerPatience(floor_s=0.2, ceiling_s=3.0)
    for _ in range(8):
        p.observe("b", 0.02)
    assert p.seconds("b") == 0.2
    p.observe("b", 0.4)  # one slow answer (a loaded machine): more patience for a while
    assert p.seconds("b") == 1.6
    for _ in range(16):
        p.observe("b", 0.02)
    assert p.seconds("b") == 0.2


def test_each_mate_is_judged_by_its_own_answers() -> None:
    p = AnswerPatience()
    for _ in range(4):
        p.observe("near", 0.01)
        p.observe("far", 0.6)
    assert p.seconds("near") == p.floor_s
    assert p.seconds("far") == pytest.approx(2.4)


@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_a_clock_mistake_is_not_an_answer_time(bad: float) -> None:
    p = AnswerPatience(min_seen=1)
    p.observe("b", bad)
    assert p.seconds("b") == p.ceiling_s


def test_forgotten_mates_are_dropped() -> None:
    p = AnswerPatience(min_seen=1)
    p.observe("b", 0.01)
    p.observe("c", 0.01)
    p.forget(["c"])
    assert p.seconds("b") == p.ceiling_s and p.seconds("c") == p.floor_s


@pytest.mark.parametrize("kw", [{"floor_s": 0}, {"floor_s": 4, "ceiling_s": 3},
                                {"factor": 0.5}, {"min_seen": 0}, {"window": 2, "min_seen": 3}])
def test_settings_that_make_no_sense_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AnswerPatience(**kw)  # type: ignore[arg-type]
