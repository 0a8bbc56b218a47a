"""A py-libp2p host for an asyncio program.

``Host`` is an async context manager that owns one py-libp2p host running on trio in a
dedicated thread (see ``transport.bridge``) and offers asyncio coroutines: dial, handlers per
protocol id, streams of framed messages, request/response with a deadline, ping and
publish/subscribe. Security is Noise only and multiplexing yamux only: a peer offering
plaintext, secio, TLS or mplex is refused. Identify and ping (``/ipfs/ping/1.0.0``) are answered
for any standard libp2p implementation.

Workarounds for py-libp2p 0.8.1 (shared/notes/py-libp2p.md): every handler is guarded (an
exception escaping one would stop the whole host); one connection per peer so a dial does not
wait 250 ms for a second one; an explicit dial lifts the 60 s negative dial cache; inbound
handshakes time out quickly and the inbound cap is high, so idle sockets cannot lock peers out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable, Sequence

import trio

from transport import libp2p_events, libp2p_tuning, liveness, observed
from transport.liveness_watch import LivenessWatch
from transport.bridge import TrioThread
from transport.counters import Counters
from transport.errors import (
    HandlerFailure,
    LocalUsageError,
    PeerProtocolError,
    PeerUnavailable,
    RemoteError,
    TransportClosed,
    TransportError,
)
from transport.errors import cause_of as _cause
from transport.identity import Identity
from transport.options import HostOptions
from transport.pubsub import PubsubBridge, Subscription
from transport.relay.node import RelayNode
from transport.requests import RequestReply
from transport.sendorder import Gates, set_unsent_lowat
from transport.stream import Stream
from transport.throttle import Throttle

log = logging.getLogger("transport.host")

PING_PROTOCOL = "/ipfs/ping/1.0.0"
Handler = Callable[[Stream], Awaitable[None]]
#: most addresses of one peer tried by ``ensure_connected`` (an announcement may list more)
MAX_DIAL_ADDRS = 8
#: observed-address reports kept for an ``on_observed`` set later (the latest ones)
EARLY_OBSERVED_MAX = 16


class Host(RequestReply):
    """``async with Host(identity, options) as host:`` — listening once entered."""

    def __init__(self, identity: Identity, options: HostOptions | None = None) -> None:
        self.identity = identity
        self.options = options or HostOptions()
        self.peer_id: str = identity.peer_id
        self.counters = Counters()
        #: the upload and download caps every stream shares (``HostOptions.*_bytes_s``)
        self.throttle = Throttle(self.options.upload_bytes_s, self.options.download_bytes_s,
                                 self.options.rate_burst_bytes, self.counters)
        self.bridge = TrioThread(name=f"libp2p-{self.peer_id[-6:]}")
        self._handlers: dict[str, Handler] = {}
        self._addrs: list[str] = []
        self._t_host: Any = None  # the libp2p host: trio side only
        self._t_nursery: trio.Nursery | None = None
        self._pubsub = PubsubBridge(self) if self.options.pubsub is not None else None
        #: relays and hole punching (transport.relay.node.RelayNode), None when not configured
        self.relay = RelayNode(self, self.options.relay) if self.options.relay else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._idle: dict[tuple[str, str], list[Stream]] = {}
        #: payload writes are cut into whole yamux frames (set at start)
        self.write_chunk_bytes = self.options.limits.chunk_bytes
        #: each peer's bulk writes in order (``transport.sendorder``; trio side only)
        self.gates = Gates(self.options.send_order, self.write_chunk_bytes)
        #: ``on_observed(peer_id, multiaddr)``, on the asyncio side: a peer connected directly
        #: said (identify's ``observed_addr``) it sees us at that address. Unchecked: one peer
        #: can say anything, believe an address only when several agree. Reports made before
        #: it is set (a daemon dials its bootstrap peers before its NAT service starts) are
        #: kept, the last ``EARLY_OBSERVED_MAX``, and given to it when it is set
        self._on_observed: Callable[[str, str], None] | None = None
        self._early_observed: list[tuple[str, str]] = []

    @property
    def on_observed(self) -> Callable[[str, str], None] | None:
        return self._on_observed

    @on_observed.setter
    def on_observed(self, callback: Callable[[str, str], None] | None) -> None:
        self._on_observed = callback
        early, self._early_observed = self._early_observed, []
        for peer_id, addr in early if callback is not None else ():
            self._tell_observed(callback, peer_id, addr)

    # ---- lifecycle -----------------------------------------------------------------------
    async def __aenter__(self) -> Host:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.bridge.start(self._t_main)
        log.info("libp2p host %s listening on %s", self.peer_id, ", ".join(self._addrs))

    async def close(self) -> None:
        for streams in self._idle.values():
            for stream in streams:
                stream.reset_soon()
        self._idle.clear()
        for task in list(self._handler_tasks):
            task.cancel()
        if self._handler_tasks:
            await asyncio.wait(self._handler_tasks, timeout=5.0)
        await self.bridge.stop()

    @property
    def addrs(self) -> list[str]:
        """Listening multiaddrs with ``/p2p/<peer id>``, real ports (never 0)."""
        return list(self._addrs)

    # ---- handlers ------------------------------------------------------------------------
    def set_handler(self, protocol: str, handler: Handler) -> None:
        """Serve ``protocol`` with ``handler(stream)``, now or when the host starts.

        The handler runs as an asyncio task. If it raises, the stream is reset, the error is
        logged and counted, the peer gets an error reply when possible, and the host goes on.
        """
        if not protocol.startswith("/"):
            raise LocalUsageError(f"protocol ids start with '/', got {protocol!r}")
        self._handlers[protocol] = handler
        if self.bridge.running:
            self.bridge.run_sync_soon(self._t_register, protocol)

    def remove_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)
        if self.bridge.running:
            self.bridge.run_sync_soon(self._t_unregister, protocol)

    # ---- outbound ------------------------------------------------------------------------
    async def dial(self, addr: str, *, timeout: float | None = None) -> str:
        """Connect to a ``.../p2p/<id>`` multiaddr; returns the peer id."""
        timeout = timeout or self.options.dial_timeout_s
        if self.relay is not None and "/p2p-circuit" in addr:
            return await self.relay.dial(addr, timeout=timeout)
        try:
            return await self._call(f"dial {addr}", self._t_dial, addr, timeout)
        except PeerUnavailable:
            self.counters.add("dial_failures")
            raise

    async def ensure_connected(self, peer_id: str, addrs: Sequence[str] = (), *,
                               timeout: float = 5.0) -> bool:
        """``connect``; False when it failed."""
        try:
            await self.connect(peer_id, addrs, timeout=timeout)
        except PeerUnavailable:
            return False
        return True

    async def connect(self, peer_id: str, addrs: Sequence[str] = (), *,
                      timeout: float = 5.0) -> None:
        """Connected to ``peer_id`` already, or after dialing the first of ``addrs`` that
        works: at most ``MAX_DIAL_ADDRS`` of them, only those ending in ``/p2p/<peer_id>``.
        A failure raises ``PeerUnavailable`` saying why (never a raw libp2p exception)."""
        if peer_id in await self.connected_peers():
            return
        suffix = f"/p2p/{peer_id}"
        usable = [a for a in addrs if isinstance(a, str) and a.endswith(suffix)]
        errors = []
        for addr in usable[:MAX_DIAL_ADDRS]:
            try:
                await self.dial(addr, timeout=timeout)
                return
            except TransportError as exc:  # LocalUsageError too: a malformed address
                errors.append(str(exc))
        self.counters.add("connect_failures")
        why = "; ".join(errors[-2:]) if errors else "no usable address for it"
        raise PeerUnavailable(f"cannot reach {peer_id}: {why}")

    async def open_stream(self, peer_id: str, protocol: str, *,
                          timeout: float | None = None) -> Stream:
        timeout = timeout or self.options.dial_timeout_s
        ns = await self._call(f"open {protocol} to {peer_id}", self._t_new_stream, peer_id,
                              protocol, timeout)
        return Stream(self, ns, peer_id, protocol)

    async def _call(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Cross to trio; whatever libp2p raises comes back as a ``TransportError``."""
        try:
            return await self.bridge.call(fn, *args)
        except TransportError:
            raise
        except Exception as exc:  # a libp2p exception the trio side did not convert
            self.counters.add("unconverted_libp2p_errors")
            raise PeerUnavailable(f"{what} failed: {_cause(exc)}") from None

    async def ping(self, peer_id: str, *, timeout: float = 5.0) -> float:
        """Round trip of a standard libp2p ping, in seconds (full precision)."""
        return await self._call(f"ping {peer_id}", self._t_ping, peer_id, timeout)

    async def connected_peers(self) -> list[str]:
        return await self._call("list connected peers", self._t_connected_peers)

    async def disconnect(self, peer_id: str) -> None:
        await self._call(f"disconnect {peer_id}", self._t_disconnect, peer_id)

    # ---- publish/subscribe ---------------------------------------------------------------
    async def publish(self, topic: str, data: bytes) -> None:
        if self._pubsub is None:
            raise LocalUsageError("this host was started without pubsub")
        await self._pubsub.publish(topic, data)

    async def subscribe(self, topic: str, *, queue_size: int = 256) -> Subscription:
        if self._pubsub is None:
            raise LocalUsageError("this host was started without pubsub")
        return await self._pubsub.subscribe(topic, queue_size=queue_size)

    def count_protocol_error(self, exc: PeerProtocolError) -> None:
        """Count a peer's protocol violation once, wherever it is seen first."""
        if not getattr(exc, "counted", False):
            exc.counted = True  # type: ignore[attr-defined]
            self.counters.add(f"protocol_errors.{exc.code}")

    # ---- asyncio side of inbound streams -------------------------------------------------
    def _start_handler(self, protocol: str, stream: Stream, done: trio.Event) -> None:
        handler = self._handlers.get(protocol)
        task = asyncio.ensure_future(self._run_handler(handler, stream))
        self._handler_tasks.add(task)

        def finished(t: asyncio.Task[None]) -> None:
            self._handler_tasks.discard(t)
            try:
                self.bridge.run_sync_soon(done.set)
            except TransportClosed:
                pass

        task.add_done_callback(finished)
        stream._handler_task = task  # type: ignore[attr-defined]

    async def _run_handler(self, handler: Handler | None, stream: Stream) -> None:
        self.counters.add("streams_accepted")
        if handler is None:  # removed between negotiation and dispatch
            stream.reset_soon()
            return
        try:
            await handler(stream)
        except PeerProtocolError as exc:
            log.info("peer %s broke %s: %s", stream.peer_id, stream.protocol, exc)
            await stream.fail(exc)
        except (PeerUnavailable, RemoteError) as exc:
            self.counters.add("peer_unavailable")
            log.debug("peer %s on %s went away: %s", stream.peer_id, stream.protocol, exc)
            stream.reset_soon()
        except asyncio.CancelledError:
            stream.reset_soon()
            raise
        except Exception as exc:
            self.counters.add("handler_errors")
            log.exception("handler for %s failed on a stream from %s", stream.protocol,
                          stream.peer_id)
            code = exc.code if isinstance(exc, TransportError) else "internal_error"
            await stream.fail(HandlerFailure(code, f"{type(exc).__name__}: {exc}"))
        else:
            try:
                await stream.close()
            except TransportError:
                pass

    # ---- trio side -----------------------------------------------------------------------
    async def _t_main(self, ready: Callable[[], None]) -> None:
        import multiaddr
        from libp2p import new_host
        from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
        from libp2p.network.config import ConnectionConfig
        from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
        from libp2p.security.noise.transport import Transport as NoiseTransport
        from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
        from libp2p.stream_muxer.yamux.yamux import Yamux

        libp2p_events.install(self.counters)
        frame_payload = libp2p_tuning.apply(self.options.yamux_frame_bytes,
                                            self.options.batch_window_updates)
        chunk = self.options.limits.chunk_bytes
        self.write_chunk_bytes = max(1, chunk // frame_payload) * frame_payload
        self.gates.max_bytes = self.write_chunk_bytes
        key_pair = self.identity.key_pair
        listen = [multiaddr.Multiaddr(a) for a in self.options.listen]
        config = ConnectionConfig(
            max_connections_per_peer=1,
            # no auto-connector: it would dial every peer in the peerstore; who we connect
            # to is membership's decision
            max_connections=self.options.max_connections,
            min_connections=0,
            low_watermark=0,
            high_watermark=0,
            inbound_upgrade_timeout=self.options.handshake_timeout_s,
            outbound_upgrade_timeout=self.options.handshake_timeout_s,
            dial_timeout=self.options.dial_timeout_s,
        )
        host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_ID: NoiseTransport(key_pair, noise_privkey=new_x25519().private_key)},
            muxer_opt={YAMUX_ID: Yamux},
            connection_config=config,
            listen_addrs=listen,
        )
        self._t_host = host
        self._t_watch_observed(host)
        for protocol in self._handlers:
            self._t_register(protocol)
        async with host.run(listen), trio.open_nursery() as nursery:
            self._t_nursery = nursery
            self._t_watch_connections(host.get_network(), nursery)
            if self._pubsub is not None:
                await self._pubsub.t_start(host, nursery)
            if self.relay is not None:
                await self.relay.t_start(host, nursery)
            suffix = f"/p2p/{self.peer_id}"
            self._addrs = [a if a.endswith(suffix) else a + suffix
                           for a in (str(m) for m in host.get_addrs())]
            ready()
            await trio.sleep_forever()

    def _t_watch_connections(self, network: Any, nursery: trio.Nursery) -> None:
        """On every new connection: TCP tuning, the liveness watch, identify again if due."""
        tuning, policy = self.options.liveness, self.options.pings
        watch = LivenessWatch(policy, self.counters) if policy is not None else None
        again = observed.reidentify(self._t_host, nursery, self.counters)

        unsent = self.options.send_order.unsent_bytes

        def connected(conn: Any) -> None:
            sock = liveness.find_socket(conn)
            if sock is not None and not set_unsent_lowat(sock, unsent):
                self.counters.add("send_order.no_lowat")
            if tuning is not None:
                liveness.tune_connection(conn, tuning, self.counters)
            if watch is not None:
                watch.attach(conn)
            again(conn)

        network.register_notifee(liveness.notifee(connected))
        if watch is not None:
            nursery.start_soon(watch.t_run, network)

    def _t_watch_observed(self, lhost: Any) -> None:
        if not observed.watch(lhost, self._deliver_observed, self.counters):
            log.warning("py-libp2p's identify changed: observed addresses are not used "
                        "(expected 0.8.1)")

    def _deliver_observed(self, peer_id: str, addr: str) -> None:  # trio side
        self.bridge.to_asyncio(self._observed, peer_id, addr)

    def _observed(self, peer_id: str, addr: str) -> None:
        self.counters.add("observed_addrs.reports")
        callback = self._on_observed
        if callback is None:
            self._early_observed = [*self._early_observed, (peer_id, addr)][-EARLY_OBSERVED_MAX:]
            return
        self._tell_observed(callback, peer_id, addr)

    def _tell_observed(self, callback: Callable[[str, str], None], peer_id: str,
                       addr: str) -> None:
        try:
            callback(peer_id, addr)
        except Exception:
            self.counters.add("observed_addrs.callback_errors")
            log.exception("on_observed failed")

    def spawn_trio(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Trio side: run a background task owned by the host's nursery."""
        if self._t_nursery is not None:
            self._t_nursery.start_soon(fn, *args)

    def _t_register(self, protocol: str) -> None:
        from libp2p.custom_types import TProtocol

        if self._t_host is not None:
            self._t_host.set_stream_handler(TProtocol(protocol), self._t_make_handler(protocol))

    def _t_unregister(self, protocol: str) -> None:
        from libp2p.custom_types import TProtocol

        if self._t_host is not None:
            self._t_host.remove_stream_handler(TProtocol(protocol))

    def _t_make_handler(self, protocol: str) -> Callable[[Any], Awaitable[None]]:
        async def handle(net_stream: Any) -> None:
            # Nothing may escape: py-libp2p lets a handler's exception stop the whole host.
            stream: Stream | None = None
            try:
                peer_id = net_stream.muxed_conn.peer_id.to_base58()
                stream = Stream(self, net_stream, peer_id, protocol)
                done = trio.Event()
                self.bridge.to_asyncio(self._start_handler, protocol, stream, done)
                try:
                    await done.wait()
                except trio.Cancelled:  # host closing: stop the asyncio handler too
                    task = getattr(stream, "_handler_task", None)
                    if task is not None:
                        self.bridge.to_asyncio(task.cancel)
                    raise
            except trio.Cancelled:
                raise
            except BaseException:
                self.counters.add("handler_errors")
                log.exception("inbound %s stream failed before its handler ran", protocol)
                try:
                    with trio.CancelScope(shield=True):
                        await net_stream.reset()
                except BaseException:
                    pass

        return handle

    async def _t_dial(self, addr: str, timeout: float) -> str:
        import multiaddr
        from libp2p.peer.peerinfo import info_from_p2p_addr

        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:
            raise LocalUsageError(f"cannot dial {addr!r}: not a multiaddr ending in /p2p/<peer "
                                  f"id> ({exc})") from None
        if info.peer_id == self._t_host.get_id():
            raise LocalUsageError(f"refusing to dial {addr}: that is this host's own peer id")
        self._t_host.get_network().unblock_peer(info.peer_id)  # it may be back: try again now
        try:
            with trio.fail_after(timeout):
                await self._t_host.connect(info)
        except trio.TooSlowError:
            raise PeerUnavailable(f"dial {addr}: no connection within {timeout:.3g} s") from None
        except Exception as exc:
            raise PeerUnavailable(f"dial {addr} failed: {_cause(exc)}") from None
        return info.peer_id.to_base58()

    async def _t_new_stream(self, peer_id: str, protocol: str, timeout: float) -> Any:
        from libp2p.custom_types import TProtocol

        pid = _t_peer_id(peer_id)
        try:
            with trio.fail_after(timeout):
                return await self._t_host.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError:
            raise PeerUnavailable(f"open {protocol} to {peer_id}: no stream within "
                                  f"{timeout:.3g} s") from None
        except Exception as exc:
            raise PeerUnavailable(f"open {protocol} to {peer_id} failed: {_cause(exc)}") from None

    async def _t_ping(self, peer_id: str, timeout: float) -> float:
        from libp2p.custom_types import TProtocol

        pid = _t_peer_id(peer_id)
        payload = os.urandom(32)
        try:
            with trio.fail_after(timeout):
                stream = await self._t_host.new_stream(pid, [TProtocol(PING_PROTOCOL)])
                try:
                    start = time.perf_counter()
                    await stream.write(payload)
                    echo = b""
                    while len(echo) < 32:
                        chunk = await stream.read(32 - len(echo))
                        if not chunk:
                            break
                        echo += chunk
                    elapsed = time.perf_counter() - start
                finally:
                    with trio.CancelScope(shield=True):
                        await _close_quietly(stream)
        except trio.TooSlowError:
            raise PeerUnavailable(f"ping {peer_id}: no answer within {timeout:.3g} s") from None
        except TransportError:
            raise
        except Exception as exc:
            raise PeerUnavailable(f"ping {peer_id} failed: {_cause(exc)}") from None
        if echo != payload:
            raise PeerProtocolError(f"ping {peer_id}: the echo does not match what was sent")
        return elapsed

    async def _t_connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self._t_host.get_connected_peers()]

    async def _t_disconnect(self, peer_id: str) -> None:
        await self._t_host.disconnect(_t_peer_id(peer_id))


def _t_peer_id(peer_id: str) -> Any:
    from libp2p.peer.id import ID

    try:
        return ID.from_base58(peer_id)
    except Exception:
        raise LocalUsageError(f"{peer_id!r} is not a libp2p peer id") from None


async def _close_quietly(stream: Any) -> None:
    try:
        await stream.close()
    except Exception:
        pass
