"""When to ping a connection and when it is dead (issue 12, "Recovery"): a pure decision.

A connection through a home router that restarted looks established on both ends until TCP
gives up (many minutes with data in flight). The kernel's user timeout finds it sooner but also
kills a live peer that merely stopped reading (Linux counts a zero window against it). Here a
connection is dead only when *nothing at all* was heard on it for ``dead_after_s`` **and** pings
sent during that silence went unanswered: a peer that paused reading one stream, or a bulk
transfer that keeps any byte (or, on a TCP connection, any acknowledgement) arriving, is never
dead. What counts as "heard" is the adapter's business (``transport.liveness_watch``); time is
passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transport.errors import LocalUsageError

__all__ = ["PingPolicy", "ConnClock", "WAIT", "PING", "DEAD"]

WAIT, PING, DEAD = "wait", "ping", "dead"


@dataclass(frozen=True, slots=True, kw_only=True)
class PingPolicy:
    #: silence (nothing received) before the first ping
    ping_after_s: float = 10.0
    #: between two pings of one silence
    ping_every_s: float = 5.0
    #: silence after which a connection whose pings went unanswered is dead
    dead_after_s: float = 25.0
    #: a ping younger than this may still be answered: it does not count as unanswered yet
    answer_wait_s: float = 5.0
    #: pings sent in one silence at most
    max_pings: int = 3

    def __post_init__(self) -> None:
        for name in ("ping_after_s", "ping_every_s", "dead_after_s", "answer_wait_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise LocalUsageError(f"PingPolicy.{name} must be a positive number of seconds")
        if not isinstance(self.max_pings, int) or not 1 <= self.max_pings <= 100:
            raise LocalUsageError("PingPolicy.max_pings must be an integer from 1 to 100")
        if self.ping_after_s + self.answer_wait_s > self.dead_after_s:
            raise LocalUsageError(
                f"PingPolicy: a ping sent after {self.ping_after_s:g} s of silence and given "
                f"{self.answer_wait_s:g} s to be answered needs dead_after_s >= "
                f"{self.ping_after_s + self.answer_wait_s:g}, got {self.dead_after_s:g}")


@dataclass(slots=True)
class ConnClock:
    """What one connection's liveness decision knows: when it last heard the peer, and the
    pings sent since then (at most ``max_pings``)."""

    last_heard: float
    pings: list[float] = field(default_factory=list)

    def heard(self, at: float) -> None:
        """Something arrived at ``at``: pings sent before then count as answered."""
        if at > self.last_heard:
            self.last_heard = at
            self.pings = [p for p in self.pings if p > at]

    def pinged(self, now: float) -> None:
        self.pings.append(now)

    def decide(self, now: float, policy: PingPolicy) -> str:
        """``DEAD``, ``PING`` (send one now, then call ``pinged``) or ``WAIT``."""
        silence = now - self.last_heard
        if silence >= policy.dead_after_s and any(
                p > self.last_heard and now - p >= policy.answer_wait_s for p in self.pings):
            return DEAD
        if silence >= policy.ping_after_s and len(self.pings) < policy.max_pings and (
                not self.pings or now - self.pings[-1] >= policy.ping_every_s):
            return PING
        return WAIT
