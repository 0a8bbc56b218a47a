"""When to redial the bootstrap peers: exponential backoff with jitter. Pure.

A daemon that has lost every connection (a NATed volunteer after an outage, a laptop that
slept) keeps trying its bootstrap peers, fast at first and then every ``max_s`` at most, and
says why each attempt failed. Petals servers silently fell out of the swarm in that situation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    initial_s: float = 1.0
    max_s: float = 60.0
    factor: float = 2.0
    #: each delay is scaled by a uniform factor in [1 - jitter, 1 + jitter]
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("Backoff needs 0 < initial_s <= max_s")
        if self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError("Backoff needs factor >= 1 and 0 <= jitter < 1")

    def delay(self, failures: int, rng: random.Random) -> float:
        """Seconds to wait after ``failures`` consecutive failed rounds (0: try now)."""
        if failures <= 0:
            return 0.0
        base = min(self.max_s, self.initial_s * self.factor ** min(failures - 1, 64))
        return base * rng.uniform(1 - self.jitter, 1 + self.jitter)


@dataclass(slots=True)
class Redialer:
    """Decides, at each check, whether to dial the bootstrap peers now."""

    backoff: Backoff
    failures: int = 0
    next_attempt: float = 0.0

    def should_dial(self, now: float, connected_peers: int, has_bootstrap: bool) -> bool:
        return has_bootstrap and connected_peers == 0 and now >= self.next_attempt

    def failed(self, now: float, rng: random.Random) -> float:
        """Record a round where no bootstrap peer answered; returns the wait until the next."""
        self.failures += 1
        wait = self.backoff.delay(self.failures, rng)
        self.next_attempt = now + wait
        return wait

    def succeeded(self) -> None:
        self.failures = 0
        self.next_attempt = 0.0
