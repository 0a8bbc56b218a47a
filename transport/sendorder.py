"""The order in which one peer's messages leave this host: small ones first, large ones one at a
time, in pieces sized to the link.

Measured on the WAN lab's ``uplink`` profile (6 Mbit/s, ``python -m tools.wanlab.streams
contend``): four streams each sending 1 MiB tensors to one peer, with py-libp2p's defaults,
made a 100-byte request to that peer wait 4-5.5 s, and every tensor took 4x its own transfer
time, because

* the kernel's send buffer (autotuned to 4 MB) holds seconds of a slow link's bytes, and
  whatever is written after them waits that long, however small;
* yamux interleaves the streams' frames fairly, so four tensors all finish at 4x one's time
  (a pipeline wants the first one at 1x so the next stage can start on it).

So, for each connection (one per peer):

* ``TCP_NOTSENT_LOWAT`` (``SendOrder.unsent_bytes``) keeps at most that much not yet sent in
  the kernel: a writer waits in the host, where the order below applies, not in the kernel;
* frames of at most ``SMALL_BYTES`` (requests, replies, error frames, membership) are written
  as they come: they queue behind at most the one bulk piece being written;
* larger messages take the peer's ``BulkGate`` (a FIFO lock) for their whole payload: one at a
  time, in the order they were sent;
* the payload is written in pieces of ``PieceSizer.size()``: about ``target_s`` of the rate
  the peer's last pieces went out at, between ``min_bytes`` and the host's chunk size, so a
  small message waits about that long on a slow link and fast links keep large writes.

``PieceSizer`` is pure (times passed in); ``BulkGate`` and ``Gates`` are the trio side's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import trio

__all__ = ["SMALL_BYTES", "SendOrder", "PieceSizer", "BulkGate", "Gates"]

#: frames up to this size are written at once, ahead of any waiting bulk message
SMALL_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class SendOrder:
    """``HostOptions.send_order``: how a connection's writes are ordered (see the module)."""

    #: TCP_NOTSENT_LOWAT on every TCP connection: bytes the kernel may hold not yet sent
    unsent_bytes: int = 128 * 1024
    #: a bulk piece should take about this long at the peer's measured rate
    target_s: float = 0.05
    #: never smaller pieces than this (per-write overhead)
    min_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        from transport.errors import LocalUsageError

        if not (4096 <= self.unsent_bytes <= 1 << 30 and 4096 <= self.min_bytes <= 1 << 30
                and 0.001 <= self.target_s <= 10):
            raise LocalUsageError("SendOrder needs unsent_bytes and min_bytes within 4 KiB..1 GiB "
                                  "and target_s within 0.001..10 s")


@dataclass(slots=True)
class PieceSizer:
    """Bulk piece size from the rate recent pieces were written at (pure: times passed in).

    A piece that took less than ``FAST_S`` says only that the link is fast (the kernel took it
    at once): the size doubles toward ``max_bytes``. Slower ones give a rate, smoothed, and the
    size is ``target_s`` of it."""

    min_bytes: int
    max_bytes: int
    target_s: float
    #: bytes per second, smoothed; None until a slow piece was measured
    rate: float | None = None
    _size: int = field(default=0)

    FAST_S = 0.002
    SMOOTHING = 0.3

    def __post_init__(self) -> None:
        self.max_bytes = max(self.max_bytes, self.min_bytes)
        self._size = self.max_bytes

    def size(self) -> int:
        return self._size

    def observe(self, nbytes: int, seconds: float) -> None:
        """One piece of ``nbytes`` took ``seconds`` to write."""
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        if seconds < self.FAST_S:
            self._size = min(self.max_bytes, self._size * 2)
            return
        sample = nbytes / seconds
        self.rate = sample if self.rate is None else (
            self.SMOOTHING * sample + (1 - self.SMOOTHING) * self.rate)
        self._size = int(min(self.max_bytes, max(self.min_bytes, self.rate * self.target_s)))


class BulkGate:
    """One peer's bulk writes, one at a time in arrival order (trio side only)."""

    def __init__(self, order: SendOrder, max_bytes: int) -> None:
        self.lock = trio.Lock()  # trio's locks are fair: FIFO
        self.sizer = PieceSizer(min_bytes=order.min_bytes, max_bytes=max_bytes,
                                target_s=order.target_s)
        self.users = 0


class Gates:
    """The ``BulkGate`` of each peer with a bulk write in progress or waiting (trio side)."""

    def __init__(self, order: SendOrder, max_bytes: int) -> None:
        self.order = order
        self.max_bytes = max_bytes
        self._gates: dict[str, BulkGate] = {}
        #: last measured rates, kept after a gate is dropped so the next starts there
        self._rates: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._gates)

    def enter(self, peer_id: str) -> BulkGate:
        gate = self._gates.get(peer_id)
        if gate is None:
            gate = self._gates[peer_id] = BulkGate(self.order, self.max_bytes)
            rate = self._rates.get(peer_id)
            if rate is not None:
                gate.sizer.observe(int(rate), 1.0)
        gate.users += 1
        return gate

    def leave(self, peer_id: str, gate: BulkGate) -> None:
        gate.users -= 1
        if gate.users <= 0 and self._gates.get(peer_id) is gate:
            del self._gates[peer_id]
            if gate.sizer.rate is not None:
                self._rates[peer_id] = gate.sizer.rate
                if len(self._rates) > 4096:  # bounded: forget the oldest
                    self._rates.pop(next(iter(self._rates)))


def set_unsent_lowat(sock: Any, nbytes: int) -> bool:
    """TCP_NOTSENT_LOWAT on ``sock`` (Linux 3.12+, macOS); False where it is unavailable."""
    import socket

    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if option is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, nbytes)
    except OSError:
        return False
    return True
