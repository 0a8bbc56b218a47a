"""Gossipsub publish/subscribe, offered to asyncio.

Messages are signed by their origin (strict signing): ``PubsubMessage.origin`` is the peer
whose key signed the message, not merely the neighbour that forwarded it.

py-libp2p's gossipsub drops silently: messages over 1 MiB, more than
``max_messages_per_topic_per_second`` per forwarding peer per topic, and bursts over its
pending queue. ``publish`` refuses oversized data loudly here; callers that need every message
delivered must pull state over a stream as well (membership does).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

import trio

from transport.errors import LocalUsageError, TransportClosed

if TYPE_CHECKING:
    from transport.host import Host

log = logging.getLogger("transport.pubsub")

#: gossipsub drops larger messages silently; we refuse them before publishing
MAX_PUBSUB_BYTES = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class PubsubOptions:
    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    heartbeat_interval_s: int = 1
    max_messages_per_topic_per_second: float = 50.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PubsubMessage:
    topic: str
    data: bytes
    origin: str  # peer id of the signer


class Subscription:
    """Messages of one topic, as an async iterator. ``close()`` unsubscribes."""

    def __init__(self, bridge: PubsubBridge, topic: str, queue_size: int) -> None:
        self.topic = topic
        self.dropped = 0
        self._bridge = bridge
        self._queue: asyncio.Queue[PubsubMessage | None] = asyncio.Queue(queue_size)
        self._scope: trio.CancelScope | None = None
        self._closed = False

    def _deliver(self, message: PubsubMessage | None) -> None:  # asyncio side
        if self._queue.full():
            self._queue.get_nowait()  # keep the newest: stale gossip is worth less
            self.dropped += 1
            self._bridge.host.counters.add("pubsub_dropped")
        self._queue.put_nowait(message)

    def __aiter__(self) -> AsyncIterator[PubsubMessage]:
        return self

    async def __anext__(self) -> PubsubMessage:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        message = await self._queue.get()
        if message is None:
            self._closed = True
            raise StopAsyncIteration
        return message

    async def get(self, timeout: float | None = None) -> PubsubMessage:
        async with asyncio.timeout(timeout):
            return await self.__anext__()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._bridge.host.bridge.call(self._bridge.t_unsubscribe, self)
        except TransportClosed:
            pass


class PubsubBridge:
    def __init__(self, host: Host) -> None:
        self.host = host
        self._t_pubsub: Any = None

    async def t_start(self, libp2p_host: Any, nursery: trio.Nursery) -> None:
        from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
        from libp2p.pubsub.pubsub import Pubsub
        from libp2p.tools.anyio_service.context import background_trio_service

        opts = self.host.options.pubsub
        assert opts is not None
        router = GossipSub(
            protocols=[PROTOCOL_ID_V11], degree=opts.degree, degree_low=opts.degree_low,
            degree_high=opts.degree_high, heartbeat_interval=opts.heartbeat_interval_s,
            max_messages_per_topic_per_second=opts.max_messages_per_topic_per_second,
        )
        pubsub = Pubsub(libp2p_host, router, strict_signing=True)
        ready = trio.Event()

        async def run() -> None:
            async with background_trio_service(pubsub), background_trio_service(router):
                await pubsub.wait_until_ready()
                self._t_pubsub = pubsub
                ready.set()
                await trio.sleep_forever()

        nursery.start_soon(run)
        await ready.wait()

    async def publish(self, topic: str, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray)):
            raise LocalUsageError("pubsub data must be bytes")
        if len(data) > MAX_PUBSUB_BYTES:
            raise LocalUsageError(f"pubsub message of {len(data)} bytes: gossipsub would drop "
                                  f"it silently (limit {MAX_PUBSUB_BYTES}); send it on a stream")
        await self.host.bridge.call(self._t_publish, topic, bytes(data))
        self.host.counters.add("pubsub_published")

    async def _t_publish(self, topic: str, data: bytes) -> None:
        await self._t_pubsub.publish(topic, data)

    async def subscribe(self, topic: str, *, queue_size: int) -> Subscription:
        sub = Subscription(self, topic, queue_size)
        await self.host.bridge.call(self._t_subscribe, sub)
        return sub

    async def _t_subscribe(self, sub: Subscription) -> None:
        from libp2p.peer.id import ID

        libp2p_sub = await self._t_pubsub.subscribe(sub.topic)

        async def pump() -> None:
            with trio.CancelScope() as scope:
                sub._scope = scope
                try:
                    while True:
                        msg = await libp2p_sub.get()
                        try:
                            origin = ID(msg.from_id).to_base58()
                        except Exception:
                            self.host.counters.add("pubsub_malformed")
                            continue
                        self.host.bridge.to_asyncio(sub._deliver, PubsubMessage(
                            topic=sub.topic, data=bytes(msg.data), origin=origin))
                finally:
                    self.host.bridge.to_asyncio(sub._deliver, None)

        self.host.spawn_trio(pump)

    async def t_unsubscribe(self, sub: Subscription) -> None:
        if sub._scope is not None:
            sub._scope.cancel()
        try:
            await self._t_pubsub.unsubscribe(sub.topic)
        except Exception as exc:  # unsubscribing twice or after a failure is harmless
            log.debug("unsubscribe %s: %s", sub.topic, exc)
