"""Relays and hole punching for a :class:`transport.host.Host` (circuit relay v2 and DCUtR).

``RelayNode`` belongs to one host (``host.relay``, present when ``HostOptions.relay`` is set).
On the trio side it runs py-libp2p's circuit relay v2 (``transport.relay.hop``: the STOP side
always, so relayed connections are accepted; the HOP side when ``RelayOptions.serve``) and,
when ``RelayOptions.hole_punch``, py-libp2p's DCUtR service, whose loop tries every 2 s to
upgrade each relayed connection to a direct one (at most 3 attempts per peer).

From asyncio: ``reserve(relay, addrs)`` holds a slot on a relay and renews it before it
expires (``policy.renewal_delay``); ``relayed_addrs`` are the ``/p2p-circuit`` addresses others
can dial us at; ``dial(circuit_addr)`` (also reached through ``Host.dial``) connects through a
relay; ``paths()`` says which peers are reached directly and which only relayed. Once a direct
connection exists (DCUtR on either end, or any direct dial), the host's pooled request streams to
that peer are dropped, new streams use the direct connection (py-libp2p prefers direct ones when
it picks), and the relayed one is closed after ``RelayOptions.relayed_close_grace_s``.

Wall clock: a reservation's expiry is Unix time on the wire (spec); it is turned into a
monotonic deadline once, when the relay's answer arrives.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import trio

from transport.errors import LocalUsageError, PeerUnavailable
from transport.relay.policy import circuit_addr, path_of, renewal_delay

if TYPE_CHECKING:
    from transport.host import Host
    from transport.options import RelayOptions

log = logging.getLogger("transport.relay")

#: longest reservation a client believes (a relay answering "in 10 years" is clamped)
MAX_BELIEVED_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldReservation:
    """A slot held on a relay, as the client sees it."""

    relay: str
    #: monotonic deadline
    expires_at: float
    #: where others dial us through this relay
    circuit_addrs: tuple[str, ...]
    renewals: int = 0


class RelayRefused(PeerUnavailable):
    """The relay answered with a status other than OK (no slot, over a limit, ...)."""

    code = "relay_refused"


class RelayNode:
    def __init__(self, host: Host, options: RelayOptions) -> None:
        self.host = host
        self.options = options
        self.counters = host.counters
        self._held: dict[str, HeldReservation] = {}
        self._renewers: dict[str, trio.CancelScope] = {}
        #: where each relay was dialed (a renewal or a reserve-again may have no fresher ones)
        self._relay_addrs: dict[str, tuple[str, ...]] = {}
        self._t_host: Any = None
        self._nursery: trio.Nursery | None = None
        self.hop: Any = None  # transport.relay.hop.CountingHop, trio side
        self.dcutr: Any = None

    # ---- asyncio side --------------------------------------------------------------------------
    async def reserve(self, relay_peer: str, relay_addrs: Sequence[str] = (), *,
                      timeout: float | None = None) -> HeldReservation:
        """Reserve a slot on ``relay_peer`` (dialing ``relay_addrs`` if not connected) and keep
        it renewed until ``release``. Raises ``RelayRefused`` or ``PeerUnavailable``."""
        timeout = timeout or self.options.reserve_timeout_s
        return await self.host.bridge.call(self._t_reserve, relay_peer, tuple(relay_addrs),
                                           timeout)

    async def release(self, relay_peer: str) -> None:
        """Stop renewing; the slot lapses on the relay at its expiry."""
        await self.host.bridge.call(self._t_release, relay_peer)

    @property
    def reservations(self) -> dict[str, HeldReservation]:
        return dict(self._held)

    @property
    def relayed_addrs(self) -> list[str]:
        """``/p2p-circuit`` addresses of every live reservation, for announcing."""
        now = time.monotonic()
        return [a for h in list(self._held.values()) if h.expires_at > now
                for a in h.circuit_addrs]

    async def dial(self, addr: str, *, timeout: float | None = None) -> str:
        """Connect through the relay named in ``<relay addr>/p2p-circuit/p2p/<peer>``."""
        timeout = timeout or self.host.options.dial_timeout_s
        try:
            return await self.host.bridge.call(self._t_dial, addr, timeout)
        except PeerUnavailable:
            self.counters.add("relay.dial_failures")
            raise

    async def paths(self) -> dict[str, str]:
        """Each connected peer: ``"direct"`` (at least one direct connection) or ``"relayed"``."""
        return await self.host.bridge.call(self._t_paths)

    async def stats(self) -> dict[str, int]:
        """What this host serves as a relay now: live reservations and open circuits."""
        return await self.host.bridge.call(self._t_stats)

    async def hole_punch(self, peer_id: str, *, timeout: float = 30.0) -> bool:
        """Try DCUtR now (besides the background loop); True when a direct connection exists."""
        if self.options.hole_punch is False:
            raise LocalUsageError("this host was started without hole punching")
        return await self.host.bridge.call(self._t_hole_punch, peer_id, timeout)

    # ---- trio side: start -------------------------------------------------------------------
    async def t_start(self, lhost: Any, nursery: trio.Nursery) -> None:
        """Called once in the host's trio main, after the libp2p host listens."""
        from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID, STOP_PROTOCOL_ID

        from transport.relay.hop import CountingHop

        self._t_host, self._nursery = lhost, nursery
        self.hop = CountingHop(lhost, self.options.limits, self.counters,
                               allow_hop=self.options.serve,
                               timeout_s=self.options.reserve_timeout_s)
        await nursery.start(self._t_serve, self.hop)
        if self.options.serve:
            lhost.set_stream_handler(PROTOCOL_ID, self._guard(self.hop._handle_hop_stream))
        lhost.set_stream_handler(STOP_PROTOCOL_ID, self._guard(self.hop._handle_stop_stream))
        lhost.get_network().register_notifee(_direct_watch(self))
        if self.options.hole_punch:
            from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_ID

            from transport.relay.punch import CountingDCUtR

            self.dcutr = CountingDCUtR(lhost, self.counters, self._t_went_direct,
                                       timeout_s=self.options.reserve_timeout_s,
                                       grace_s=self.options.relayed_close_grace_s)
            await nursery.start(self._t_serve, self.dcutr)
            lhost.set_stream_handler(DCUTR_ID, self._guard(self.dcutr._handle_dcutr_stream))

    def _t_went_direct(self, pid: Any) -> None:
        """A direct connection to ``pid`` now exists besides a relayed one (DCUtR on either
        end, or any direct dial): new requests must not reuse pooled streams that may run over
        the relayed one, which DCUtR closes after the grace period."""
        self.host.bridge.to_asyncio(self._drop_pooled, pid.to_base58())

    def t_on_connected(self, conn: Any) -> None:
        """Network notifee: a direct connection arrived to a peer we reach relayed."""
        pid = conn.muxed_conn.peer_id
        if path_of([str(a) for a in conn.get_transport_addresses()]) != "direct":
            return
        others = self._t_host.get_network().connections.get(pid, [])
        others = others if isinstance(others, list) else [others]
        if not any(c is not conn and path_of([str(a) for a in c.get_transport_addresses()])
                   == "relayed" for c in others):
            return
        if self.dcutr is not None:
            self.dcutr._upgraded(pid)  # counts, drops pooled streams, closes relayed later
        else:
            self._t_went_direct(pid)

    def _drop_pooled(self, peer_id: str) -> None:
        # Host keeps idle request streams per (peer, protocol); a fresh stream is placed on the
        # best (direct) connection by py-libp2p. Host has no public call for this yet.
        idle = self.host._idle
        for key in [k for k in idle if k[0] == peer_id]:
            for stream in idle.pop(key, []):
                stream.reset_soon()

    @staticmethod
    async def _t_serve(service: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from libp2p.tools.anyio_service import background_trio_service

        async with background_trio_service(service):
            await service.event_started.wait()  # its own handlers are set: ours replace them
            task_status.started()
            await trio.sleep_forever()

    def _guard(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Nothing may escape a py-libp2p handler: an exception would stop the whole host."""

        async def guarded(stream: Any) -> None:
            try:
                await handler(stream)
            except BaseException as exc:
                if _only_cancelled(exc):  # the host is closing
                    raise
                self.counters.add("relay.handler_errors")
                log.exception("relay/DCUtR handler failed")
                with trio.CancelScope(shield=True):
                    try:
                        await stream.reset()
                    except BaseException:
                        pass

        return guarded

    # ---- trio side: client ------------------------------------------------------------------
    async def _t_connect(self, peer_text: str, addrs: Sequence[str]) -> Any:
        """The peer's ``ID``, connected (dialing ``addrs`` when not already)."""
        import multiaddr
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

        try:
            pid = ID.from_base58(peer_text)
        except Exception:
            raise LocalUsageError(f"{peer_text!r} is not a libp2p peer id") from None
        connected = pid in self._t_host.get_connected_peers()
        if connected and self._t_path(pid) == "direct":
            return pid
        plain = []
        for a in addrs:
            try:
                ma = multiaddr.Multiaddr(a)
                plain.extend(info_from_p2p_addr(ma).addrs if "/p2p/" in a else [ma])
            except Exception:
                raise LocalUsageError(f"{a!r} is not a multiaddr of {peer_text}") from None
        if connected:  # only through a relay: a relay refuses a reservation made that way
            network = self._t_host.get_network()
            for ma in plain[:4]:
                try:
                    await network.dial_addr(ma, pid)
                    return pid
                except Exception as exc:
                    log.debug("direct dial of %s at %s failed: %s", peer_text, ma, exc)
            return pid  # let the relayed connection answer (it may refuse)
        if not plain:
            raise PeerUnavailable(f"not connected to {peer_text} and no address to dial")
        self._t_host.get_network().unblock_peer(pid)
        try:
            await self._t_host.connect(PeerInfo(pid, plain))
        except Exception as exc:
            raise PeerUnavailable(f"dial {peer_text} failed: {exc}") from None
        return pid

    async def _t_reserve(self, relay: str, addrs: tuple[str, ...], timeout: float
                         ) -> HeldReservation:
        addrs = addrs or self._relay_addrs.get(relay, ())
        held = await self._t_reserve_once(relay, addrs, timeout)
        if addrs:
            self._relay_addrs[relay] = addrs
        if relay not in self._renewers and self._nursery is not None:
            scope = trio.CancelScope()
            self._renewers[relay] = scope
            self._nursery.start_soon(self._t_renew_loop, relay, addrs, scope)
        return held

    async def _t_reserve_once(self, relay: str, addrs: tuple[str, ...], timeout: float
                              ) -> HeldReservation:
        import multiaddr
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        try:
            with trio.fail_after(timeout):
                pid = await self._t_connect(relay, addrs)
                stream = await self._t_host.new_stream(pid, [PROTOCOL_ID])
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                    resp = await read_delimited_msg(stream, HopMessage)
                finally:
                    with trio.CancelScope(shield=True):
                        await _close_quietly(stream)
        except trio.TooSlowError:
            raise PeerUnavailable(f"reserve on {relay}: no answer within {timeout:.3g} s"
                                  ) from None
        except (PeerUnavailable, LocalUsageError):
            raise
        except Exception as exc:
            raise PeerUnavailable(f"reserve on {relay} failed: {exc}") from None
        status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
        if status != StatusCode.OK or not resp.HasField("reservation"):
            self.counters.add("relay.reserve_refused")
            raise RelayRefused(f"relay {relay} refused the reservation: {status.name}")
        remaining = min(float(resp.reservation.expire) - time.time(), MAX_BELIEVED_TTL_S)
        bases = []
        for raw in resp.reservation.addrs:
            try:
                bases.append(str(multiaddr.Multiaddr(bytes(raw))))
            except Exception:
                continue
        bases = bases or list(addrs)
        me = self.host.peer_id
        previous = self._held.get(relay)
        held = HeldReservation(
            relay=relay, expires_at=time.monotonic() + max(0.0, remaining),
            circuit_addrs=tuple(dict.fromkeys(circuit_addr(b, relay, me) for b in bases
                                              if "/p2p-circuit" not in b)),
            renewals=previous.renewals + 1 if previous else 0)
        self._held[relay] = held
        return held

    async def _t_renew_loop(self, relay: str, addrs: tuple[str, ...],
                            scope: trio.CancelScope) -> None:
        """Renew before expiry; each round sleeps at least a second (bounded rate)."""
        failures = 0
        with scope:
            while (held := self._held.get(relay)) is not None:
                remaining = held.expires_at - time.monotonic()
                if remaining <= 0:
                    self._held.pop(relay, None)
                    self.counters.add("relay.reservations_lost")
                    log.warning("reservation on relay %s expired: renewals failed", relay)
                    break
                await trio.sleep(renewal_delay(remaining, fraction=self.options.renew_fraction,
                                               failures=failures))
                try:
                    await self._t_reserve_once(relay, addrs, self.options.reserve_timeout_s)
                    failures = 0
                    self.counters.add("relay.renewals")
                except Exception as exc:  # refused or unreachable: retry sooner, until expiry
                    failures += 1
                    self.counters.add("relay.renew_failures")
                    log.info("renewing the reservation on %s failed: %s", relay, exc)
        self._renewers.pop(relay, None)

    async def _t_release(self, relay: str) -> None:
        scope = self._renewers.pop(relay, None)
        if scope is not None:
            scope.cancel()
        self._held.pop(relay, None)
        self._relay_addrs.pop(relay, None)

    async def _t_dial(self, addr: str, timeout: float) -> str:
        import multiaddr
        from libp2p.connection_types import ConnectionType
        from libp2p.network.connection.raw_connection import RawConnection
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
        from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        relay_part, sep, dest_part = addr.partition("/p2p-circuit")
        relay_peer = relay_part.rsplit("/p2p/", 1)[-1] if "/p2p/" in relay_part else ""
        if not sep or not relay_peer or not dest_part.startswith("/p2p/"):
            raise LocalUsageError(f"{addr!r} is not <relay addr>/p2p/<relay>/p2p-circuit/p2p/"
                                  f"<peer>")
        dest_text = dest_part[len("/p2p/"):]
        try:
            dest = ID.from_base58(dest_text)
        except Exception:
            raise LocalUsageError(f"{addr!r}: {dest_text!r} is not a peer id") from None
        if dest in self._t_host.get_connected_peers():
            return dest_text
        try:
            with trio.fail_after(timeout):
                relay_pid = await self._t_connect(relay_peer, [relay_part] if relay_part
                                                  .startswith("/ip") else [])
                stream = await self._t_host.new_stream(relay_pid, [PROTOCOL_ID])
                try:
                    await write_delimited_msg(stream, HopMessage(
                        type=HopMessage.CONNECT, peer=CircuitPeerId(id=dest.to_bytes())))
                    resp = await read_delimited_msg(stream, HopMessage)
                    status = (StatusCode(resp.status) if resp.HasField("status")
                              else StatusCode.OK)
                    if status != StatusCode.OK:
                        raise RelayRefused(f"relay {relay_peer} refused a circuit to "
                                           f"{dest_text}: {status.name}")
                    raw = RawConnection(stream=stream, initiator=True,
                                        connection_type=ConnectionType.RELAYED,
                                        addresses=[multiaddr.Multiaddr(
                                            f"/p2p/{relay_peer}/p2p-circuit/p2p/{dest_text}")])
                    await self._t_host.upgrade_outbound_connection(raw, dest)
                except BaseException:
                    with trio.CancelScope(shield=True):
                        try:
                            await stream.reset()
                        except Exception:
                            pass
                    raise
        except trio.TooSlowError:
            raise PeerUnavailable(f"dial {addr}: no relayed connection within {timeout:.3g} s"
                                  ) from None
        except (PeerUnavailable, LocalUsageError):
            raise
        except Exception as exc:
            raise PeerUnavailable(f"dial {addr} failed: {type(exc).__name__}: {exc}") from None
        self.counters.add("relay.circuits_dialed")
        return dest_text

    def _t_path(self, pid: Any) -> str:
        """``"direct"`` when any connection to ``pid`` is direct, else ``"relayed"``."""
        conns = self._t_host.get_network().connections.get(pid, [])
        for conn in conns if isinstance(conns, list) else [conns]:
            try:
                if path_of([str(a) for a in conn.get_transport_addresses()]) == "direct":
                    return "direct"
            except Exception:
                continue
        return "relayed"

    async def _t_paths(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for pid, conns in list(self._t_host.get_network().connections.items()):
            conns = conns if isinstance(conns, list) else [conns]
            paths = set()
            for conn in conns:
                try:
                    paths.add(path_of([str(a) for a in conn.get_transport_addresses()]))
                except Exception:
                    continue
            if paths:
                out[pid.to_base58()] = "direct" if "direct" in paths else "relayed"
        return out

    async def _t_stats(self) -> dict[str, int]:
        if self.hop is None or not self.options.serve:
            return {"reservations": 0, "circuits": 0}
        return {"reservations": self.hop.live_reservations(), "circuits": self.hop.book.circuits}

    async def _t_hole_punch(self, peer_text: str, timeout: float) -> bool:
        from libp2p.peer.id import ID

        if self.dcutr is None:
            return False
        with trio.move_on_after(timeout):
            return bool(await self.dcutr.initiate_hole_punch(ID.from_base58(peer_text)))
        return False


def _direct_watch(node: RelayNode) -> Any:
    from transport.notifee import on_connected

    return on_connected(node.t_on_connected, "direct-connection watch")


def _only_cancelled(exc: BaseException) -> bool:
    """``trio.Cancelled``, or a group of nothing else (a nursery cancelled from outside)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


async def _close_quietly(stream: Any) -> None:
    try:
        await stream.close()
    except Exception:
        pass
