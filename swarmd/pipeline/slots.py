"""Who may take a full stage worker's saved-activation slot (issue 14, Sybil). Pure: no I/O.

A stage worker keeps at most ``max_saved`` (64) forwards for their backward, and one trainer at
most half of them (``swarmd.pipeline.budgets``). Two hostile identities, or one stage-1 sender
naming many trainers, could still fill all 64 with forwards never followed by a backward, and
every honest forward would be refused ``busy`` until they expire (120 s). So when the worker is
full, a training forward of owner R (its trainer) may take the slot of another one:

1. the oldest slot, at least ``min_age_s`` old, of an owner that sent no backward here within
   ``answered_s`` (a slot that old whose owner does not answer is most likely never answered);
2. else, when R holds fewer slots than its fair share (``capacity`` over the owners holding
   slots, R counted), the oldest slot at least ``min_age_s`` old of the owner holding the most,
   if that one holds more than its share.

Otherwise nothing is taken and R is refused ``busy`` as before. The evicted microbatch's
backward, should it come, gets ``unknown_microbatch`` and its trainer restarts it (nothing is
lost). Memory is bounded: at most ``max_owners`` answers remembered, the oldest dropped first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ANSWERED_S", "Held", "MIN_AGE_S", "SlotShares"]

#: a slot younger than this (seconds) is never taken: its backward may well be on its way
MIN_AGE_S = 10.0
#: an owner that sent a backward within this (seconds) is one that answers
ANSWERED_S = 60.0
MAX_OWNERS = 1024


@dataclass(frozen=True, slots=True)
class Held:
    """One saved slot: the microbatch, its owner (trainer) and when its forward ran."""

    mb: str
    owner: str
    since: float


class SlotShares:
    """The slot-taking rule of the module docstring, with the owners' last answers."""

    def __init__(self, capacity: int, *, min_age_s: float = MIN_AGE_S,
                 answered_s: float = ANSWERED_S, max_owners: int = MAX_OWNERS) -> None:
        if capacity < 1 or min_age_s < 0 or answered_s < 0 or max_owners < 1:
            raise ValueError("SlotShares needs capacity >= 1, min_age_s, answered_s >= 0 and "
                             "max_owners >= 1")
        self.capacity = capacity
        self.min_age_s = min_age_s
        self.answered_s = answered_s
        self.max_owners = max_owners
        #: owner -> when its last backward was taken here (oldest first)
        self._answers: dict[str, float] = {}

    def answered(self, owner: str, now: float) -> None:
        """A backward of ``owner``'s was taken at ``now``."""
        self._answers.pop(owner, None)
        self._answers[owner] = now
        while len(self._answers) > self.max_owners:
            del self._answers[next(iter(self._answers))]

    def answers(self, owner: str, now: float) -> bool:
        """Whether ``owner`` sent a backward here within ``answered_s``."""
        last = self._answers.get(owner)
        return last is not None and now - last <= self.answered_s

    def victim(self, requester: str, held: Sequence[Held], now: float) -> str | None:
        """The microbatch whose slot ``requester`` takes (the worker holds ``held``), or None
        (``busy``). Nothing is taken while the worker is not full."""
        if len(held) < self.capacity:
            return None
        ripe = [h for h in held if h.owner != requester and now - h.since >= self.min_age_s]
        silent = [h for h in ripe if not self.answers(h.owner, now)]
        if silent:
            return min(silent, key=lambda h: (h.since, h.mb)).mb
        counts: dict[str, int] = {}
        for h in held:
            counts[h.owner] = counts.get(h.owner, 0) + 1
        share = self.capacity // len(counts.keys() | {requester})
        if counts.get(requester, 0) >= share:
            return None
        over = {o for o, n in counts.items() if n > share and o != requester}
        candidates = [h for h in ripe if h.owner in over]
        if not candidates:
            return None
        most = max(counts[h.owner] for h in candidates)
        return min((h for h in candidates if counts[h.owner] == most),
                   key=lambda h: (h.since, h.mb)).mb
