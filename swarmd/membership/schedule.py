"""When to announce, when to pull and from whom, when gossip is affordable: the traffic budget.

Pure: ``now`` and ``rng`` are parameters. One :class:`Schedule` per daemon; the simulator runs
one per simulated peer.

Traffic model (inbound bytes per second at one peer; n peers each announcing every T seconds
and pulling one random neighbour every P seconds with a delta window W; e events/s, i.e.
announcements that are not periodic refreshes: joins, state or stage changes, leaves; ``a`` =
bytes of one signed announcement, ``f`` = 4 bytes per fingerprint, ``h`` = per-message
overhead):

    traffic(n, T) = n (a + 3) / T                 each version reaches each peer once, in a page
                  + e (a + 3 + f W / P)           event versions, and their digest entries
                  + f n min(1, W / T) / P         the digest of the one request we serve per P
                  + 2 h / P                       framing of that request and of our own page

The period is the shortest T >= ``base_period_s`` with traffic(n, T) <= ``refresh_share`` x
budget. With the defaults (2,000 B/s, share 0.8, a = 204 B, no events) that is T = 2 s up to
8 peers, 2.6 s at 10, 17 s at 100, 170 s at 1,000, 1,760 s at 10,000 (expiry 3 T); churn
lengthens it (10,000 peers replacing 20% of themselves per hour: e ~ 1.4/s, T ~ 2,340 s). The
digest term is an upper bound: versions still on their way are not in the puller's digest.

The pull interval is P = T / (ln n + 8) clamped to [0.25 s, 5 s]. In a pull epidemic a version
reaches a given peer after d with P(d > t) = n / (e^(t/P) + n - 1) (mean field), ~P ln n on
average, so far inside T; the window W = (ln n + 7) P + ``skew_s`` lets a peer miss a version
with probability ~e^-7, and a missed version is superseded by the next, T later.

Gossip (gossipsub) is optional and budgeted apart: one gossiped message costs every peer about
D (a + envelope) + D x history x message-id bytes (mesh duplicates plus IHAVE), ~3 KB at D = 6.
A peer may gossip one event per n x that cost / (``gossip_share`` x budget) seconds (a token
bucket that starts empty): ~150 s at 10 peers, never in practice at 10,000, where pulls carry
everything. Nothing depends on gossip arriving.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["ScheduleConfig", "SwarmEstimate", "Plan", "PullOrder", "Schedule", "plan",
           "refresh_traffic", "gossip_cost"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleConfig:
    #: membership traffic allowed per peer, bytes per second (inbound)
    budget_bytes_per_s: float = 2000.0
    #: part of the budget for announcements, digests and pull framing
    refresh_share: float = 0.8
    #: part of the budget for gossiped events (the rest is headroom)
    gossip_share: float = 0.1
    base_period_s: float = 2.0
    max_period_s: float = 3600.0
    #: never two announcements closer than this (the view drops them as "too_frequent")
    min_gap_s: float = 0.5
    #: announcements come up to this fraction of a period early; pulls +- this fraction
    jitter: float = 0.1
    min_pull_s: float = 0.25
    max_pull_s: float = 5.0
    #: bytes of a signed announcement until the view knows the real mean
    announcement_bytes: float = 220.0
    fingerprint_bytes: int = 4
    #: per pull message (request or page): its msgpack header, frame prefix, stream open,
    #: yamux and noise framing
    message_overhead_bytes: float = 80.0
    #: clock skew between peers the delta window allows for
    skew_s: float = 5.0
    #: the window spans ln(n) + this many pull rounds
    window_rounds: float = 7.0
    gossip_degree: int = 6
    gossip_envelope_bytes: float = 140.0
    gossip_history: int = 3
    gossip_id_bytes: float = 48.0
    expiry_periods: float = 3.0

    def __post_init__(self) -> None:
        if not 0 < self.base_period_s <= self.max_period_s:
            raise ValueError("need 0 < base_period_s <= max_period_s")
        if not 0 < self.min_pull_s <= self.max_pull_s:
            raise ValueError("need 0 < min_pull_s <= max_pull_s")
        if not (0 < self.refresh_share and 0 <= self.gossip_share
                and self.refresh_share + self.gossip_share <= 1):
            raise ValueError("shares must be positive and sum to at most 1")
        if not 0 <= self.jitter < 0.5:
            raise ValueError("jitter must be in [0, 0.5)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The timing for a swarm of ``peers``, and the traffic it is modelled to cost."""

    peers: int
    period_s: float
    pull_s: float
    window_s: float
    expiry_s: float
    #: modelled inbound refresh traffic per peer (see the module docstring)
    bytes_per_s: float
    #: mean seconds one peer must wait between two gossiped events
    gossip_interval_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PullOrder:
    """Pull from ``peer_id``: the full view when ``cutoff`` is None, else what was signed since."""

    peer_id: str
    cutoff: float | None

    @property
    def full(self) -> bool:
        return self.cutoff is None


@dataclass(frozen=True, slots=True)
class SwarmEstimate:
    """What one peer knows of the swarm: ``View.estimate(now)``, or figures of a simulator."""

    #: live peers, ourselves included
    peers: int
    #: mean bytes of a signed announcement; 0 for ``ScheduleConfig.announcement_bytes``
    wire_bytes: float = 0.0
    #: announcements per second that are events (a join, a state or stage change, a leave)
    #: rather than periodic refreshes
    events_per_s: float = 0.0


def _pull_s(n: int, period: float, c: ScheduleConfig) -> float:
    return min(max(period / (math.log(n) + 8.0), c.min_pull_s), c.max_pull_s)


def _window_s(n: int, pull_s: float, c: ScheduleConfig) -> float:
    return (math.log(n) + c.window_rounds) * pull_s + c.skew_s


def refresh_traffic(n: int, period: float, c: ScheduleConfig, wire_bytes: float,
                    events_per_s: float = 0.0) -> float:
    """Modelled inbound bytes/s per peer of announcements, digests and pull framing."""
    pull = _pull_s(n, period, c)
    window = _window_s(n, pull, c)
    per_version = wire_bytes + 3
    return (n * per_version / period
            + c.fingerprint_bytes * n * min(1.0, window / period) / pull
            + events_per_s * (per_version + c.fingerprint_bytes * window / pull)
            + 2 * c.message_overhead_bytes / pull)


def gossip_cost(c: ScheduleConfig, wire_bytes: float) -> float:
    """Modelled bytes one gossiped message costs every peer (mesh duplicates + IHAVE)."""
    return (c.gossip_degree * (wire_bytes + c.gossip_envelope_bytes)
            + c.gossip_degree * c.gossip_history * c.gossip_id_bytes)


@lru_cache(maxsize=4096)
def _plan(n: int, c: ScheduleConfig, wire_bytes: float, events_per_s: float) -> Plan:
    budget = c.refresh_share * c.budget_bytes_per_s

    def over(period: float) -> bool:
        return refresh_traffic(n, period, c, wire_bytes, events_per_s) > budget

    lo, hi = c.base_period_s, c.max_period_s
    if over(lo):
        if over(hi):
            lo = hi  # cannot meet the budget: announce as rarely as allowed
        else:    # the traffic decreases as the period grows: bisect
            while hi - lo > 1e-3 * hi:
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if over(mid) else (lo, mid)
            lo = hi
    period = lo
    pull = _pull_s(n, period, c)
    gossip_budget = c.gossip_share * c.budget_bytes_per_s
    return Plan(peers=n, period_s=period, pull_s=pull, window_s=_window_s(n, pull, c),
                expiry_s=c.expiry_periods * period,
                bytes_per_s=refresh_traffic(n, period, c, wire_bytes, events_per_s),
                gossip_interval_s=(n * gossip_cost(c, wire_bytes) / gossip_budget
                                   if gossip_budget > 0 else math.inf))


def plan(estimate: SwarmEstimate, config: ScheduleConfig) -> Plan:
    """The timing for a swarm as we estimate it (pure; cached)."""
    n = max(1, int(estimate.peers))
    size = float(round(estimate.wire_bytes)) if estimate.wire_bytes > 0 \
        else config.announcement_bytes
    events = float(f"{max(0.0, estimate.events_per_s):.2g}")  # 2 digits: the cache stays small
    return _plan(n, config, size, events)


class Schedule:
    """One daemon's timers. Ask ``*_due(now)``; call ``announce``/``pull`` when acting on them.

    ``estimate`` is ``view.estimate(now)``: it steers the period and the pull interval.
    """

    def __init__(self, config: ScheduleConfig | None = None, *, now: float,
                 rng: random.Random) -> None:
        self.config = config or ScheduleConfig()
        self._rng = rng
        self._next_announce = now          # announce at once
        self._last_announce = -math.inf
        self._next_pull = now              # and pull the full view at once
        self._have_full_view = False
        self._tokens = 0.0
        self._tokens_at = now

    def plan(self, estimate: SwarmEstimate) -> Plan:
        return plan(estimate, self.config)

    @property
    def next_announce_at(self) -> float:
        return self._next_announce

    @property
    def next_pull_at(self) -> float:
        return self._next_pull

    def next_wakeup(self) -> float:
        return min(self._next_announce, self._next_pull)

    # -------------------------------------------------------------------------- announcing

    def announce_due(self, now: float) -> bool:
        return now >= self._next_announce

    def changed(self, now: float) -> None:
        """Our stage or state changed: announce as soon as the minimum gap allows."""
        soonest = self._last_announce + self.config.min_gap_s
        self._next_announce = max(soonest, min(self._next_announce, now))

    def announce(self, now: float, estimate: SwarmEstimate) -> float:
        """We announce now. Returns the period to declare in the announcement; the next one is
        due within it (up to ``jitter`` of it early)."""
        if now < self._last_announce + self.config.min_gap_s:
            raise ValueError("announce() called again within min_gap_s; wait for announce_due")
        period = self.plan(estimate).period_s
        self._last_announce = now
        self._next_announce = now + period * (1.0 - self.config.jitter * self._rng.random())
        return period

    # ----------------------------------------------------------------------------- pulling

    def pull_due(self, now: float) -> bool:
        return now >= self._next_pull

    def pull(self, now: float, estimate: SwarmEstimate,
             candidates: Sequence[str], *, wall: float | None = None) -> PullOrder | None:
        """We pull now: from whom (uniformly among ``candidates``: peers of our view but us,
        or the bootstrap peers while the view is empty) and what (the full view until we got
        one, else the delta window). None when there is nobody to ask. ``wall``: the wall
        clock the delta window's cutoff is in (announcements are signed in it), when ``now``
        is another clock (a daemon's timers run on the monotonic one); default ``now``."""
        p = self.plan(estimate)
        jitter = self.config.jitter * (2.0 * self._rng.random() - 1.0)
        self._next_pull = now + p.pull_s * (1.0 + jitter)
        if not candidates:
            return None
        target = candidates[self._rng.randrange(len(candidates))]
        full = not self._have_full_view or estimate.peers <= 1
        return PullOrder(peer_id=target,
                         cutoff=None if full else (now if wall is None else wall) - p.window_s)

    def pulled(self, now: float, order: PullOrder, *, ok: bool) -> None:
        """A pull (all its pages) finished or failed. A failed full pull is retried soon."""
        if order.full:
            if ok:
                self._have_full_view = True
            else:
                self._next_pull = min(self._next_pull, now + self.config.min_pull_s)

    # ------------------------------------------------------------------------------ gossip

    def may_gossip(self, now: float, estimate: SwarmEstimate) -> bool:
        """Whether to also publish the event just announced on gossip (takes a token)."""
        interval = self.plan(estimate).gossip_interval_s
        if math.isfinite(interval):
            self._tokens = min(1.0, self._tokens + max(0.0, now - self._tokens_at) / interval)
        self._tokens_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
