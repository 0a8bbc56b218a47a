"""How long peers hold our requests, and the deadlines that follow: pure (no I/O, no clock).

A request whose reply waits on work after it (a backward to the last stage is answered once
the previous stages took their backward and the trainer its input gradient; a result or a
gradient to a trainer once its compute took it) has no fixed right deadline: on loopback it
takes milliseconds, over a 100 ms link with a loaded stage seconds. ``HeldTimes`` keeps, per
peer, a moving average of how long such requests took (reply time less nothing: the round
trip is inside it, counted again by the link's part of the deadline, which is slack), and
``deadline`` derives one try's deadline from it and the link estimates (``swarmd.links``):
the bytes over the measured bandwidth, two round trips, ``HELD_SLACK`` x the average held,
plus ``DOWNSTREAM_RETRY_S`` (a later hop may time out on one peer and try another first),
clamped to the links' floor and ``cap_s`` (``HOP_TIMEOUT_S`` by default, and all of it while
nothing was measured for that peer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

#: one hop's deadline (the chain after it included) at most, and while nothing is known of it
HOP_TIMEOUT_S = 60.0
#: a peer's held time (its compute and the chain after it) counts this many times over
HELD_SLACK = 3.0
#: added to a measured hop's deadline: room for a stage after that peer to give up on one of
#: its peers by its own deadline (at least the floor) and try another, before we give up
DOWNSTREAM_RETRY_S = 10.0
#: weight of each new measurement in the average
HELD_EMA = 0.3
#: peers remembered at most (the oldest is forgotten first)
HELD_KEEP = 1024


class Links(Protocol):
    def deadline(self, peer: str, nbytes: int, *, round_trips: int = 1, extra_s: float = 0.0,
                 cap_s: float | None = None) -> float: ...


@dataclass
class HeldTimes:
    """Per peer, the moving average of how long it held our requests (seconds)."""

    keep: int = HELD_KEEP
    _held: dict[str, float] = field(default_factory=dict)

    def observe(self, peer: str, seconds: float) -> None:
        """A request to ``peer`` was answered after ``seconds``; not finite or negative: ignored."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            return
        old = self._held.pop(peer, None)  # re-inserted: the dict's order is the recency
        self._held[peer] = seconds if old is None else (1 - HELD_EMA) * old + HELD_EMA * seconds
        while len(self._held) > self.keep:
            self._held.pop(next(iter(self._held)))

    def get(self, peer: str) -> float | None:
        return self._held.get(peer)

    def forget(self, peer: str) -> None:
        self._held.pop(peer, None)

    def deadline(self, links: Links, peer: str, nbytes: int, *,
                 cap_s: float = HOP_TIMEOUT_S) -> float:
        """One try's deadline for ``nbytes`` to ``peer`` (see the module docstring)."""
        held = self._held.get(peer)
        if held is None:
            return cap_s
        return links.deadline(peer, nbytes, round_trips=2,
                              extra_s=HELD_SLACK * held + DOWNSTREAM_RETRY_S, cap_s=cap_s)
