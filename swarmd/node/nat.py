"""Behind NAT: know whether peers can dial us, and be reachable through relays when not.

``async with NatService(host, membership, config) as nat:`` runs the dial-back checks
(``swarmd.node.dialback``); while the verdict is ``private`` it keeps reservations on
``network.relay_reservations`` relays (peers of the swarm with direct addresses that accept a
reservation; tried in random order, bounded per round), renews them (the transport does), moves
to another relay when one is lost, and makes membership announce the ``/p2p-circuit``
addresses. It re-checks when the daemon's connections all dropped (its router restarted).
Everything it decides is shown by :meth:`status` (``/api/v0/status``, ``swarmd status``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from swarmd.addresses import AddressPolicy, ObservedAddresses, at_listen_port
from swarmd.node.dialback import DialbackService
from swarmd.node.reachability import PRIVATE, PUBLIC, Reachability
from swarmd.protocols import Protocols
from transport.errors import TransportError

log = logging.getLogger("swarmd.nat")

__all__ = ["NatService", "NatStatus", "OPEN_PORT_HINT"]

#: relays tried per round at most (a swarm where most peers refuse costs bounded time)
MAX_TRIES_PER_ROUND = 6
#: distinct peers that must report the same observed address (identify) before we announce it
OBSERVED_MIN_PEERS = 3
#: an observer's report stands this long (identify runs once per connection, and connections
#: last: a short window would forget a right address on a quiet swarm)
OBSERVED_WINDOW_S = 6 * 3600.0
#: while public: how often the relays are looked at (only to free slots we no longer need)
ROUND_S = 20.0
#: while private or unknown (at start, until the first dial-back answers): how often the
#: relays' connections and the verdict are looked at (local calls), so relays are reserved
#: seconds after the verdict says private
CHECK_S = 3.0
#: failed reserve-agains after which a relay we lost is given up for another
REJOIN_TRIES = 3
OPEN_PORT_HINT = ("peers cannot dial this machine: if you can, forward TCP port {port} on your "
                  "router to it and set network.announce to your public address "
                  "(/ip4/<public ip>/tcp/{port}); until then it is reached through relays")


@dataclass(frozen=True, slots=True)
class NatStatus:
    reachability: str
    relays: tuple[str, ...]
    relayed_addrs: tuple[str, ...]
    hint: str = ""
    #: our addresses as several peers observed them (identify), announced
    observed_addrs: tuple[str, ...] = ()


class NatService:
    def __init__(self, host: Any, membership: Any, config: Any, *,
                 rng: random.Random | None = None) -> None:
        self.host = host
        self.membership = membership
        self.want = int(config.network.relay_reservations)
        self._rng = rng or random.Random()
        # one answer decides: a swarm often has a single public peer to ask. A peer that lies
        # "unreachable" costs us a relay slot; one that lies "reachable" is outvoted by the
        # next honest answer (the majority of the latest answers wins)
        self.dialback = DialbackService(
            host, Protocols(config.swarm.name).dialback, addrs_of=self._addrs_of,
            own_addrs=self._direct_addrs, candidates=self._candidates, rng=self._rng,
            reachability=Reachability(min_agree=1))
        self._task: asyncio.Task[None] | None = None
        self.counters: dict[str, int] = {}
        self.observed = ObservedAddresses(min_observers=OBSERVED_MIN_PEERS,
                                          window_s=OBSERVED_WINDOW_S)
        network = config.network
        #: ``network.announce`` set: the user said where we are reached, observations change
        #: nothing; ``network.no_announce`` filters observed addresses too
        self._announce_set = bool(tuple(network.announce))
        self._policy = AddressPolicy(no_announce=tuple(network.no_announce))
        self._confirmed: tuple[str, ...] = ()
        self._rejoin_failures: dict[str, int] = {}

    async def __aenter__(self) -> NatService:
        await self.dialback.__aenter__()
        self.membership.extra_addrs = self._extra_addrs
        self.host.on_observed = self._on_observed
        if getattr(self.host, "relay", None) is not None:
            self._task = asyncio.create_task(self._keep_relays(), name="relays")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.host.on_observed = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.dialback.__aexit__(*exc)

    def status(self) -> NatStatus:
        verdict = self.dialback.verdict()
        relay = getattr(self.host, "relay", None)
        relays = tuple(relay.reservations) if relay is not None else ()
        relayed = tuple(relay.relayed_addrs) if relay is not None else ()
        port = next((a.split("/")[4] for a in self.host.addrs if "/tcp/" in a), "31337")
        return NatStatus(verdict, relays, relayed,
                         OPEN_PORT_HINT.format(port=port) if verdict == PRIVATE else "",
                         self._confirmed)

    # ---- observed addresses ----------------------------------------------------------------
    def _on_observed(self, peer: str, addr: str) -> None:
        """A peer told us (identify) where it sees us; believed once enough peers agree."""
        at = at_listen_port(addr, self.host.addrs)
        if at is None:
            self._count("observed.unusable")
            return
        self._count("observed.reports")
        now = time.monotonic()
        self.observed.observed(peer, at, now)
        confirmed = tuple(a for a in self.observed.confirmed(now) if not self._policy.blocks(a))
        if confirmed != self._confirmed:
            self._confirmed = confirmed
            self._count("observed.changes")
            log.info("peers observe us at %s", ", ".join(confirmed) or "no agreed address")
            self.membership.changed()  # announce it (and the dial-back re-checks)

    def _extra_addrs(self) -> tuple[str, ...]:
        """Announced before the bound addresses: relayed ones (dialers try in order), then
        the observed ones several peers agree on."""
        suffix = f"/p2p/{self.host.peer_id}"
        observed = () if self._announce_set else tuple(a + suffix for a in self._confirmed)
        return self._relayed_addrs() + observed

    # ---- what the dial-back and the relays need -------------------------------------------
    def _addrs_of(self, peer: str) -> tuple[str, ...]:
        ann = self.membership.view.get(peer)
        return tuple(ann.addrs) if ann is not None else ()

    def _direct_addrs(self) -> tuple[str, ...]:
        return tuple(a for a in self.membership.announced_addrs() if "/p2p-circuit" not in a)

    def _candidates(self) -> list[str]:
        """Peers of the view with a direct address (a relayed peer cannot dial us back)."""
        me = self.host.peer_id
        return [a.peer_id for a in self.membership.view.announcements(_now())
                if a.peer_id != me and any("/p2p-circuit" not in x for x in a.addrs)]

    def _relayed_addrs(self) -> tuple[str, ...]:
        """While not known public: reservations are made only while private and released
        once public, and a re-check after our addresses changed (unknown for a moment)
        must not withdraw the circuits others reach us by."""
        relay = getattr(self.host, "relay", None)
        if relay is None or self.dialback.verdict() == PUBLIC:
            return ()
        return tuple(relay.relayed_addrs)

    # ---- relays -------------------------------------------------------------------------
    async def _keep_relays(self) -> None:
        while True:
            verdict = self.dialback.verdict()
            relay = self.host.relay
            held = set(relay.reservations)
            connected = set(await self.host.connected_peers())
            if verdict == PUBLIC and held:
                for peer in held:  # reachable again: free the relays' slots
                    await relay.release(peer)
            elif verdict == PRIVATE:
                await self._rejoin(held - connected)
                if len(relay.reservations) < self.want:
                    await self._reserve_more(set(relay.reservations))
            if not connected:
                self.dialback.recheck()  # everything dropped (our router restarted?)
            await asyncio.sleep(ROUND_S if verdict == PUBLIC else CHECK_S)

    async def _rejoin(self, lost: set[str]) -> None:
        """Relays we hold a slot on but are no longer connected to (our router restarted, or
        theirs): reserve again now, which dials them, rather than at the next renewal (half
        an hour away): a relay can only hand us circuits over a live connection."""
        for peer in sorted(lost)[:MAX_TRIES_PER_ROUND]:
            try:
                await self.host.relay.reserve(peer, self._addrs_of(peer))
            except TransportError as exc:
                self._count("relay.rejoin_failed")
                failures = self._rejoin_failures[peer] = self._rejoin_failures.get(peer, 0) + 1
                log.debug("relay %s: reserving again failed (%d): %s", peer, failures, exc)
                if failures >= REJOIN_TRIES:  # gone: free the place for another relay
                    self._rejoin_failures.pop(peer, None)
                    await self.host.relay.release(peer)
                    self._count("relay.abandoned")
                    log.info("relay %s is unreachable: moving to another", peer)
                    self.membership.changed()
                continue
            self._rejoin_failures.pop(peer, None)
            self._count("relay.rejoined")
            log.info("reconnected to relay %s and renewed the slot", peer)
            self.membership.changed()

    async def _reserve_more(self, held: set[str]) -> None:
        # a peer that announces relayed addresses of its own is behind NAT itself (a
        # hole-punched connection to it does not make it one others can reach): no relay for
        # us. One that dialed us through a relay may well be public: it is asked (a dial to
        # a NATed one that has no relay yet fails and costs one try of this round)
        peers = [p for p in self._candidates() if p not in held
                 and not any("/p2p-circuit" in a for a in self._addrs_of(p))]
        self._rng.shuffle(peers)
        for peer in peers[:MAX_TRIES_PER_ROUND]:
            if len(self.host.relay.reservations) >= self.want:
                return
            try:
                await self.host.relay.reserve(peer, self._addrs_of(peer))
            except TransportError as exc:
                self._count("relay.reserve_refused")
                log.debug("relay %s refused a reservation: %s", peer, exc)
                continue
            self._count("relay.reserved")
            log.info("reserved a relay slot on %s", peer)
            self.membership.changed()  # announce the circuit address now

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


def _now() -> float:
    return time.time()  # the view's announcements are timed by the signed wall clock
