"""How many microbatches a trainer keeps in the pipeline: a pure controller (no I/O, no clock).

Little's law: to keep the pipeline busy, the microbatches in flight must cover what the
pipeline delivers during one microbatch's round trip, the bandwidth-delay product

    in_flight = throughput (microbatches / s) x round trip (s)

Both are measured by the trainer, like BBR measures a TCP path: the round trip as the
shortest life of a microbatch seen so far (its first forward sent -> its input gradient back:
every hop's wire time and compute, without the queueing that a fuller pipeline adds), the
throughput as the highest completion rate over a recent window (what the pipeline delivers
when it is kept full). The target is a gain x their product plus a step's microbatches: while
the pipeline is latency-bound the completion rate grows with what is in flight and the target
grows with it (by ``STARTUP_GAIN`` each round trip while the recent lives stay near the
shortest, i.e. nothing queues yet; ``GAIN`` once they grow); once the slowest stage's compute is the limit the
rate stops growing and the target settles, a little above the product (what queues is then at
most ``GAIN - 1`` of it plus a step; where a step's microbatches already queue, the shortest
round trip seen includes that queue and the target settles near ``(1 + GAIN)`` x ``floor``:
more in flight than needed, never less throughput). It never goes above ``ceiling``
(``training.in_flight``, or what memory and the stages' staleness bound allow), and below
``floor`` (a step's microbatches: the synchronous schedule's number) only while stage peers
answer ``busy``: a peer refuses what its queue and its per-trainer budgets do not hold, however
many microbatches a step has (64 a step against one stage-0 peer, which queued 16 for compute
and keeps 32 per trainer, drew 800 refusals in 10 steps and cost a quarter of the throughput
while the floor kept the target at 64).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

#: target = GAIN x throughput x round trip + floor
GAIN = 1.25
#: the gain while microbatches come back about as fast as the shortest round trip (nothing
#: queues yet: the pipeline is latency-bound), so that it fills in a few round trips
STARTUP_GAIN = 2.0
#: "about as fast": the recent average life within this factor of the shortest
QUEUE_FREE = 1.25
#: weight of each completion in the recent average life
LIFE_EMA = 0.2
#: the completion rate is measured over the completions of the last
#: max(RATE_MIN_S, RATE_ROUND_TRIPS x round trip) seconds (completions come in bursts when
#: the trainer's compute thread was busy: a short window would see rates no pipeline has)
RATE_MIN_S = 1.0
RATE_ROUND_TRIPS = 2.0
#: at least this many completions in the window, spread over at least half of it, before a
#: rate is said (the first ones come back together)
RATE_MIN_COUNT = 4
#: completion times kept (bounds the memory whatever the rate)
RATE_KEEP = 512


def target_in_flight(rate: float | None, round_trip_s: float | None, *, floor: int,
                     ceiling: int, gain: float = GAIN) -> int:
    """Microbatches to keep in flight for a pipeline that delivers ``rate`` microbatches per
    second with an unloaded round trip of ``round_trip_s``; ``floor`` while either is
    unknown. Always within [floor, ceiling] (ceiling below floor: the ceiling wins)."""
    if floor < 1 or ceiling < 1:
        raise ValueError("in-flight floor and ceiling must be at least 1")
    floor = min(floor, ceiling)
    if not rate or not round_trip_s or not (math.isfinite(rate) and math.isfinite(round_trip_s)) \
            or rate < 0 or round_trip_s < 0:
        return floor
    want = gain * rate * round_trip_s + floor
    if not math.isfinite(want) or want >= ceiling:
        return ceiling
    return max(floor, min(ceiling, math.ceil(want)))


@dataclass
class InFlight:
    """The measurements and the target. ``completed(now, life_s)`` after each microbatch
    that came back whole; ``target`` is how many to keep in flight now. ``fixed`` pins the
    target to ``ceiling`` (a configured number, or an experiment)."""

    floor: int
    ceiling: int
    fixed: bool = False
    round_trip_s: float | None = None
    rate: float | None = None
    #: the recent average life of a microbatch (EMA)
    life_s: float | None = None
    #: set by ``busy`` (a stage peer refused a forward: its queue is full): the target stays
    #: at most this, below the floor too, which grows back by one every ``cap`` completions
    #: (one window's worth, as TCP's congestion avoidance)
    cap: int | None = None
    _since_busy: int = 0
    _done_at: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_KEEP))

    def __post_init__(self) -> None:
        if self.floor < 1 or self.ceiling < 1:
            raise ValueError("in-flight floor and ceiling must be at least 1")

    def completed(self, now: float, life_s: float) -> None:
        """A microbatch came back whole at ``now``, ``life_s`` after its forward was sent."""
        if math.isfinite(life_s) and life_s > 0:
            self.round_trip_s = life_s if self.round_trip_s is None else min(
                self.round_trip_s, life_s)
            self.life_s = life_s if self.life_s is None else (
                self.life_s + LIFE_EMA * (life_s - self.life_s))
        self._since_busy += 1
        if self.cap is not None and self._since_busy >= self.cap:
            self.cap += 1
            self._since_busy = 0
            if self.cap >= self.ceiling:
                self.cap = None
        self._done_at.append(now)
        window = max(RATE_MIN_S, RATE_ROUND_TRIPS * (self.round_trip_s or 0.0))
        while self._done_at and self._done_at[0] < now - window:
            self._done_at.popleft()
        span = now - self._done_at[0]
        if len(self._done_at) >= RATE_MIN_COUNT and span >= 0.5 * window:
            self.rate = (len(self._done_at) - 1) / span

    def busy(self, in_flight: int) -> None:
        """A stage peer answered ``busy`` with ``in_flight`` microbatches out: more than its
        queue holds; stay below that for a while (multiplicative decrease, additive
        increase, as TCP does), below a step's microbatches too."""
        self.cap = max(1, min(self.ceiling, int(0.75 * in_flight)))
        self._since_busy = 0

    @property
    def opening(self) -> int:
        """How many a synchronous step launches before its first microbatch came back: the
        ceiling (under a ``busy`` cap). Until then nothing comes back to pace on, and stage
        0 only forwards, several times faster than its forward and backward together."""
        return self.ceiling if self.cap is None or self.fixed else self.cap  # (cap <= ceiling)

    @property
    def target(self) -> int:
        if self.fixed:
            return self.ceiling
        n = target_in_flight(self.rate, self.round_trip_s, floor=self.floor,
                             ceiling=self.ceiling, gain=self.gain)
        return n if self.cap is None else min(n, self.cap)

    @property
    def gain(self) -> float:
        """``STARTUP_GAIN`` while nothing queues (recent lives near the shortest), else
        ``GAIN``."""
        if self.life_s is not None and self.round_trip_s is not None and \
                self.life_s < QUEUE_FREE * self.round_trip_s:
            return STARTUP_GAIN
        return GAIN

    def shown(self) -> dict[str, float | int | None]:
        """What the trainer's progress and metrics show."""
        return {"in_flight_target": self.target, "round_trip_ms": None if self.round_trip_s is
                None else self.round_trip_s * 1e3, "microbatches_per_s": self.rate}
