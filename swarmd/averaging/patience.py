"""How long a stage peer waits for a mate's answer to a round message. Pure: no I/O, no clock.

A ``prepare`` or ``progress`` answer costs a mate no compute: on this 2-core machine, 12 daemons
and 2 trainers with two busy loops beside them answered every ``prepare`` within 100 ms
(``tools/bench_scale.py``'s ``prepare_answer_s``). A fixed 3 s wait held the whole pipeline for
3 s each time a mate froze (a SIGSTOP, a swapped-out machine): the stage's step waited for it.

So the wait follows each mate's own measured answers, as a TCP retransmission timer follows the
round trip: ``factor`` times the slowest of its last ``window`` answers, never under ``floor_s``
(an idle daemon's answers are milliseconds; a wait that short would take a scheduler hiccup for
silence: 0.2 s is twice the slowest answer measured under load) and never over
``ceiling_s``. A mate with fewer than ``min_seen`` answers measured
(new, or far away on a path not yet seen) gets the ceiling. Only answers that came are observed:
a mate cut off once is not waited for longer the next time (it is suspected meanwhile,
``swarmd.averaging.trigger.SUSPECT_S``), so a frozen mate costs the floor, not the ceiling, each
time it is asked again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["AnswerPatience"]


@dataclass(slots=True)
class AnswerPatience:
    floor_s: float = 0.2
    ceiling_s: float = 3.0
    factor: float = 4.0
    window: int = 16
    min_seen: int = 4
    #: peer -> its last ``window`` answer times (seconds)
    _seen: dict[str, deque[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError("AnswerPatience needs 0 < floor_s <= ceiling_s")
        if self.factor < 1 or self.window < 1 or not 1 <= self.min_seen <= self.window:
            raise ValueError("AnswerPatience needs factor >= 1 and 1 <= min_seen <= window")

    def observe(self, peer: str, seconds: float) -> None:
        """``peer`` answered after ``seconds``."""
        if not seconds >= 0:  # NaN or negative: a clock's mistake, not an answer time
            return
        self._seen.setdefault(peer, deque(maxlen=self.window)).append(seconds)

    def seconds(self, peer: str) -> float:
        """How long to wait for ``peer``'s next answer."""
        seen = self._seen.get(peer)
        if seen is None or len(seen) < self.min_seen:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * max(seen)))

    def forget(self, present: Iterable[str]) -> None:
        """Drop what is held about peers no longer in the stage (bounded memory)."""
        keep = set(present)
        self._seen = {p: s for p, s in self._seen.items() if p in keep}
