"""Identify's observed addresses, passed on (issue 12, "Addresses").

Each peer that runs identify with us (py-libp2p does, on every new connection) tells us the
address it sees our connection come from: behind a NAT, the router's public address and the
port it mapped. py-libp2p 0.8.1 records these in its ``ObservedAddrManager`` (only for direct
connections: one seen over a relay names the relay) and offers no event, so :func:`watch`
wraps that manager's ``record_observation`` and hands each report, as (observer peer id,
multiaddr text), to ``deliver`` on the trio side. Nothing here believes a report: one peer can
claim anything (``swarmd.node.addresses.ObservedAddresses`` confirms across peers).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("transport.observed")

__all__ = ["watch"]

#: longest observed address passed on (a multiaddr of a TCP address is far shorter)
MAX_ADDR_CHARS = 256


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
