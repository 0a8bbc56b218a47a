"""Dead connections are found and closed by the kernel (issue 12, "Recovery").

A home router that restarts drops every packet for a while and then forgets its NAT table. The
TCP connections through it look established to py-libp2p on both ends until TCP gives up,
which takes many minutes (15 retransmissions) or, on an idle connection, never: requests on them
time out one by one, the daemon never sees "every connection lost" and so never re-dials. So
every TCP connection the host makes or accepts gets

* ``TCP_USER_TIMEOUT``: data sent and not acknowledged for ``dead_after_s`` aborts the
  connection (a slow but live link keeps acknowledging; only a dead one trips it), and
* keepalive probes after ``keepalive_idle_s`` of silence, so an idle connection is tested too
  (with a user timeout set, Linux aborts when the probes stay unanswered that long).

The user timeout is off by default (``Liveness.dead_after_s``); what finds dead connections by
default is the application-level check of ``transport.liveness_watch`` (pings, and a connection
dropped only when nothing at all was heard on it), which keepalive helps: the peer's kernel
answers the probes of an idle live connection.

py-libp2p 0.8.1 offers no hook for socket options: the socket is found by walking from the
swarm connection to its ``trio.SocketStream`` along the attributes named in ``_PATH`` (a
relayed connection has none: its TCP connection is the relay's, tuned on its own). Options the
platform lacks are skipped.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("transport.liveness")

__all__ = ["Liveness", "find_socket", "tune", "tune_connection", "notifee"]

#: attributes from a SwarmConn down to the trio.SocketStream, in the order they are tried:
#: SwarmConn.muxed_conn (Yamux) .secured_conn (Noise session) .conn (RawConnection)
#: .stream (TrioTCPStream) .stream (trio.SocketStream)
_PATH = ("muxed_conn", "secured_conn", "conn", "read_writer", "read_write_closer", "stream")
_MAX_DEPTH = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Liveness:
    #: unacknowledged data for this long kills the connection (0: the kernel's default). Off
    #: by default: Linux counts a zero window (a live peer that stops reading, as py-libp2p
    #: does while a stream's buffer is full) against it too, and aborted a 100 MB all-reduce
    #: at 50 Mbit/s after 25 s; keepalive still finds idle dead connections
    dead_after_s: float = 0.0
    #: silence before the first keepalive probe
    keepalive_idle_s: float = 10.0
    #: between probes
    keepalive_interval_s: float = 5.0
    keepalive_probes: int = 3

    def __post_init__(self) -> None:
        from transport.errors import LocalUsageError

        if self.dead_after_s < 0 or not self.keepalive_idle_s >= 1 \
                or not self.keepalive_interval_s >= 1 or self.keepalive_probes < 1:
            raise LocalUsageError("Liveness needs dead_after_s >= 0, keepalive idle and "
                                  "interval >= 1 s and at least one probe")


def find_socket(conn: Any) -> Any:
    """The ``socket`` of the TCP connection under a py-libp2p connection, None when there is
    none (a relayed connection, a transport this does not know)."""
    import trio

    obj = conn
    for _ in range(_MAX_DEPTH):
        if isinstance(obj, trio.SocketStream):
            return obj.socket
        if type(obj).__name__ in ("YamuxStream", "NetStream", "MplexStream"):
            return None  # a stream of another connection: a relayed one
        for name in _PATH:
            nxt = getattr(obj, name, None)
            if nxt is not None and nxt is not obj:
                obj = nxt
                break
        else:
            return None
    return None


def tune(sock: Any, liveness: Liveness) -> bool:
    """Set keepalive and the user timeout on ``sock``; False when any option failed."""
    wanted = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", liveness.keepalive_idle_s),
                        ("TCP_KEEPINTVL", liveness.keepalive_interval_s),
                        ("TCP_KEEPCNT", liveness.keepalive_probes)):
        if hasattr(socket, name):
            wanted.append((socket.IPPROTO_TCP, getattr(socket, name), int(value)))
    if liveness.dead_after_s > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
        wanted.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                       int(liveness.dead_after_s * 1000)))
    ok = True
    for level, option, value in wanted:
        try:
            sock.setsockopt(level, option, value)
        except OSError as exc:
            log.debug("setsockopt(%s, %s) failed: %s", level, option, exc)
            ok = False
    return ok


def tune_connection(conn: Any, liveness: Liveness, counters: Any) -> None:
    """Trio side, for each new connection: tune its TCP socket, counting what happened."""
    sock = find_socket(conn)
    if sock is None:
        counters.add("liveness.no_socket")  # relayed, or a transport we do not know
    elif tune(sock, liveness):
        counters.add("liveness.tuned")
    else:
        counters.add("liveness.tune_failed")


def notifee(on_connected: Callable[[Any], None]) -> Any:
    """A py-libp2p network notifee calling ``on_connected(conn)`` for every new connection."""
    from transport.notifee import on_connected as notify

    return notify(on_connected, "tuning a new connection")
