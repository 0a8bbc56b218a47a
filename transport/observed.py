"""Identify's observed addresses, passed on (issue 12, "Addresses").

Each peer that runs identify with us (py-libp2p does, on every new connection) tells us the
address it sees our connection come from: behind a NAT, the router's public address and the
port it mapped. py-libp2p 0.8.1 records these in its ``ObservedAddrManager`` (only for direct
connections: one seen over a relay names the relay) and offers no event, so :func:`watch`
wraps that manager's ``record_observation`` and hands each report, as (observer peer id,
multiaddr text), to ``deliver`` on the trio side. Nothing here believes a report: one peer can
claim anything (``swarmd.addresses.ObservedAddresses`` confirms across peers).

py-libp2p identifies a peer once (its protocols stay cached in the peerstore): a peer first
reached through a relay, or again after our router restarted, would never report what it sees
of the new direct connection. :func:`reidentify` runs identify once more on such a connection,
once it is the peer's first (identify asks on that one).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import trio

log = logging.getLogger("transport.observed")

__all__ = ["watch", "reidentify"]

#: longest observed address passed on (a multiaddr of a TCP address is far shorter)
MAX_ADDR_CHARS = 256
#: how long a new direct connection may wait to become the peer's first (a relayed one is
#: closed some seconds after a direct one exists), and how often it looks
REIDENTIFY_WAIT_S = 30.0
REIDENTIFY_POLL_S = 1.0
#: the longest identify exchange (py-libp2p's own read deadline is 10 s)
IDENTIFY_DEADLINE_S = 20.0


def watch(lhost: Any, deliver: Callable[[str, str], None], counters: Any) -> bool:
    """Wrap ``lhost``'s observed-address manager; False when this py-libp2p has none."""
    manager = getattr(lhost, "_observed_addr_manager", None)
    record = getattr(manager, "record_observation", None)
    if not callable(record):
        return False

    def recorded(conn: Any, observed: Any, local_addrs: Any) -> None:
        record(conn, observed, local_addrs)
        try:
            peer = conn.muxed_conn.peer_id.to_base58()
            text = str(observed)
        except Exception:
            counters.add("observed_addrs.unreadable")
            return
        if len(text) > MAX_ADDR_CHARS:
            counters.add("observed_addrs.too_long")
            return
        try:
            deliver(peer, text)
        except Exception:  # never into identify
            counters.add("observed_addrs.deliver_failed")
            log.debug("passing an observed address on failed", exc_info=True)

    manager.record_observation = recorded
    return True


def reidentify(lhost: Any, nursery: trio.Nursery, counters: Any) -> Callable[[Any], None]:
    """``connected(conn)`` for a notifee: a new direct connection to a peer py-libp2p has
    identified already gets identify once more (one task per connection, bounded in time)."""
    identify = getattr(lhost, "_identify_peer", None)
    cached = getattr(lhost, "_has_cached_protocols", None)
    if not callable(identify) or not callable(cached):
        return lambda conn: None

    def connected(conn: Any) -> None:
        peer = getattr(getattr(conn, "muxed_conn", None), "peer_id", None)
        if peer is not None and not _relayed(conn) and cached(peer):
            nursery.start_soon(_identify_again, lhost, conn, peer, identify, counters)
    return connected


async def _identify_again(lhost: Any, conn: Any, peer: Any, identify: Any,
                          counters: Any) -> None:
    network = lhost.get_network()
    with trio.move_on_after(REIDENTIFY_WAIT_S):
        while True:
            conns = network.get_connections(peer)
            if conn not in conns or getattr(conn, "is_closed", False):
                return
            if conns[0] is conn:
                break
            await trio.sleep(REIDENTIFY_POLL_S)
    if network.get_connections(peer)[:1] != [conn]:
        counters.add("observed_addrs.reidentify_gave_up")
        return
    with trio.move_on_after(IDENTIFY_DEADLINE_S):
        try:
            await identify(peer, reason="direct-connection-again")
            counters.add("observed_addrs.reidentified")
        except Exception:  # identify's own failures are its business: nothing to repair
            counters.add("observed_addrs.reidentify_failed")
            log.debug("identify on a new direct connection failed", exc_info=True)


def _relayed(conn: Any) -> bool:
    try:
        return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses() or ())
    except Exception:
        return False
