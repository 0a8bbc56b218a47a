"""Request/response over pooled streams: the part of ``transport.host.Host`` that sends one
message and waits for its reply, and that answers requests with a handler.

A mixin of ``Host``, which owns what is used here: ``options`` (request and idle-stream
timeouts), ``counters``, ``_idle`` (the pool: (peer, protocol) -> idle streams), ``open_stream``
and ``set_handler``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from transport.codecs import CodecSpec
from transport.errors import DeadlineExceeded, PeerProtocolError, PeerUnavailable
from transport.frames import Message
from transport.stream import Stream

#: the longest a request's deadline stands still while its message waits for the peer's gate
MAX_QUEUED_S = 600.0


class RequestReply:
    #: idle request streams kept per (peer, protocol): more than a trainer keeps in flight
    #: (32) through one pair of stage peers. A request that finds none opens a stream, which
    #: costs a round trip of protocol negotiation before its message goes: with 8 kept, on a
    #: 100 ms path every microbatch beyond the 8th of a step's opening burst, and each hop
    #: beyond 8 at once, waited that round trip (``request_streams_opened`` counts them)
    IDLE_STREAMS_PER_KEY = 64

    options: Any
    counters: Any
    _idle: dict[tuple[str, str], list[Stream]]
    open_stream: Callable[..., Awaitable[Stream]]
    set_handler: Callable[..., None]

    async def request(self, peer_id: str, protocol: str, message: Message, *,
                      timeout: float | None = None, codec: CodecSpec | None = None
                      ) -> Message:
        """Send one message and return the peer's reply (served by ``set_request_handler``).

        ``timeout`` is the peer's time: while a large message waits behind this host's other
        large messages to the same peer (``transport.sendorder``) its deadline stands still
        (that wait is our own uplink's backlog, not the peer's slowness), for at most
        ``MAX_QUEUED_S``.

        Streams are pooled per (peer, protocol) and reused, so a request costs one round trip.
        If a pooled stream turns out dead before any reply arrived (the peer restarted), the
        request is sent once more on a fresh stream: handlers must tolerate a duplicate.
        """
        timeout = timeout or self.options.request_timeout_s
        key = (peer_id, protocol)
        if not timeout > 0:
            raise DeadlineExceeded(f"{protocol} with {peer_id}: no time left to send")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout) as scope:
                clock = _Paused(scope, loop)

                def queued(waiting: bool) -> None:  # trio thread: see Stream.exchange
                    try:
                        loop.call_soon_threadsafe(clock.pause if waiting else clock.resume)
                    except RuntimeError:  # the loop closed meanwhile: nobody waits
                        pass

                pooled = self._idle.get(key)
                if pooled:
                    try:
                        return await self._exchange(key, pooled.pop(), message, codec, queued)
                    except PeerUnavailable:
                        self.counters.add("pooled_stream_stale")
                stream = await self.open_stream(peer_id, protocol, timeout=timeout)
                self.counters.add("request_streams_opened")
                return await self._exchange(key, stream, message, codec, queued)
        except TimeoutError:
            self.counters.add("deadlines_missed")
            raise DeadlineExceeded(f"{protocol} with {peer_id}: no reply within "
                                   f"{timeout:.3g} s") from None

    async def _exchange(self, key: tuple[str, str], stream: Stream, message: Message,
                        codec: CodecSpec | None,
                        queued: Callable[[bool], None] | None = None) -> Message:
        """One exchange on ``stream``; pooled again after a reply, reset after anything else
        (an error reply, a deadline, a dead stream): py-libp2p counts a stream against the
        connection's 256 until both sides let go, and the serving side closed its half after
        an error, so a kept one would use a slot for good."""
        try:
            reply = await stream.exchange(message, codec=codec, queued=queued)
        except BaseException:
            stream.reset_soon()
            raise
        self._return_to_pool(key, stream)
        return reply

    def _return_to_pool(self, key: tuple[str, str], stream: Stream) -> None:
        idle = self._idle.setdefault(key, [])
        if stream.closed or len(idle) >= self.IDLE_STREAMS_PER_KEY:
            stream.reset_soon() if not stream.closed else None
            return
        idle.append(stream)

    def set_request_handler(self, protocol: str,
                            serve: Callable[[Message, str], Awaitable[Message]], *,
                            codec: CodecSpec | None = None) -> None:
        """Answer requests on ``protocol``: ``serve(message, peer_id)`` returns the reply.

        A typed error raised by ``serve`` (``TransportError`` or any exception with a string
        ``code``) goes back to the requester as an error reply, which raises ``RemoteError``
        there; then the stream is closed. Anything else is also counted and logged as our bug.
        Replies are encoded with ``codec`` (default: the host's).
        """

        async def handler(stream: Stream) -> None:
            idle = self.options.idle_stream_timeout_s
            while True:
                try:
                    message = await stream.receive(timeout=idle)
                except DeadlineExceeded:  # an idle (or silent) stream: free its tasks
                    self.counters.add("idle_streams_closed")
                    return
                if message is None:
                    return
                try:
                    reply = await serve(message, stream.peer_id)
                except (PeerProtocolError, PeerUnavailable, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    code = getattr(exc, "code", None)
                    if not isinstance(code, str):
                        raise
                    self.counters.add(f"request_errors.{code}")
                    await stream.send_error(code, str(exc))
                    return
                await stream.send(reply, codec=codec)

        self.set_handler(protocol, handler)


class _Paused:
    """Stops a request's deadline while its message waits behind ours (loop thread only)."""

    def __init__(self, scope: asyncio.Timeout, loop: asyncio.AbstractEventLoop) -> None:
        self.scope, self.loop = scope, loop
        self.left: float | None = None

    def pause(self) -> None:
        when = self.scope.when()
        if when is None or self.scope.expired() or self.left is not None:
            return
        self.left = max(0.0, when - self.loop.time())
        self.scope.reschedule(self.loop.time() + self.left + MAX_QUEUED_S)

    def resume(self) -> None:
        if self.left is None or self.scope.expired():
            return
        self.scope.reschedule(self.loop.time() + self.left)
        self.left = None
