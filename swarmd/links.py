"""What each link to a peer can do, and deadlines derived from it (issue 11). Pure.

A fixed 30 s timeout is wrong both ways: far too long for a 100 B request on a LAN (a dead peer
holds work up for 30 s) and too short for averaging a 1B-parameter stage over 100 Mbit/s. So a
deadline is derived from what the call moves and what was measured on that link::

    deadline = clamp(floor_s, slack x (round_trips x rtt + bytes / bandwidth) + extra_s, cap_s)

``rtt`` and ``bandwidth`` are moving averages of what :class:`LinkEstimates` observed with that
peer (round trips of small requests; bytes over seconds of large transfers); before anything was
measured the policy's defaults stand in, chosen for a slow home uplink so that a first transfer
is not cut short. Time is a parameter (``now``); the table of peers is bounded.

A rate cap that is known (``[limits]``: the far side's upload cap, which a state source says
in its offer, or our own download cap) bounds the link: ``max_bandwidth`` makes the expected
time at least ``bytes / cap``, and a caller's ``cap_s`` yields to ``slack x bytes / cap`` (a
deadline the cap cannot meet would only fail the call again). ``chunks_in_flight``: how many
requests of a chunk each to keep in flight through such a cap (more do not go faster, they only
make each one wait longer).
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["DeadlinePolicy", "LinkEstimates", "Link", "Transfer", "links_for", "chunks_in_flight",
           "TYPICAL_HOP_BYTES", "TYPICAL_ROUND_BYTES", "TYPICAL_CHUNK_BYTES"]

#: the sizes the status shows derived deadlines for: a hop's activations, what a round
#: exchanges with one peer, a state download's chunks in flight (4 of 4 MiB)
TYPICAL_HOP_BYTES = 1 << 20
TYPICAL_ROUND_BYTES = 64 << 20
TYPICAL_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Transfer:
    """What one call (or one peer's share of a round) moves with ``peer``."""

    peer: str
    nbytes: int
    round_trips: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadlinePolicy:
    #: no deadline is shorter (scheduling noise, a peer's GC pause)
    floor_s: float = 5.0
    #: no deadline is longer (a configuration key may lower it)
    cap_s: float = 3600.0
    #: the expected time is multiplied by this
    slack: float = 3.0
    #: before a round trip was measured
    default_rtt_s: float = 0.3
    #: before a transfer was measured, bytes/s (8 Mbit/s, a slow home uplink)
    default_bandwidth: float = 1e6

    def __post_init__(self) -> None:
        for name in ("floor_s", "cap_s", "slack", "default_rtt_s", "default_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"DeadlinePolicy.{name} must be a finite number > 0")
        if self.floor_s > self.cap_s:
            raise ValueError("DeadlinePolicy: floor_s must be <= cap_s")
        if self.slack < 1:
            raise ValueError("DeadlinePolicy.slack must be >= 1")


@dataclass(slots=True)
class Link:
    """Estimates for one peer: seconds and bytes/s (None until measured)."""

    rtt_s: float | None = None
    bandwidth: float | None = None
    updated: float = 0.0
    samples: int = 0

    def to_json(self) -> dict[str, float | int | None]:
        return {"rtt_s": self.rtt_s, "bandwidth_bytes_s": self.bandwidth,
                "samples": self.samples}


@dataclass(slots=True)
class LinkEstimates:
    policy: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    #: weight of a new sample in the moving averages
    alpha: float = 0.3
    #: transfers smaller than this say little about bandwidth (they are mostly round trip)
    min_transfer_bytes: int = 64 << 10
    #: most peers remembered (least recently updated forgotten first)
    max_peers: int = 4096
    _links: OrderedDict[str, Link] = field(default_factory=OrderedDict)

    def link(self, peer: str) -> Link:
        """The estimates for ``peer`` (an empty one if nothing was measured)."""
        return self._links.get(peer) or Link()

    def observe_rtt(self, peer: str, seconds: float, now: float) -> None:
        """A request with a small payload took ``seconds`` from send to reply."""
        if not _usable(seconds):
            return
        link = self._touch(peer, now)
        link.rtt_s = seconds if link.rtt_s is None else _ema(link.rtt_s, seconds, self.alpha)

    def observe_rtt_at_least(self, peer: str, seconds: float, now: float) -> None:
        """A small request got no reply within ``seconds``: the round trip is at least that
        (a congested link), so the estimate is raised to it at once; answered requests bring
        it back down (``observe_rtt``)."""
        if not _usable(seconds):
            return
        link = self._touch(peer, now)
        link.rtt_s = max(link.rtt_s or 0.0, seconds)

    def observe_transfer(self, peer: str, nbytes: int, seconds: float, now: float) -> None:
        """``nbytes`` crossed the link in ``seconds`` (a send with its reply, or a download).
        The round trip is taken off when known; small transfers only update the round trip."""
        if not _usable(seconds) or nbytes < 0:
            return
        if nbytes < self.min_transfer_bytes:
            self.observe_rtt(peer, seconds, now)
            return
        link = self._touch(peer, now)
        moving = max(seconds - (link.rtt_s or 0.0), seconds / 2)
        rate = nbytes / moving
        link.bandwidth = rate if link.bandwidth is None else _ema(link.bandwidth, rate,
                                                                  self.alpha)

    def expected_s(self, peer: str, nbytes: int, *, round_trips: int = 1,
                   max_bandwidth: float | None = None) -> float:
        """Seconds a call moving ``nbytes`` to or from ``peer`` should take, without slack
        (``max_bandwidth``: a rate cap known to bind the link, bytes/s)."""
        link = self.link(peer)
        rtt = link.rtt_s if link.rtt_s is not None else self.policy.default_rtt_s
        bandwidth = link.bandwidth if link.bandwidth is not None else self.policy.default_bandwidth
        if max_bandwidth is not None and _usable_rate(max_bandwidth):
            bandwidth = min(bandwidth, float(max_bandwidth))
        return max(0, round_trips) * rtt + max(0, nbytes) / bandwidth

    def deadline(self, peer: str, nbytes: int, *, round_trips: int = 1, extra_s: float = 0.0,
                 cap_s: float | None = None, max_bandwidth: float | None = None) -> float:
        """The deadline for such a call: see the module's formula. ``extra_s`` is time the
        peer needs besides the link (its compute); ``cap_s`` lowers the policy's cap, but not
        below what ``max_bandwidth`` (a known rate cap, bytes/s) needs (the module doc)."""
        expected = self.expected_s(peer, nbytes, round_trips=round_trips,
                                   max_bandwidth=max_bandwidth)
        if cap_s is not None and max_bandwidth is not None and _usable_rate(max_bandwidth):
            need = self.policy.slack * max(0, nbytes) / float(max_bandwidth)
            cap_s = max(cap_s, need + max(0.0, extra_s))
        return self._clamped(expected, extra_s, cap_s)

    def deadline_all(self, transfers: Sequence[Transfer], *, extra_s: float = 0.0,
                     cap_s: float | None = None) -> float:
        """The deadline of transfers with several peers that share this peer's own link (an
        all-reduce round): their expected times add up (a bandwidth measured while they ran
        together is recorded as the aggregate, see :meth:`observe_shared`)."""
        expected = sum(self.expected_s(t.peer, t.nbytes, round_trips=t.round_trips)
                       for t in transfers)
        return self._clamped(expected, extra_s, cap_s)

    def observe_shared(self, transfers: Sequence[Transfer], seconds: float, now: float) -> None:
        """``transfers`` ran together for ``seconds`` (one round): each peer is credited with
        the share of the time its bytes took at the aggregate rate, so that
        :meth:`deadline_all` of the same transfers expects ``seconds`` again."""
        total = sum(max(0, t.nbytes) for t in transfers)
        if total <= 0 or not _usable(seconds):
            return
        for t in transfers:
            if t.nbytes >= self.min_transfer_bytes:
                self.observe_transfer(t.peer, t.nbytes, seconds * t.nbytes / total, now)

    def _clamped(self, expected: float, extra_s: float, cap_s: float | None) -> float:
        p = self.policy
        cap = p.cap_s if cap_s is None else max(p.floor_s, min(p.cap_s, cap_s))
        want = p.slack * expected + max(0.0, extra_s)
        return min(cap, max(p.floor_s, want))

    def forget(self, peer: str) -> None:
        self._links.pop(peer, None)

    def heard_since(self, since: float) -> dict[str, float]:
        """The peers something was measured with at or after ``since`` (a request answered,
        a transfer done): {peer: when}, on the clock the observations were made with."""
        out: dict[str, float] = {}
        for peer in reversed(self._links):  # most recently updated last
            when = self._links[peer].updated
            if when < since:
                break
            out[peer] = when
        return out

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        """Every link, for ``/api/v0/status``."""
        return {peer: link.to_json() for peer, link in self._links.items()}

    def status(self, *, hop_cap_s: float | None = None, round_cap_s: float | None = None,
               chunk_cap_s: float | None = None) -> dict[str, object]:
        """What ``/api/v0/status`` (and ``swarmd status``) shows: the policy, and per peer its
        estimates and the deadlines derived now for a typical hop (``TYPICAL_HOP_BYTES``,
        two round trips), a round's share with it (``TYPICAL_ROUND_BYTES``) and a state
        download's chunks in flight (``TYPICAL_CHUNK_BYTES``), under the callers' caps."""
        p = self.policy
        peers = {}
        for peer, link in self._links.items():
            row: dict[str, object] = dict(link.to_json())
            row["deadlines_s"] = {
                "hop": self.deadline(peer, TYPICAL_HOP_BYTES, round_trips=2, cap_s=hop_cap_s),
                "round": self.deadline(peer, TYPICAL_ROUND_BYTES, round_trips=4,
                                       cap_s=round_cap_s),
                "state_chunk": self.deadline(peer, TYPICAL_CHUNK_BYTES, cap_s=chunk_cap_s)}
            peers[peer] = row
        return {"policy": {"floor_s": p.floor_s, "cap_s": p.cap_s, "slack": p.slack,
                           "default_rtt_s": p.default_rtt_s,
                           "default_bandwidth_bytes_s": p.default_bandwidth},
                "typical_bytes": {"hop": TYPICAL_HOP_BYTES, "round": TYPICAL_ROUND_BYTES,
                                  "state_chunk": TYPICAL_CHUNK_BYTES},
                "peers": peers}

    def _touch(self, peer: str, now: float) -> Link:
        link = self._links.pop(peer, None) or Link()
        link.updated = now
        link.samples += 1
        self._links[peer] = link  # most recently updated last
        while len(self._links) > self.max_peers:
            self._links.popitem(last=False)
        return link


def chunks_in_flight(parallel: int, chunk_bytes: int, max_bandwidth: float | None, *,
                     within_s: float, slack: float) -> int:
    """How many requests of ``chunk_bytes`` each to keep in flight (at most ``parallel``):
    all of them with no known rate cap; through one, as many as the cap carries ``slack``
    times over within ``within_s``, at least one."""
    parallel = max(1, int(parallel))
    if max_bandwidth is None or not _usable_rate(max_bandwidth) or chunk_bytes <= 0:
        return parallel
    fits = float(max_bandwidth) * within_s / (max(1.0, slack) * chunk_bytes)
    return max(1, min(parallel, int(fits) if math.isfinite(fits) else parallel))


def _usable_rate(rate: float) -> bool:
    return (isinstance(rate, (int, float)) and not isinstance(rate, bool)
            and math.isfinite(rate) and rate > 0)


def _usable(seconds: float) -> bool:
    return isinstance(seconds, (int, float)) and math.isfinite(seconds) and 0 < seconds < 1e6


def _ema(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


#: one LinkEstimates per host (so per daemon): the router, the averager, state transfer and
#: membership of one daemon share what each of them measured. Keyed weakly: a closed host's
#: estimates go with it.
_BY_HOST: "weakref.WeakKeyDictionary[Any, LinkEstimates]" = weakref.WeakKeyDictionary()


def links_for(host: Any) -> LinkEstimates:
    """The estimates shared by everything that talks through ``host`` (made on first use)."""
    try:
        links = _BY_HOST.get(host)
    except TypeError:  # not weakly referenceable (a test's stand-in): its own estimates
        return LinkEstimates()
    if links is None:
        links = _BY_HOST[host] = LinkEstimates()
    return links
