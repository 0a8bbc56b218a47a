"""The wiring's tunables (``swarmd.pipeline.wiring``): one frozen value, validated when built;
and the row of a peer's wiring state that ``status`` shows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["Kind", "WiringConfig", "PeerWiringState", "PEER_ROUTING_STATES"]

Kind = Literal["forward", "backward"]
#: what ``PeerWiringState.state`` says, the worst first
PEER_ROUTING_STATES = ("banned", "paused", "slow", "ok")


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True, slots=True, kw_only=True)
class WiringConfig:
    #: cost of a backward task relative to a forward task of the same size
    backward_cost: float = 2.5
    #: weight of a new measurement in the throughput average (1: keep only the latest)
    ema_alpha: float = 0.2
    #: throughput (forward samples/s) of a peer that announced none; None: the stage's median
    prior_throughput: float | None = None
    #: a timeout divides a peer's throughput estimate by this
    slow_penalty: float = 2.0
    #: the slow factor's excess over 1 halves every this many seconds
    slow_half_life_s: float = 60.0
    #: repeated timeouts compound up to this factor
    slow_max_factor: float = 64.0
    #: first ban after an error; each consecutive error doubles it, up to ban_max_s
    ban_base_s: float = 15.0
    ban_max_s: float = 300.0
    #: forward samples of work one task in a peer's announced queue stands for
    queue_weight: float = 16.0
    #: a peer that answered busy sits out this long; doubling while it stays busy, capped
    busy_base_s: float = 0.25
    busy_max_s: float = 2.0
    #: first ban after a protocol violation; each further violation episode doubles it, capped
    violation_base_s: float = 60.0
    violation_max_s: float = 3600.0
    #: a peer not yet measured counts at most this many times the stage's best measured rate,
    #: whatever it announces (measured beats claimed)
    claim_multiple: float = 2.0
    #: tasks a peer not yet measured is given before its first answer, while a measured peer
    #: of the stage is in service (its probing share: a silent liar holds this many at most)
    probe_tasks: int = 4

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"WiringConfig: {what}")
        for name in ("backward_cost", "ema_alpha", "slow_penalty", "slow_half_life_s",
                     "slow_max_factor", "ban_base_s", "ban_max_s", "queue_weight",
                     "busy_base_s", "busy_max_s", "violation_base_s", "violation_max_s"):
            need(_finite(getattr(self, name)), f"{name} must be a finite number")
        need(self.backward_cost > 0, "backward_cost must be > 0 (2.5 in the SWARM paper)")
        need(0 < self.ema_alpha <= 1, "ema_alpha must be in (0, 1]")
        need(self.prior_throughput is None
             or (_finite(self.prior_throughput) and self.prior_throughput > 0),
             "prior_throughput must be None or a finite number > 0")
        need(self.slow_penalty >= 1, "slow_penalty must be >= 1 (1 disables it)")
        need(self.slow_half_life_s > 0, "slow_half_life_s must be > 0")
        need(self.slow_max_factor >= self.slow_penalty, "slow_max_factor must be >= slow_penalty")
        need(0 < self.ban_base_s <= self.ban_max_s, "need 0 < ban_base_s <= ban_max_s")
        need(self.queue_weight >= 0, "queue_weight must be >= 0")
        need(0 < self.busy_base_s <= self.busy_max_s, "need 0 < busy_base_s <= busy_max_s")
        need(0 < self.violation_base_s <= self.violation_max_s,
             "need 0 < violation_base_s <= violation_max_s")
        need(_finite(self.claim_multiple) and self.claim_multiple >= 1,
             "claim_multiple must be a finite number >= 1")
        need(type(self.probe_tasks) is int and self.probe_tasks >= 1,
             "probe_tasks must be an int >= 1")

    def cost(self, kind: Kind) -> float:
        """Cost of one sample of ``kind``, in forward passes."""
        if kind == "forward":
            return 1.0
        if kind == "backward":
            return self.backward_cost
        raise ValueError(f'kind must be "forward" or "backward", not {kind!r}')

    def ban_s(self, streak: int) -> float:
        """Length of the ban after ``streak`` consecutive errors (>= 1)."""
        return min(self.ban_max_s, self.ban_base_s * 2.0 ** min(max(streak, 1) - 1, 64))

    def violation_s(self, episodes: int) -> float:
        """Length of the ban after a peer's ``episodes``-th protocol violation (>= 1)."""
        return min(self.violation_max_s,
                   self.violation_base_s * 2.0 ** min(max(episodes, 1) - 1, 64))

    def busy_s(self, streak: int) -> float:
        """How long a peer sits out after ``streak`` busy answers in a row (>= 1)."""
        return min(self.busy_max_s, self.busy_base_s * 2.0 ** min(max(streak, 1) - 1, 64))


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerWiringState:
    """One peer as ``status`` shows it."""

    peer_id: str
    #: estimate in forward samples/s (before the slow factor); measured: from our own calls
    throughput: float
    measured: bool
    queue: int
    #: seconds of work sent, relative to the least loaded peer's history
    load: float
    #: when the ban ends; None when not banned
    banned_until: float | None
    error_streak: int
    slow_factor: float
    slow: bool
    chosen: int
    timeouts: int
    errors: int
    #: busy answers; when its pause after the last one ends (None: not paused)
    busy: int = 0
    busy_until: float | None = None
    #: ok, paused (busy), slow or banned (``PEER_ROUTING_STATES``)
    state: str = "ok"
    #: why it is banned ("violation:<reason>" or "error:<reason>"); None when not banned
    ban_reason: str | None = None
    #: seconds of ban left; None when not banned
    ban_left_s: float | None = None
    #: protocol violations counted, and the last one's reason (kept after its ban ends)
    violations: int = 0
    violation_reason: str | None = None
    #: whether the peer is in the stage's list now (a violator is remembered after it left)
    listed: bool = True
    #: the most it says it sustains (its announced throughput); None: no ceiling
    ceiling: float | None = None
    #: the share of its hops' time that is its compute (the ceiling counts times this)
    compute_share: float = 1.0
    #: the compute time its last reply said (None: none said yet)
    compute_s: float | None = None
    #: the ceiling in hop terms (``ceiling x compute_share``); None: no ceiling
    routing_ceiling: float | None = None
    #: the rate routing uses (before the slow factor): the routing ceiling, at most
    #: ``throughput`` (twice it once its compute rate is known)
    rate: float = 0.0
    #: whether the ceiling binds (routing believes less of it than its hops show)
    capped: bool = False
