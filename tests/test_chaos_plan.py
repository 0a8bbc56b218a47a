"""The schedule of tools/chaos.py (pure): seeded, one fault every 20-40 s, at most one faulty
peer per stage at a time. The run itself needs the WAN lab and minutes: not run here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.chaos import DURATION_S, KINDS, peer_names, plan, stage_of, timeline  # noqa: E402


def test_the_schedule_is_seeded_and_spaced() -> None:
    peers = peer_names()
    assert peers == ["s0a", "s0b", "s0c", "s1a", "s1b", "s1c"]
    a, b = plan(10, 7, peers), plan(10, 7, peers)
    assert a == b and a != plan(10, 8, peers)
    assert 10 <= len(a) <= 30 and {e.kind for e in a} <= set(KINDS)
    assert all(e.duration_s == DURATION_S[e.kind] for e in a)
    assert all(20.0 <= y.at_s - x.at_s for x, y in zip(a, a[1:]))
    with pytest.raises(ValueError):
        plan(0, 1, peers)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.floats(1.0, 30.0))
def test_a_stage_never_has_two_faulty_peers_at_once(seed: int, minutes: float) -> None:
    events = plan(minutes, seed, peer_names())
    assert all(0 < e.at_s < minutes * 60 for e in events)
    down: dict[int, str] = {}
    for _at, action, e in timeline(events):
        stage = stage_of(e.target)
        if action == "begin":
            assert stage not in down, (e, down)
            if e.duration_s > 0:
                down[stage] = e.target
        else:
            assert down.pop(stage) == e.target
