"""A peer's lifecycle states: the one list membership announces, the balancer counts, the API
and the status page show, and the daemon's legal transitions between them. Pure.

    joining --> syncing --> online --> migrating --> syncing --> online ...
       |           |          |            |
       +-----------+----------+------------+--> leaving

A daemon starts ``joining`` (loading its stage), is ``syncing`` while it takes its stage's
state (from a checkpoint or its mates), ``online`` while it serves, ``migrating`` while it
hands over one stage for another (balancing), and ``leaving`` once a stop was asked, from any
state and for good. ``transition`` raises :class:`IllegalTransition` for any other move: a
daemon that tried one has a bug, which a test or a log line should show at once.
"""

from __future__ import annotations

import enum

__all__ = ["PeerState", "TRANSITIONS", "IllegalTransition", "transition"]


class PeerState(enum.Enum):
    JOINING = "joining"      # loading its stage; not serving yet
    ONLINE = "online"        # serving its stage
    MIGRATING = "migrating"  # moving to another stage
    LEAVING = "leaving"      # going away: removed from views at once
    SYNCING = "syncing"      # taking its stage's state (checkpoint or peers); not serving yet


#: state -> the states a daemon may move to from it
TRANSITIONS: dict[PeerState, frozenset[PeerState]] = {
    PeerState.JOINING: frozenset({PeerState.SYNCING, PeerState.LEAVING}),
    PeerState.SYNCING: frozenset({PeerState.ONLINE, PeerState.LEAVING}),
    PeerState.ONLINE: frozenset({PeerState.MIGRATING, PeerState.LEAVING}),
    PeerState.MIGRATING: frozenset({PeerState.SYNCING, PeerState.LEAVING}),
    PeerState.LEAVING: frozenset({PeerState.LEAVING}),  # a second stop request
}


class IllegalTransition(ValueError):
    """A daemon moved between states the table does not allow (a bug in swarmd)."""


def transition(current: PeerState, new: PeerState) -> PeerState:
    """``new`` when the table allows moving to it from ``current``; else
    :class:`IllegalTransition` naming both and what is allowed."""
    allowed = TRANSITIONS[current]
    if new not in allowed:
        raise IllegalTransition(
            f"a peer cannot go from {current.value!r} to {new.value!r} (from {current.value!r}: "
            f"{', '.join(sorted(s.value for s in allowed))}); this is a bug in swarmd, please "
            f"report it with the log")
    return new
