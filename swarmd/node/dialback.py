"""Dial-backs over libp2p: ask peers whether they can reach us, and answer them.

``async with DialbackService(host, protocol, ...) as dialback:`` serves ``protocol`` and runs
one task that asks up to ``ASK_PEERS`` peers (at random) to dial us back, again when our
announced addresses change and every ``recheck_s``; :attr:`reachability` holds the verdict
(``swarmd.node.reachability``).

Serving is bounded: a peer is dialed back only at the addresses of its own signed
announcement (never at addresses a message names), at most once per ``serve_gap_s`` per peer,
with at most ``MAX_CONCURRENT`` dial-backs at once (the excess is refused ``busy``), each a
plain TCP connect with a deadline that sends nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from swarmd.errors import BadPeerMessage, StageBusy
from swarmd.node.reachability import MAX_RESULTS, DialbackReply, DialResult, Reachability
from transport.errors import TransportError
from transport.frames import Message

log = logging.getLogger("swarmd.dialback")

__all__ = ["DialbackService", "tcp_target"]

ASK_PEERS = 3
MAX_CONCURRENT = 4
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 3 * CONNECT_TIMEOUT_S + 5.0


def tcp_target(addr: str) -> tuple[str, int] | None:
    """(ip, port) of an ``/ip4|ip6/X/tcp/P[/p2p/..]`` address; None for anything else (relayed,
    DNS, QUIC)."""
    parts = addr.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" \
            or "p2p-circuit" in parts:
        return None
    try:
        port = int(parts[3])
    except ValueError:
        return None
    return (parts[1], port) if 0 < port < 65536 else None


async def _connect(addr: str, timeout: float) -> DialResult:
    target = tcp_target(addr)
    if target is None:
        return DialResult(addr=addr, ok=False, reason="not a TCP address")
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(*target)
    except TimeoutError:
        return DialResult(addr=addr, ok=False, reason="timed out")
    except ConnectionRefusedError:
        return DialResult(addr=addr, ok=False, reason="refused")
    except OSError as exc:
        return DialResult(addr=addr, ok=False, reason=exc.strerror or type(exc).__name__)
    writer.close()
    return DialResult(addr=addr, ok=True)


class DialbackService:
    def __init__(self, host: Any, protocol: str, *,
                 addrs_of: Callable[[str], Sequence[str]],
                 own_addrs: Callable[[], Sequence[str]],
                 candidates: Callable[[], Sequence[str]],
                 rng: random.Random | None = None, reachability: Reachability | None = None,
                 recheck_s: float = 600.0,
                 retry_s: float = 5.0, serve_gap_s: float = 30.0,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.host = host
        self.protocol = protocol
        self.addrs_of = addrs_of
        self.own_addrs = own_addrs
        self.candidates = candidates
        self.reachability = reachability if reachability is not None else Reachability()
        self.counters: dict[str, int] = {}
        self.checked_at: float | None = None
        self._rng = rng or random.Random()
        self._recheck_s, self._retry_s = recheck_s, retry_s
        self._serve_gap_s, self._connect_timeout_s = serve_gap_s, connect_timeout_s
        self._served: OrderedDict[str, float] = OrderedDict()
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def __aenter__(self) -> DialbackService:
        self.host.set_request_handler(self.protocol, self._serve)
        self._task = asyncio.create_task(self._run(), name="dialback")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.host.remove_handler(self.protocol)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def verdict(self) -> str:
        return self.reachability.verdict(time.monotonic())

    def recheck(self) -> None:
        """Ask again soon (e.g. after our connections dropped)."""
        self._wake.set()

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    # ---- serving -------------------------------------------------------------------------
    async def _serve(self, message: Message, peer: str) -> Message:
        if message.kind != "dialback":
            self._count("dialback.refused.malformed")
            raise BadPeerMessage("malformed", "a dial-back request has kind 'dialback'")
        now = time.monotonic()
        last = self._served.get(peer)
        if last is not None and now - last < self._serve_gap_s:
            self._count("dialback.refused.too_often")
            raise StageBusy(f"one dial-back per {self._serve_gap_s:.0f} s per peer")
        addrs = [a for a in self.addrs_of(peer)][:MAX_RESULTS]
        if not addrs:
            self._count("dialback.refused.no_announcement")
            raise BadPeerMessage("unknown_peer", "no signed announcement of yours lists an "
                                                 "address to dial back")
        if self._slots.locked():
            self._count("dialback.refused.busy")
            raise StageBusy("too many dial-backs at once here: ask another peer")
        self._served.pop(peer, None)
        self._served[peer] = now
        while len(self._served) > 1024:
            self._served.popitem(last=False)
        async with self._slots:
            results = await asyncio.gather(*(_connect(a, self._connect_timeout_s)
                                             for a in addrs))
        self._count("dialback.served")
        return Message(kind="dialback", meta=DialbackReply(results=tuple(results)).to_meta())

    # ---- asking --------------------------------------------------------------------------
    async def _run(self) -> None:
        announced: tuple[str, ...] = ()
        while True:
            own = tuple(self.own_addrs())
            if own != announced:
                announced = own
                self.reachability.reset()
            peers = [p for p in self.candidates() if p != self.host.peer_id]
            self._rng.shuffle(peers)
            if peers:
                await asyncio.gather(*(self._ask(p) for p in peers[:ASK_PEERS]))
                self.checked_at = time.monotonic()
            settled = self.verdict() != "unknown"
            try:
                async with asyncio.timeout(self._recheck_s if settled else self._retry_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def _ask(self, peer: str) -> None:
        try:
            reply = await self.host.request(peer, self.protocol,
                                            Message(kind="dialback", meta={}),
                                            timeout=REQUEST_TIMEOUT_S)
            answer = DialbackReply.from_meta(dict(reply.meta))
        except (TransportError, BadPeerMessage, TimeoutError) as exc:
            self._count("dialback.ask_failed")
            log.debug("dial-back from %s failed: %s", peer, exc)
            return
        self._count("dialback.answers")
        self.reachability.answered(peer, answer, time.monotonic())
