"""What a :class:`transport.host.Host` is started with: listen addresses, limits, timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from transport.codecs import CodecSpec
from transport.errors import LocalUsageError
from transport.limits import Limits
from transport.pubsub import PubsubOptions
from transport.liveness import Liveness
from transport.liveness_policy import PingPolicy
from transport.relay.policy import RelayLimits
from transport.sendorder import SendOrder

__all__ = ["HostOptions", "RelayOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayOptions:
    """Circuit relay v2 and hole punching (``transport.relay``). Given at all, the host accepts
    connections relayed to it and can reserve slots on relays and dial through them."""

    #: serve as a relay for other peers (a publicly reachable host), within ``limits``
    serve: bool = False
    limits: RelayLimits = field(default_factory=RelayLimits)
    #: try DCUtR to turn relayed connections into direct ones
    hole_punch: bool = True
    #: once a connection went direct, the relayed one is closed after this long
    relayed_close_grace_s: float = 10.0
    #: a reservation is renewed after this fraction of its remaining time
    renew_fraction: float = 0.5
    #: deadline of one reservation request (and of DCUtR's reads and dials)
    reserve_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 < self.renew_fraction < 1.0:
            raise LocalUsageError("RelayOptions.renew_fraction must be between 0 and 1")
        if not self.reserve_timeout_s > 0:
            raise LocalUsageError("RelayOptions.reserve_timeout_s must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostOptions:
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    #: inbound connections (handshaking ones included) before new ones are refused
    max_connections: int = 1024
    #: an inbound connection that has not finished Noise+yamux by then is dropped
    handshake_timeout_s: float = 5.0
    dial_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    #: a request stream with no new request for this long is closed by the serving side
    idle_stream_timeout_s: float = 120.0
    limits: Limits = field(default_factory=Limits)
    #: codec used for tensors when a send does not name one
    codec: CodecSpec = field(default_factory=lambda: CodecSpec(name="none"))
    #: None: no pubsub router is started
    pubsub: PubsubOptions | None = field(default_factory=PubsubOptions)
    #: yamux frame size for what this process sends (None: py-libp2p's 64 KiB); see
    #: transport.libp2p_tuning. Larger frames halve the per-byte cost of bulk transfers.
    yamux_frame_bytes: int | None = 1 << 20
    #: send yamux window updates in batches rather than after every read
    batch_window_updates: bool = True
    #: None: no relay protocols at all (neither relayed connections nor hole punching)
    relay: RelayOptions | None = None
    #: bytes per second this host writes on its framed streams, all streams together (one
    #: token bucket, ``transport.ratelimit``); None: unlimited
    upload_bytes_s: int | None = None
    #: bytes per second it reads from them; reading slower makes yamux flow control slow the
    #: senders down; None: unlimited
    download_bytes_s: int | None = None
    #: burst of both buckets (None: a quarter second of the rate, at least 16 KiB)
    rate_burst_bytes: int | None = None
    #: keepalive and the TCP user timeout on every TCP connection (``transport.liveness``):
    #: a connection through a router that restarted dies in seconds, not minutes; None: the
    #: kernel's defaults
    liveness: Liveness | None = field(default_factory=Liveness)
    #: application-level liveness (``transport.liveness_watch``): a connection on which
    #: nothing was heard for ``dead_after_s`` while its pings went unanswered is closed, so a
    #: connection through a restarted router is re-dialed; None: off
    pings: PingPolicy | None = field(default_factory=PingPolicy)
    #: small messages ahead of bulk ones, bulk ones to a peer one at a time in pieces sized to
    #: the link, little left unsent in the kernel (``transport.sendorder``)
    send_order: SendOrder = field(default_factory=SendOrder)

    def __post_init__(self) -> None:
        if not self.listen:
            raise LocalUsageError("HostOptions.listen needs at least one multiaddr")
        for name in ("max_connections",):
            if getattr(self, name) < 1:
                raise LocalUsageError(f"HostOptions.{name} must be at least 1")
        for name in ("handshake_timeout_s", "dial_timeout_s", "request_timeout_s",
                     "idle_stream_timeout_s"):
            if not getattr(self, name) > 0:
                raise LocalUsageError(f"HostOptions.{name} must be positive")
        for name in ("upload_bytes_s", "download_bytes_s", "rate_burst_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise LocalUsageError(f"HostOptions.{name} must be a positive integer or None "
                                      f"(unlimited), got {value!r}")
