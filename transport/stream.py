"""A framed libp2p stream seen from asyncio: whole messages in, whole messages out.

Each ``send`` or ``receive`` crosses the trio bridge once. Large tensors are encoded and
decoded in a worker thread so the asyncio loop never stalls on codec work; the payload is
written to libp2p in ``Limits.chunk_bytes`` pieces and read into one buffer allocated only after
the header's sizes have been checked against ``Limits``.

Any failure leaves the stream unusable: it is reset (both directions) and the error is raised
with its type saying who is at fault (see ``transport.errors``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Collection

import trio

from transport import frames
from transport.codecs import CodecSpec
from transport.errors import (
    CodecError,
    DeadlineExceeded,
    MalformedFrame,
    PeerProtocolError,
    PeerUnavailable,
    RemoteError,
    TransportClosed,
    TransportError,
    TruncatedMessage,
    UnknownKind,
)
from transport.frames import FrameHeader, Message, OutgoingFrame
from transport.sendorder import SMALL_BYTES, PieceSizer

if TYPE_CHECKING:
    from transport.host import Host

#: messages whose tensors total more than this are encoded/decoded in a worker thread
OFFLOAD_BYTES = 256 * 1024
#: after an error reply, how long the peer has to read it before the stream is reset
ERROR_REPLY_GRACE_S = 2.0
#: frames up to this size are written to libp2p in a single write, ahead of bulk messages
SMALL_FRAME_BYTES = SMALL_BYTES


class _CleanEnd(Exception):
    """The remote closed its side exactly at a frame boundary."""


class Stream:
    """One libp2p stream carrying frames. Use as ``async with``: reset on error, else closed."""

    def __init__(self, host: Host, net_stream: Any, peer_id: str, protocol: str) -> None:
        self._host = host
        self._ns = net_stream  # a libp2p object: only touched inside trio calls
        self.peer_id = peer_id
        self.protocol = protocol
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once closed or reset by this side; such a stream carries nothing more."""
        return self._closed

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.reset_soon()

    # ---- sending -----------------------------------------------------------------------
    async def send(self, message: Message, *, codec: CodecSpec | None = None,
                   timeout: float | None = None) -> None:
        """Encode and write one message. ``codec`` defaults to the host's."""
        frame = await encode_off_loop(message, codec or self._host.options.codec)
        await self.send_frame(frame, timeout=timeout)

    async def send_frame(self, frame: OutgoingFrame, *, timeout: float | None = None) -> None:
        await self._guarded(self._t_write, frame, timeout=timeout)
        self._host.counters.add("bytes_sent", frame.total_bytes)
        self._host.counters.add("messages_sent")

    async def write_raw(self, data: bytes, *, timeout: float | None = None) -> None:
        """Write bytes as they are, bypassing framing: for tests and diagnostic tools."""
        await self._guarded(self._t_write_raw, bytes(data), timeout=timeout)

    async def _t_write_raw(self, data: bytes) -> None:
        try:
            await self._host.throttle.t_before_write(len(data))
            await self._ns.write(data)
        except Exception as exc:
            raise _map_io_error(exc, self, "writing") from None

    async def send_error(self, code: str, text: str, *, timeout: float = 2.0) -> None:
        """Best effort: tell the peer why we give up on this stream."""
        if self._closed:
            return
        try:
            await self.send(frames.error_message(code, text), timeout=timeout)
        except TransportError:
            pass

    async def fail(self, exc: TransportError) -> None:
        """Give up on this stream because of ``exc``: count it if it is the peer's fault,
        tell the peer (typed error reply, best effort), then reset the stream."""
        if isinstance(exc, PeerProtocolError):
            self._host.count_protocol_error(exc)
        await self.send_error(exc.code, str(exc))
        self._abort_after_reply()

    def _abort_after_reply(self) -> None:
        """Half-close now, reset after a grace period: yamux drops unread data on reset, so
        resetting at once would destroy the error reply we just wrote."""
        if self._closed:
            return
        self._closed = True
        self._host.counters.add("streams_reset")
        try:
            self._host.bridge.run_sync_soon(self._host.spawn_trio, _t_close_then_reset, self._ns,
                                            ERROR_REPLY_GRACE_S)
        except TransportClosed:
            pass

    # ---- receiving ---------------------------------------------------------------------
    async def receive(self, *, timeout: float | None = None,
                      kinds: Collection[str] | None = None) -> Message | None:
        """The next message, or ``None`` if the peer closed the stream at a frame boundary.

        An error reply from the peer raises ``RemoteError``; a kind outside ``kinds`` raises
        ``UnknownKind`` (the peer's fault) after resetting the stream.
        """
        got = await self.receive_frame(timeout=timeout)
        if got is None:
            return None
        header, payload = got
        return await self._decode(header, payload, kinds=kinds)

    async def _decode(self, header: FrameHeader, payload: bytearray,
                      kinds: Collection[str] | None) -> Message:
        try:
            if header.kind == frames.ERROR_KIND:
                meta = header.meta
                raise RemoteError(str(meta.get("code", "unknown"))[:64],
                                  str(meta.get("message", ""))[:1000])
            if kinds is not None and header.kind not in kinds:
                raise UnknownKind(f"message kind {header.kind!r} is not spoken on "
                                  f"{self.protocol} (expected one of {sorted(kinds)})")
            try:
                return await decode_off_loop(header, payload, self._host.options.limits)
            except TransportError:
                raise
            except Exception as exc:  # a codec must raise typed errors; the bytes are theirs
                raise CodecError(f"{self.protocol} from {self.peer_id}: undecodable "
                                 f"payload: {exc!r}") from None
        except PeerProtocolError as exc:
            await self.fail(exc)
            raise

    async def receive_frame(self, *, timeout: float | None = None
                            ) -> tuple[FrameHeader, bytearray] | None:
        try:
            header, payload = await self._guarded(self._t_read_frame, timeout=timeout)
        except _CleanEnd:
            return None
        self._host.counters.add("bytes_received", header.frame_bytes)
        self._host.counters.add("messages_received")
        return header, payload

    async def exchange(self, message: Message, *, codec: CodecSpec | None = None,
                       timeout: float | None = None,
                       queued: Callable[[bool], None] | None = None) -> Message:
        """Send one message and receive the reply in a single bridge crossing. ``queued``
        (called in the trio thread) is told ``True`` when a large message starts waiting
        behind this host's other large messages to the peer, ``False`` when it goes out."""
        frame = await encode_off_loop(message, codec or self._host.options.codec)
        try:
            header, payload = await self._guarded(self._t_exchange, frame, queued,
                                                  timeout=timeout)
        except _CleanEnd:
            self.reset_soon()
            raise PeerUnavailable(f"{self.protocol} with {self.peer_id}: stream closed "
                                  f"without a reply") from None
        counters = self._host.counters
        counters.add("bytes_sent", frame.total_bytes)
        counters.add("messages_sent")
        counters.add("bytes_received", header.frame_bytes)
        counters.add("messages_received")
        return await self._decode(header, payload, kinds=None)

    async def _t_exchange(self, frame: OutgoingFrame,
                          queued: Callable[[bool], None] | None = None
                          ) -> tuple[FrameHeader, bytearray]:
        await self._t_write(frame, queued)
        return await self._t_read_frame()

    # ---- closing -----------------------------------------------------------------------
    async def close(self) -> None:
        """Close our side (the peer sees a clean end) and release the stream."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._host.bridge.call(_t_close, self._ns)
        except (TransportError, asyncio.CancelledError):
            raise
        except Exception:
            pass

    def reset_soon(self) -> None:
        """Abort the stream in both directions without waiting (safe from any context)."""
        if self._closed:
            return
        self._closed = True
        self._host.counters.add("streams_reset")
        try:
            self._host.bridge.run_sync_soon(self._host.spawn_trio, _t_reset, self._ns)
        except TransportClosed:
            pass

    async def reset(self) -> None:
        self.reset_soon()

    # ---- the bridge crossing, with deadline and error mapping ----------------------------
    async def _guarded(self, fn: Any, *args: Any, timeout: float | None) -> Any:
        if self._closed:
            raise TransportClosed(f"stream {self.protocol} to {self.peer_id} is closed")
        try:
            async with asyncio.timeout(timeout):
                return await self._host.bridge.call(fn, *args)
        except _CleanEnd:
            raise
        except TimeoutError:
            self.reset_soon()
            self._host.counters.add("deadlines_missed")
            raise DeadlineExceeded(f"{self.protocol} with {self.peer_id}: no progress within "
                                   f"{timeout:.3g} s") from None
        except asyncio.CancelledError:
            self.reset_soon()
            raise
        except PeerProtocolError as exc:
            await self.fail(exc)
            raise
        except TransportError:
            self.reset_soon()
            raise
        except Exception as exc:  # a libp2p exception the trio side did not convert
            self.reset_soon()
            raise PeerUnavailable(f"{self.protocol} with {self.peer_id}: {exc!r}") from None

    # ---- trio side ---------------------------------------------------------------------
    async def _t_write(self, frame: OutgoingFrame,
                       queued: Callable[[bool], None] | None = None) -> None:
        """Small frames at once; larger ones through the peer's bulk gate, one at a time, in
        pieces sized to the link (``transport.sendorder``); ``queued(True)`` when one starts
        waiting for the gate, ``queued(False)`` when it goes out."""
        ns, throttle = self._ns, self._host.throttle
        try:
            if frame.total_bytes <= SMALL_FRAME_BYTES:
                await throttle.t_before_write(frame.total_bytes)
                await ns.write(frame.head + b"".join(frame.parts))
                return
            gates = self._host.gates
            gate = gates.enter(self.peer_id)
            try:
                waiting = trio.current_time()
                behind = gate.lock.locked()  # only then does the caller hear of the wait
                if behind and queued is not None:
                    queued(True)
                async with gate.lock:
                    if behind:
                        waited = trio.current_time() - waiting
                        self._host.counters.add("send_order.queued_ms", round(waited * 1000))
                        if queued is not None:
                            queued(False)
                    await throttle.t_before_write(len(frame.head))
                    await ns.write(frame.head)
                    await self._t_write_pieces(frame, gate.sizer)
            finally:
                gates.leave(self.peer_id, gate)
        except Exception as exc:
            raise _map_io_error(exc, self, "writing") from None

    async def _t_write_pieces(self, frame: OutgoingFrame, sizer: PieceSizer) -> None:
        ns, throttle = self._ns, self._host.throttle
        for part in frame.parts:
            offset = 0
            while offset < len(part):
                piece = part[offset:offset + throttle.write_piece(sizer.size())]
                await throttle.t_before_write(len(piece))
                started = trio.current_time()
                await ns.write(piece)
                sizer.observe(len(piece), trio.current_time() - started)
                offset += len(piece)

    async def _t_read_frame(self) -> tuple[FrameHeader, bytearray]:
        limits = self._host.options.limits
        prefix = bytearray(frames.PREFIX_BYTES)
        await self._t_read_into(memoryview(prefix), at_boundary=True)
        header_len = frames.parse_prefix(bytes(prefix), limits)
        body = bytearray(header_len)
        await self._t_read_into(memoryview(body), at_boundary=False)
        header = frames.parse_header(bytes(body), limits)
        payload = bytearray(header.payload_bytes)  # sizes checked: safe to allocate
        await self._t_read_into(memoryview(payload), at_boundary=False)
        return header, payload

    async def _t_read_into(self, view: memoryview, *, at_boundary: bool) -> None:
        from libp2p.network.stream.exceptions import StreamEOF

        got, want = 0, len(view)
        while got < want:
            try:
                data = await self._ns.read(want - got)
            except StreamEOF:
                data = b""
            except Exception as exc:
                if got == 0 and at_boundary:
                    raise _map_io_error(exc, self, "reading") from None
                raise TruncatedMessage(f"{self.protocol} from {self.peer_id}: stream broke "
                                       f"inside a frame ({got}/{want} bytes): {exc!r}") from None
            if not data:
                if got == 0 and at_boundary:
                    raise _CleanEnd()
                raise TruncatedMessage(f"{self.protocol} from {self.peer_id}: stream ended "
                                       f"inside a frame ({got}/{want} bytes)")
            n = len(data)
            if n > want - got:
                raise MalformedFrame("libp2p returned more bytes than asked")  # defensive
            view[got:got + n] = data
            got += n
            await self._host.throttle.t_after_read(n)


async def _t_close(ns: Any) -> None:
    try:
        await ns.close()
    except Exception:
        pass


async def _t_close_then_reset(ns: Any, grace: float) -> None:
    await _t_close(ns)
    await trio.sleep(grace)
    await _t_reset(ns)


async def _t_reset(ns: Any) -> None:
    try:
        await ns.reset()
    except Exception:
        pass


def _map_io_error(exc: Exception, stream: Stream, doing: str) -> TransportError:
    from libp2p.network.stream.exceptions import StreamReset

    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, StreamReset):
        return PeerUnavailable(f"{stream.protocol} with {stream.peer_id}: stream reset by the "
                               f"peer while {doing}")
    return PeerUnavailable(f"{stream.protocol} with {stream.peer_id}: {doing} failed: {exc!r}")


async def encode_off_loop(message: Message, spec: CodecSpec) -> OutgoingFrame:
    """Encode a message; big tensors are encoded in a worker thread."""
    size = sum(_nbytes(t) for t in message.tensors)
    if size <= OFFLOAD_BYTES:
        return frames.encode_message(message, spec)
    return await asyncio.to_thread(frames.encode_message, message, spec)


async def decode_off_loop(header: FrameHeader, payload: bytearray, limits: Any) -> Message:
    view = memoryview(payload)
    if header.payload_bytes <= OFFLOAD_BYTES:
        return frames.decode_message(header, view, limits)
    return await asyncio.to_thread(frames.decode_message, header, view, limits)


def _nbytes(tensor: Any) -> int:
    try:
        return int(tensor.numel()) * int(tensor.element_size())
    except AttributeError:
        return 0
