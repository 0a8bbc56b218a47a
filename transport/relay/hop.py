"""The relay ("hop") side: py-libp2p 0.8.1's circuit relay v2 with our limits and counters.

``CountingHop`` subclasses ``libp2p.relay.circuit_v2.protocol.CircuitV2Protocol`` and keeps its
wire handling (reservation responses with signed vouchers, the STOP handshake with the
destination) while replacing what does not hold up (file:line under site-packages/libp2p/relay/
circuit_v2/, 0.8.1):

- protocol.py:510-511: RESERVE takes the reserving peer from the message's optional ``peer``
  field, so one peer can fill the relay's table with reservations for made-up peer ids. We
  clear the field: the reservation is always for the connection's remote peer (as the spec
  says).
- protocol.py:722 and 928-932: ``_active_relays`` is keyed by the destination peer, so when one
  of two circuits to the same destination ends, its clean-up closes the other circuit's
  streams. ``_relay_data`` is replaced by a pump that ends only its own circuit, both
  directions together (a local reset does not wake the other direction's pending read).
- protocol.py:847: the duration cap is checked only when data arrives (an idle circuit
  outlives it); ours is a real deadline.
- protocol.py:729: circuits are counted only after the destination accepted, so concurrent
  CONNECTs all pass the per-peer check; admission (``RelayBook``) counts them up front, adds a
  relay-wide cap and rate-limits reservation requests.
- protocol.py:335-359: the HOP loop treats a client closing its stream after one exchange as an
  error (logged, answered with MALFORMED_MESSAGE, then a 0.5 s sleep), and answers every
  message of a flood; ours ends quietly, and ends the stream at the first refusal.

Every refusal is counted as ``relay.refused.<reason>`` (see ``policy.REASONS``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol, _is_relayed_stream
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.resources import RelayLimits as LibRelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from transport.counters import Counters
from transport.relay.policy import RelayBook, RelayLimits

log = logging.getLogger("transport.relay")

#: most RESERVE messages one HOP stream may carry before it is closed
MAX_MESSAGES_PER_STREAM = 64
#: read size of the circuit pump (one yamux frame of the library's default size)
PUMP_READ_BYTES = 64 * 1024
#: how long a HOP stream may stay silent before its next message
HOP_READ_TIMEOUT_S = 30.0


def library_limits(limits: RelayLimits) -> LibRelayLimits:
    """The same limits in py-libp2p's terms (what it announces to clients in ``Limit``)."""
    return LibRelayLimits(
        duration=int(limits.max_circuit_duration_s),
        data=limits.max_circuit_bytes,
        # ours (RelayBook) counts circuits earlier and releases them later: it decides
        max_circuit_conns=limits.max_circuits,
        max_reservations=limits.max_reservations,
        reservation_ttl=int(limits.reservation_ttl_s),
    )


class _Pump:
    """The two directions of one circuit: when one ends, both do; a limit is counted once."""

    def __init__(self) -> None:
        self.scopes: list[trio.CancelScope] = []
        self.users = 0
        self.done = False
        self.tripped = False


class CountingHop(CircuitV2Protocol):
    """A circuit relay v2 hop (when ``allow_hop``) and stop handler, limited and counted."""

    def __init__(self, host: Any, limits: RelayLimits, counters: Counters, *,
                 allow_hop: bool, timeout_s: float) -> None:
        t = max(1, int(timeout_s))
        super().__init__(host, library_limits(limits), allow_hop=allow_hop, read_timeout=t,
                         write_timeout=t, close_timeout=t)
        self.book = RelayBook(limits)
        self.counters = counters
        self._pumps: dict[int, _Pump] = {}

    def refuse_count(self, reason: str) -> None:
        self.counters.add(f"relay.refused.{reason}")

    def live_reservations(self) -> int:
        rm = self.resource_manager
        rm._clean_expired()
        return len(rm._reservations)

    # ---- HOP stream: RESERVE (possibly repeated) or one CONNECT --------------------------------
    async def _handle_hop_stream(self, stream: Any) -> None:
        if _is_relayed_stream(stream):  # spec: no hop over a relayed connection
            self.refuse_count("relayed_hop")
            await self._status(stream, StatusCode.PERMISSION_DENIED)
            await self._close_stream(stream)  # a FIN after the status: a reset could drop it
            return
        for _ in range(MAX_MESSAGES_PER_STREAM):
            try:
                with trio.fail_after(HOP_READ_TIMEOUT_S):
                    msg = await read_delimited_msg(stream, HopMessage)
            except trio.TooSlowError:
                break
            except Exception:  # EOF after the last exchange, reset, or an oversized message
                break
            if msg.type == HopMessage.RESERVE:
                if not await self._handle_reserve(stream, msg):
                    break  # refused: the rest of a flood is not even read
            elif msg.type == HopMessage.CONNECT:
                await self._handle_connect(stream, msg)
                return  # the stream is the circuit's, or was reset
            else:
                self.refuse_count("malformed")
                await self._status(stream, StatusCode.MALFORMED_MESSAGE)
                break
        await self._close_stream(stream)

    async def _handle_reserve(self, stream: Any, msg: Any) -> bool:  # type: ignore[override]
        """Answer one RESERVE; False when it was refused (the caller then ends the stream)."""
        msg.ClearField("peer")  # the reservation is for who asks, never for a named peer
        peer = stream.muxed_conn.peer_id
        held = self.resource_manager.has_reservation(peer)
        reason = self.book.admit_reservation(peer.to_base58(), held=held,
                                             total=self.live_reservations(),
                                             now=time.monotonic())
        if reason is not None:
            self.refuse_count(reason)
            await self._status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return False
        self.counters.add("relay.reservations_renewed" if held else "relay.reservations_granted")
        await super()._handle_reserve(stream, msg)
        return True

    async def _handle_connect(self, stream: Any, msg: Any) -> None:
        src = stream.muxed_conn.peer_id
        try:
            dst = ID(bytes(msg.peer.id))
            dst_text = dst.to_base58()
        except Exception:
            dst_text = ""
        if not dst_text or not msg.HasField("peer"):
            self.refuse_count("malformed")
            await self._status(stream, StatusCode.MALFORMED_MESSAGE)
            await self._close_stream(stream)  # a FIN after the status: a reset could drop it
            return
        if self.resource_manager.get_reservation(dst) is None:  # none, expired or gone
            self.refuse_count("no_reservation")
            await self._status(stream, StatusCode.NO_RESERVATION)
            await self._close_stream(stream)  # a FIN after the status: a reset could drop it
            return
        reason = self.book.admit_circuit(src.to_base58(), dst_text)
        if reason is not None:
            self.refuse_count(reason)
            await self._status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            await self._close_stream(stream)  # a FIN after the status: a reset could drop it
            return
        self.counters.add("relay.circuits_opened")
        try:
            await super()._handle_connect(stream, msg)
        finally:
            self.book.release_circuit(src.to_base58(), dst_text)
            self._forget_streams(stream)

    # ---- one direction of a circuit ----------------------------------------------------------
    async def _relay_data(self, src_stream: Any, dst_stream: Any, peer_id: Any,
                          deadline: float | None = None,
                          circuit_data_limit: list[int] | None = None) -> None:
        """Copy ``src_stream`` to ``dst_stream`` within the circuit's byte budget and deadline.

        The library runs one call per direction, sharing ``circuit_data_limit`` (a one-element
        list: the bytes left); that list identifies the circuit. When either direction ends, the
        other is cancelled (a local reset does not wake a pending read in py-libp2p's yamux).
        """
        budget = circuit_data_limit if circuit_data_limit is not None else [1 << 62]
        pump = self._pumps.setdefault(id(budget), _Pump())
        pump.users += 1
        until = trio.current_time() + (deadline - time.monotonic()) if deadline else float("inf")
        try:
            with trio.CancelScope(deadline=until) as scope:
                pump.scopes.append(scope)
                if pump.done:
                    scope.cancel()
                while True:
                    data = await src_stream.read(PUMP_READ_BYTES)
                    if not data:
                        break
                    if len(data) > budget[0]:
                        self._trip(pump, "circuit_bytes")
                        break
                    budget[0] -= len(data)
                    with trio.fail_after(self.write_timeout):
                        await dst_stream.write(data)
                    self.counters.add("relay.bytes_relayed", len(data))
            if scope.cancelled_caught and not pump.done and trio.current_time() >= until:
                self._trip(pump, "circuit_duration")
        except Exception as exc:  # a reset or a stalled write ends the circuit
            log.debug("circuit for %s ended: %s", peer_id, exc)
        finally:
            pump.done = True
            for other in pump.scopes:
                other.cancel()
            pump.users -= 1
            if pump.users == 0:
                self._pumps.pop(id(budget), None)
            with trio.move_on_after(self.close_timeout) as cleanup:
                cleanup.shield = True
                for s in (src_stream, dst_stream):
                    try:
                        await s.reset()
                    except Exception:
                        pass

    def _trip(self, pump: _Pump, reason: str) -> None:
        if not pump.tripped:
            pump.tripped = True
            self.refuse_count(reason)

    def _forget_streams(self, stream: Any) -> None:
        """Drop the library's bookkeeping of this circuit only (never another circuit's)."""
        for key, (a, b) in list(self._active_relays.items()):
            if a is stream:
                del self._active_relays[key]

    async def _status(self, stream: Any, code: StatusCode) -> None:
        try:
            with trio.fail_after(self.write_timeout):
                await write_delimited_msg(stream, HopMessage(type=HopMessage.STATUS,
                                                             status=to_proto_status(code)))
        except Exception:
            pass
