"""Hedged hops: when to send a forward a second time, and who lost the race. Pure.

A hop that has taken several times what its stage usually takes is re-sent to another peer
of that stage, and whichever answers first is taken (tail-latency practice: hedged
requests). ``Hedging`` is one stage's book, owned by the router that sends to it:

* ``observe(seconds)``: a hop of the stage answered ``ok`` after ``seconds`` (the whole try:
  the peer's compute and the chain after it). The last ``window`` hop times are kept.
* ``delay()``: how long a try may run before it is hedged: ``multiple`` x the ``percentile``
  of the kept hop times, at least ``floor_s`` and at most ``cap_s``; ``cold_s`` while fewer
  than ``min_hops`` were measured (a stage whose first hops all went to a silent peer still
  hedges, later than a measured one).
* ``may_hedge()`` / ``hedged()`` / ``hedge_won()``: a budget, as in tail-latency practice,
  so that hedging cannot double the work of a loaded stage: each try sent earns
  ``budget_share`` (0.1) of a hedge, at most ``budget_burst`` (10) saved; a hedge spends one,
  and one that won (the first try was the straggler) is refunded. So hedges that turn out
  needless (the first try answered first after all, as on a loaded machine where every hop
  is slow) are at most ``budget_share`` of the tries, while a silent or stalled peer's
  forwards are hedged as often as they come.
* ``lost(peer)`` / ``won(peer)``: the outcome of a race. A peer that loses ``slow_after``
  races in a row (no win, no ``ok`` in between) is to be marked slow (``lost`` returns True,
  and the count starts over); the router does it with ``Wiring.timeout``. At most ``keep``
  peers are remembered (the oldest forgotten first).

Only forwards are hedged: a backward must reach the peer that saved the forward's
activations, and no other peer of the stage has them. Time is a parameter, never read here.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["HedgeConfig", "Hedging", "percentile"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HedgeConfig:
    #: a try is hedged after this many times the stage's recent hop time ...
    multiple: float = 2.0
    #: ... taken at this percentile of the kept hop times
    percentile: float = 0.9
    #: never sooner than this (seconds): a loopback hop's jitter is not a straggler
    floor_s: float = 0.2
    #: never later than this (seconds); the try's own deadline may come first
    cap_s: float = 30.0
    #: while fewer hops than ``min_hops`` were measured, hedge after ``cold_s``
    cold_s: float = 10.0
    min_hops: int = 4
    #: hop times kept (the most recent)
    window: int = 64
    #: races lost in a row that mark a peer slow
    slow_after: int = 2
    #: peers remembered at most
    keep: int = 1024
    #: each try earns this share of a hedge; a hedge costs one (refunded when it won) ...
    budget_share: float = 0.1
    #: ... and at most this many are saved up
    budget_burst: float = 10.0

    def __post_init__(self) -> None:
        for name in ("multiple", "floor_s", "cap_s", "cold_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0")
        if self.multiple < 1:
            raise ValueError("multiple must be >= 1")
        if not 0 < self.percentile <= 1:
            raise ValueError("percentile must be in (0, 1]")
        for name in ("budget_share", "budget_burst"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0")
        if self.cap_s < self.floor_s:
            raise ValueError("cap_s must be >= floor_s")
        for name in ("min_hops", "window", "slow_after", "keep"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` percentile (0 < q <= 1) of ``values`` (not empty), nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Hedging:
    """One stage's recent hop times and race losers; see the module docstring."""

    config: HedgeConfig = field(default_factory=HedgeConfig)
    _hops: deque[float] = field(init=False)
    _losses: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._hops = deque(maxlen=self.config.window)
        #: hedges that may be sent now (the budget)
        self.tokens = self.config.budget_burst

    def sent(self) -> None:
        """A try was sent: it earns ``budget_share`` of a hedge."""
        self.tokens = min(self.config.budget_burst, self.tokens + self.config.budget_share)

    def may_hedge(self) -> bool:
        return self.tokens >= 1.0

    def hedged(self) -> None:
        """A hedge was sent: it spends one."""
        self.tokens = max(0.0, self.tokens - 1.0)

    def hedge_won(self) -> None:
        """The hedge answered first (it was needed): refunded."""
        self.tokens = min(self.config.budget_burst, self.tokens + 1.0)

    def observe(self, seconds: float) -> None:
        """A hop of the stage answered after ``seconds``; not finite or negative: ignored."""
        if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0:
            self._hops.append(float(seconds))

    def delay(self) -> float:
        """Seconds a try may run before it is hedged."""
        cfg = self.config
        if len(self._hops) < cfg.min_hops:
            return cfg.cold_s
        usual = percentile(list(self._hops), cfg.percentile)
        return min(cfg.cap_s, max(cfg.floor_s, cfg.multiple * usual))

    def won(self, peer: str) -> None:
        """``peer`` answered first (or answered at all): its losing streak ends."""
        self._losses.pop(peer, None)

    def lost(self, peer: str) -> bool:
        """``peer`` lost a race; True when it has now lost ``slow_after`` in a row (mark it
        slow; its count starts over)."""
        n = self._losses.pop(peer, 0) + 1  # re-inserted: the dict's order is the recency
        if n >= self.config.slow_after:
            return True
        self._losses[peer] = n
        while len(self._losses) > self.config.keep:
            self._losses.pop(next(iter(self._losses)))
        return False

    def losses(self, peer: str) -> int:
        return self._losses.get(peer, 0)
