"""Hole punching: py-libp2p 0.8.1's DCUtR, told what to do once a connection went direct.

``libp2p.relay.circuit_v2.dcutr.DCUtRProtocol`` tries, every 2 s and at most 3 times per peer,
to upgrade each relayed connection: first a plain dial to the peer's known direct addresses
(spec step 0, "unilateral"), then the CONNECT/SYNC exchange and simultaneous dials. What it
lacks, and this subclass adds:

- a signal on success (the unilateral path, dcutr.py:525-530, reports it to no one and never
  closes the relayed connection): ``_upgraded(peer_id)`` runs once per upgrade, and also when
  the other end drove it (``RelayNode`` watches new connections);
- the relayed connection is closed after ``grace_s`` (the library waits a fixed 60 s,
  dcutr.py:68 and :959, bound as a default argument), so circuits do not linger on the relay.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from transport.counters import Counters

log = logging.getLogger("transport.relay")


class CountingDCUtR(DCUtRProtocol):
    def __init__(self, host: Any, counters: Counters, on_direct: Callable[[Any], None], *,
                 timeout_s: float, grace_s: float) -> None:
        t = max(1, int(timeout_s))
        super().__init__(host, read_timeout=t, write_timeout=t, dial_timeout=t)
        self.counters = counters
        self.on_direct = on_direct
        self.grace_s = grace_s
        self._closing: set[Any] = set()

    async def initiate_hole_punch(self, peer_id: Any) -> bool:
        ok = await super().initiate_hole_punch(peer_id)
        if ok:
            self._upgraded(peer_id)
        return ok

    async def _perform_hole_punch(self, peer_id: Any, addrs: Any,
                                  as_responder: bool = False) -> bool:
        ok = await super()._perform_hole_punch(peer_id, addrs, as_responder)
        self.counters.add("relay.hole_punch_ok" if ok else "relay.hole_punch_failed")
        if ok:
            self._upgraded(peer_id)
        return ok

    def _schedule_relay_close(self, peer_id: Any) -> None:
        """Replaced by ``_upgraded`` (our grace, once per peer)."""

    def _upgraded(self, peer_id: Any) -> None:
        if peer_id in self._closing or self._nursery is None:
            return
        self._closing.add(peer_id)
        self.counters.add("relay.upgraded_direct")
        try:
            self.on_direct(peer_id)
        except Exception:
            log.exception("on_direct hook failed")
        self._nursery.start_soon(self._close_relayed_later, peer_id)

    async def _close_relayed_later(self, peer_id: Any) -> None:
        try:
            await self._close_relayed_conns_after_grace(peer_id, grace=self.grace_s)
        finally:
            self._closing.discard(peer_id)

    def on_peer_disconnected(self, peer_id: Any) -> None:
        super().on_peer_disconnected(peer_id)
        self._closing.discard(peer_id)
