"""A py-libp2p network notifee that calls back on every new connection. Used by the host's
TCP liveness tuning and by the relay node's watch for direct connections."""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("transport.notifee")


def on_connected(callback: Callable[[Any], None], what: str) -> Any:
    """A notifee calling ``callback(conn)`` for every new connection (inbound and outbound);
    nothing it raises reaches the swarm's ``add_conn`` (logged at debug level, as ``what``)."""
    from libp2p.abc import INotifee

    class _Connected(INotifee):
        async def connected(self, network: Any, conn: Any) -> None:
            try:
                callback(conn)
            except Exception:
                log.debug("%s failed", what, exc_info=True)

        async def opened_stream(self, network: Any, stream: Any) -> None:
            pass

        async def closed_stream(self, network: Any, stream: Any) -> None:
            pass

        async def disconnected(self, network: Any, conn: Any) -> None:
            pass

        async def listen(self, network: Any, multiaddr: Any) -> None:
            pass

        async def listen_close(self, network: Any, multiaddr: Any) -> None:
            pass

    return _Connected()
