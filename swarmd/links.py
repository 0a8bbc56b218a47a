"""What each link to a peer can do, and deadlines derived from it (issue 11). Pure.

A fixed 30 s timeout is wrong both ways: far too long for a 100 B request on a LAN (a dead peer
holds work up for 30 s) and too short for averaging a 1B-parameter stage over 100 Mbit/s. So a
deadline is derived from what the call moves and what was measured on that link::

    deadline = clamp(floor_s, slack x (round_trips x rtt + bytes / bandwidth) + extra_s, cap_s)

``rtt`` and ``bandwidth`` are moving averages of what :class:`LinkEstimates` observed with that
peer (round trips of small requests; bytes over seconds of large transfers); before anything was
measured the policy's defaults stand in, chosen for a slow home uplink so that a first transfer
is not cut short. Time is a parameter (``now``); the table of peers is bounded.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["DeadlinePolicy", "LinkEstimates", "Link"]


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

    def expected_s(self, peer: str, nbytes: int, *, round_trips: int = 1) -> float:
        """Seconds a call moving ``nbytes`` to or from ``peer`` should take, without slack."""
        link = self.link(peer)
        rtt = link.rtt_s if link.rtt_s is not None else self.policy.default_rtt_s
        bandwidth = link.bandwidth if link.bandwidth is not None else self.policy.default_bandwidth
        return max(0, round_trips) * rtt + max(0, nbytes) / bandwidth

    def deadline(self, peer: str, nbytes: int, *, round_trips: int = 1, extra_s: float = 0.0,
                 cap_s: float | None = None) -> float:
        """The deadline for such a call: see the module's formula. ``extra_s`` is time the
        peer needs besides the link (its compute); ``cap_s`` lowers the policy's cap."""
        p = self.policy
        cap = p.cap_s if cap_s is None else max(p.floor_s, min(p.cap_s, cap_s))
        want = p.slack * self.expected_s(peer, nbytes, round_trips=round_trips) + max(0.0, extra_s)
        return min(cap, max(p.floor_s, want))

    def forget(self, peer: str) -> None:
        self._links.pop(peer, None)

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        """Every link, for ``/api/v0/status``."""
        return {peer: link.to_json() for peer, link in self._links.items()}

    def _touch(self, peer: str, now: float) -> Link:
        link = self._links.pop(peer, None) or Link()
        link.updated = now
        link.samples += 1
        self._links[peer] = link  # most recently updated last
        while len(self._links) > self.max_peers:
            self._links.popitem(last=False)
        return link


def _usable(seconds: float) -> bool:
    return isinstance(seconds, (int, float)) and math.isfinite(seconds) and 0 < seconds < 1e6


def _ema(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new
