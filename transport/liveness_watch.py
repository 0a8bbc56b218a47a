"""Application-level liveness on every connection (issue 12): the trio-side adapter of
``transport.liveness_policy``.

For each connection it records when something was last *heard*: any bytes read from the secure
channel under yamux (its ``read`` is wrapped), and on a TCP connection also what the kernel saw
(``TCP_INFO``'s last data and last acknowledgement received, and unread bytes waiting in the
receive buffer: those arrived, our side is the slow one). A silent connection is pinged with a
yamux ping frame (answered by any yamux implementation's read loop, no stream used); one the
policy declares dead is shut down, so the swarm drops it and the reconnect and relay code
re-dial. Pings per silence are bounded (``PingPolicy.max_pings``) and at most one ping write is
in flight per connection (a write is never cancelled half-way: that would corrupt the Noise
stream). A muxer without yamux pings is never declared dead.
"""

from __future__ import annotations

import array
import logging
import socket
import struct
import time
import weakref
from typing import Any, Callable

import trio

from transport.liveness import find_socket
from transport.liveness_policy import DEAD, PING, ConnClock, PingPolicy

log = logging.getLogger("transport.liveness")

__all__ = ["LivenessWatch", "kernel_heard"]

#: offset of tcpi_last_data_recv in Linux's struct tcp_info (tcpi_last_ack_recv follows)
_TCPI_LAST_DATA_RECV = 52
_TCP_INFO_LEN = 104
#: the longest a dead connection's close may take before it is left to the swarm
_CLOSE_TIMEOUT_S = 5.0


def kernel_heard(sock: Any, now: float) -> float | None:
    """When the kernel last received anything from the peer on ``sock`` (``now`` when unread
    bytes are waiting); None when the platform cannot say."""
    try:
        import fcntl
        import termios

        waiting = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting)
        if waiting[0] > 0:
            return now
    except (ImportError, OSError, AttributeError):
        pass
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_LEN)
        data_ms, ack_ms = struct.unpack_from("=II", info, _TCPI_LAST_DATA_RECV)
    except (OSError, struct.error):
        return None
    return now - min(data_ms, ack_ms) / 1000.0


class _Conn:
    __slots__ = ("clock", "sock", "pinging", "nonce", "__weakref__")

    def __init__(self, clock: ConnClock, sock: Any) -> None:
        self.clock = clock
        self.sock = sock
        self.pinging = False
        self.nonce = 0


class LivenessWatch:
    """Trio side only: ``attach`` each new connection, run ``t_run`` in the host's nursery."""

    def __init__(self, policy: PingPolicy, counters: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.counters = counters
        self.clock = clock
        self._conns: weakref.WeakKeyDictionary[Any, _Conn] = weakref.WeakKeyDictionary()

    def attach(self, conn: Any) -> None:
        """Start watching ``conn`` (a SwarmConn): wrap its secure channel's ``read``."""
        state = _Conn(ConnClock(last_heard=self.clock()), find_socket(conn))
        self._conns[conn] = state
        secured = getattr(getattr(conn, "muxed_conn", None), "secured_conn", None)
        read = getattr(secured, "read", None)
        if read is None:
            self.counters.add("liveness.unwatched")
            return
        clock, heard = self.clock, state.clock.heard

        async def watched_read(n: int | None = None) -> bytes:
            data = await read(n)
            if data:
                heard(clock())
            return data

        try:
            secured.read = watched_read
        except AttributeError:  # slots: reads are not seen, only the kernel's view
            self.counters.add("liveness.unwatched")

    async def t_run(self, network: Any) -> None:
        """Check every connection about once a second, for as long as the host runs."""
        period = min(1.0, self.policy.ping_every_s / 2, self.policy.answer_wait_s / 2)
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(period)
                try:
                    self._t_check(network, nursery)
                except Exception:  # never let liveness take the host down
                    self.counters.add("liveness.check_errors")
                    log.exception("liveness check failed")

    def _t_check(self, network: Any, nursery: trio.Nursery) -> None:
        now = self.clock()
        for conns in list(network.connections.values()):
            for conn in list(conns) if isinstance(conns, (list, tuple)) else [conns]:
                state = self._conns.get(conn)
                if state is None or getattr(conn, "is_closed", False):
                    continue
                if state.sock is not None and now - state.clock.last_heard >= 1.0:
                    at = kernel_heard(state.sock, now)
                    if at is not None:
                        state.clock.heard(at)
                verdict = state.clock.decide(now, self.policy)
                if verdict == PING and not state.pinging:
                    state.clock.pinged(now)
                    state.pinging = True
                    nursery.start_soon(self._t_ping, conn, state)
                elif verdict == DEAD:
                    del self._conns[conn]
                    self.counters.add("liveness.dead_closed")
                    log.info("connection to %s heard nothing for %.0f s and its pings went "
                             "unanswered: closing it", _peer(conn), now - state.clock.last_heard)
                    nursery.start_soon(self._t_close, conn, state)

    async def _t_ping(self, conn: Any, state: _Conn) -> None:
        muxed = getattr(conn, "muxed_conn", None)
        write = getattr(muxed, "_write_frame", None)
        try:
            if write is None:
                self.counters.add("liveness.no_ping")
                return
            from libp2p.stream_muxer.yamux.yamux import (
                FLAG_SYN,
                TYPE_PING,
                YAMUX_HEADER_FORMAT,
            )

            state.nonce = (state.nonce + 1) & 0xFFFFFFFF
            # py-libp2p's yamux times every ping ACK against its own last ping: ours would
            # give it a false round trip (its window auto-tuning uses it) unless timed too
            if hasattr(muxed, "_ping_sent_time"):
                muxed._ping_sent_time = trio.current_time()
            await write(struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_PING, FLAG_SYN, 0,
                                    0x5A000000 | (state.nonce & 0xFFFFFF)))
            self.counters.add("liveness.pings")
        except Exception as exc:  # the connection is going away: the swarm drops it
            self.counters.add("liveness.ping_failed")
            log.debug("ping to %s failed: %s", _peer(conn), exc)
        finally:
            state.pinging = False

    async def _t_close(self, conn: Any, state: _Conn) -> None:
        if state.sock is not None:
            try:  # wakes every read and write on it at once, whatever they wait for
                state.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with trio.move_on_after(_CLOSE_TIMEOUT_S):
            try:
                await conn.close()
            except Exception as exc:
                log.debug("closing the dead connection to %s: %s", _peer(conn), exc)


def _peer(conn: Any) -> str:
    try:
        return conn.muxed_conn.peer_id.to_base58()
    except Exception:
        return "?"
