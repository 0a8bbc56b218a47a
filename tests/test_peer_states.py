"""One list of peer states (issue 27): membership, the balancer, the API and the page use
``swarmd.peer_states``; the daemon moves only along its transition table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.peer_states import TRANSITIONS, IllegalTransition, PeerState, transition

ROOT = Path(__file__).resolve().parents[1]


def test_every_user_of_peer_states_takes_the_one_list() -> None:
    from swarmd.api.types import PEER_STATES
    from swarmd.balancing import policy
    from swarmd.membership import PeerState as Announced

    assert Announced is PeerState
    assert PEER_STATES == tuple(s.value for s in PeerState)
    assert set(policy.STATES) | {"syncing"} == set(PEER_STATES)
    page = (ROOT / "swarmd/api/page.html").read_text()
    listed = re.search(r"const STATES = \[([^\]]*)\]", page)
    assert listed is not None
    assert re.findall(r'"(\w+)"', listed.group(1)) == list(PEER_STATES)
    for state in PEER_STATES:  # each has its colour
        assert f".s-{state} " in page


def test_a_daemons_life_follows_the_table() -> None:
    life = [PeerState.SYNCING, PeerState.ONLINE, PeerState.MIGRATING, PeerState.SYNCING,
            PeerState.ONLINE, PeerState.LEAVING, PeerState.LEAVING]
    state = PeerState.JOINING
    for new in life:
        state = transition(state, new)
    assert state is PeerState.LEAVING
    for state in PeerState:  # a stop is honoured from anywhere
        assert transition(state, PeerState.LEAVING) is PeerState.LEAVING


@given(st.sampled_from(list(PeerState)), st.sampled_from(list(PeerState)))
def test_a_move_off_the_table_raises_naming_both(current: PeerState, new: PeerState) -> None:
    if new in TRANSITIONS[current]:
        assert transition(current, new) is new
        return
    with pytest.raises(IllegalTransition, match=f"from '{current.value}' to '{new.value}'"):
        transition(current, new)


def test_leaving_is_for_good_and_nothing_goes_back_to_joining() -> None:
    assert TRANSITIONS[PeerState.LEAVING] == {PeerState.LEAVING}
    assert all(PeerState.JOINING not in allowed for allowed in TRANSITIONS.values())
    assert set(TRANSITIONS) == set(PeerState)
