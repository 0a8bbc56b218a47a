"""Relay decisions without I/O: what a relay admits, when a client renews, how a peer is reached.

A relay (circuit relay v2 "hop") admits a reservation or a circuit only within its limits; a
refusal names its reason, which the adapter counts (``relay.refused.<reason>``) and answers with
``RESOURCE_LIMIT_EXCEEDED`` or ``NO_RESERVATION``. Time is a parameter (``now``, monotonic
seconds), so the rules are tested without a network or a clock.

Limits are sized for activations and gradients, not for go-libp2p's public relays (2 minutes,
128 KiB per circuit): by default a circuit may carry 8 GiB for an hour.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["RelayLimits", "RelayBook", "renewal_delay", "path_of", "circuit_addr",
           "REASONS"]

GiB = 1 << 30

#: every reason a relay refuses, as counted
REASONS = ("reservations_total", "reserve_rate", "no_reservation", "circuits_total",
           "circuits_per_peer", "circuit_bytes", "circuit_duration", "malformed",
           "relayed_hop")


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayLimits:
    """What one relay grants. Defaults fit a swarm's activations; all are per relay."""

    #: a reservation lasts this long unless renewed
    reservation_ttl_s: float = 3600.0
    #: reservations held at once (each is one peer: a peer holds at most one)
    max_reservations: int = 128
    #: a peer's reservation requests closer together than this are refused (renewals included)
    min_reserve_interval_s: float = 5.0
    #: circuits open at once through this relay
    max_circuits: int = 256
    #: circuits open at once that one peer is an end of (as dialer or as destination)
    max_circuits_per_peer: int = 16
    #: bytes one circuit may carry, both directions together
    max_circuit_bytes: int = 8 * GiB
    #: a circuit is closed after this long
    max_circuit_duration_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_circuits", "max_circuits_per_peer",
                     "max_circuit_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RelayLimits.{name} must be a positive integer, got {value!r}")
        for name in ("reservation_ttl_s", "max_circuit_duration_s"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"RelayLimits.{name} must be at least 1 second")
        if not 0.0 <= self.min_reserve_interval_s < self.reservation_ttl_s:
            raise ValueError("RelayLimits.min_reserve_interval_s must be at least 0 and "
                             "below reservation_ttl_s (a holder must be able to renew)")


class RelayBook:
    """Admission on a relay: rate of reservation requests, and open circuits per peer and total.

    Which peers hold a reservation is the caller's (py-libp2p keeps that table); the book is told
    ``held`` and ``total`` and keeps what the library does not: when each peer last asked, and
    circuits counted the moment they are admitted (the library counts them only once the
    destination accepted, so concurrent requests could all pass its check).
    """

    def __init__(self, limits: RelayLimits) -> None:
        self.limits = limits
        self._last_request: dict[str, float] = {}
        self._circuits_of: Counter[str] = Counter()
        self.circuits = 0

    def admit_reservation(self, peer: str, *, held: bool, total: int, now: float) -> str | None:
        """None when ``peer`` may reserve (or renew) now, else the refusal's reason.

        ``held``: the peer holds a live reservation (this is a renewal); ``total``: live
        reservations on the relay. A refused request does not move the peer's rate window, so a
        peer that floods is refused until it pauses, and one that paces itself is served.
        """
        last = self._last_request.get(peer)
        if last is not None and now - last < self.limits.min_reserve_interval_s:
            return "reserve_rate"
        if not held and total >= self.limits.max_reservations:
            return "reservations_total"
        self._last_request[peer] = now
        self._forget_old(now)
        return None

    def admit_circuit(self, src: str, dst: str) -> str | None:
        """None and the circuit counted as open, or the refusal's reason (nothing counted)."""
        if src == dst:
            return "malformed"  # a peer relayed to itself
        if self.circuits >= self.limits.max_circuits:
            return "circuits_total"
        cap = self.limits.max_circuits_per_peer
        if self._circuits_of[src] >= cap or self._circuits_of[dst] >= cap:
            return "circuits_per_peer"
        self.circuits += 1
        self._circuits_of[src] += 1
        self._circuits_of[dst] += 1
        return None

    def release_circuit(self, src: str, dst: str) -> None:
        """A circuit admitted by ``admit_circuit`` ended (once per admitted circuit)."""
        if self.circuits <= 0:
            raise AssertionError("release_circuit without an admitted circuit")
        self.circuits -= 1
        for peer in (src, dst):
            self._circuits_of[peer] -= 1
            if self._circuits_of[peer] <= 0:
                del self._circuits_of[peer]

    def circuits_of(self, peer: str) -> int:
        return self._circuits_of[peer]

    def _forget_old(self, now: float) -> None:
        """Bound the rate table: drop peers whose window has passed once it grows large."""
        if len(self._last_request) <= 4 * self.limits.max_reservations:
            return
        window = self.limits.min_reserve_interval_s
        for peer in [p for p, t in self._last_request.items() if now - t >= window]:
            del self._last_request[peer]


def renewal_delay(remaining_s: float, *, fraction: float = 0.5, floor_s: float = 1.0,
                  failures: int = 0) -> float:
    """Seconds until a client renews a reservation with ``remaining_s`` left.

    Renew after ``fraction`` of what is left, so a renewal that fails has time for retries;
    each consecutive failure halves the wait again. Never sooner than ``floor_s`` (unless less
    than that is left: then right away), so the loop is bounded in rate.
    """
    if remaining_s <= floor_s:
        return 0.0
    delay = remaining_s * fraction / (2 ** max(0, failures))
    return max(floor_s, min(delay, remaining_s - floor_s))


def path_of(transport_addrs: list[str]) -> str:
    """``"relayed"`` when every address of a connection goes through a ``/p2p-circuit``,
    ``"direct"`` otherwise (a connection whose addresses are unknown counts as direct: TCP)."""
    if transport_addrs and all("/p2p-circuit" in a for a in transport_addrs):
        return "relayed"
    return "direct"


def circuit_addr(relay_addr: str, relay_peer: str, me: str) -> str:
    """``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<me>`` from a relay address with or without
    its ``/p2p/<relay>`` suffix."""
    suffix = f"/p2p/{relay_peer}"
    base = relay_addr if relay_addr.endswith(suffix) else relay_addr + suffix
    return f"{base}/p2p-circuit/p2p/{me}"
