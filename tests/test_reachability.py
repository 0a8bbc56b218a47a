"""Reachability from dial-backs: the pure verdict and messages, then real libp2p hosts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st

from swarmd.errors import BadPeerMessage
from swarmd.node.dialback import DialbackService, tcp_target
from swarmd.node.reachability import (PRIVATE, PUBLIC, UNKNOWN, DialbackReply, DialResult,
                                      Reachability)
from transport import identity
from transport.errors import RemoteError
from transport.frames import Message
from transport.host import Host, HostOptions

PROTO = "/swarmd/test/1/dialback"
OK = DialbackReply(results=(DialResult(addr="/ip4/1.2.3.4/tcp/1", ok=True),))
NO = DialbackReply(results=(DialResult(addr="/ip4/1.2.3.4/tcp/1", ok=False, reason="refused"),))


def test_two_peers_that_reached_us_make_us_public_and_two_that_did_not_private() -> None:
    r = Reachability(min_agree=2, window_s=100)
    r.answered("a", OK, 0)
    assert r.verdict(0) == UNKNOWN
    r.answered("b", OK, 1)
    assert r.verdict(1) == PUBLIC
    r.reset()
    r.answered("a", NO, 2)
    r.answered("b", NO, 2)
    assert r.verdict(2) == PRIVATE
    r.answered("c", OK, 3)  # one reached us: not private, not yet public
    assert r.verdict(3) == UNKNOWN
    assert r.verdict(500) == UNKNOWN  # everything expired


@given(st.lists(st.booleans(), min_size=1, max_size=50))
def test_one_peer_never_decides_alone(answers: list[bool]) -> None:
    r = Reachability(min_agree=2)
    for i, ok in enumerate(answers):
        r.answered("same-peer", OK if ok else NO, float(i))
    assert r.verdict(float(len(answers))) == UNKNOWN


@pytest.mark.parametrize("meta", [None, {}, {"results": "x"}, {"results": [1]},
                                  {"results": [{"addr": "", "ok": True}]},
                                  {"results": [{"addr": "a", "ok": "yes"}]},
                                  {"results": [{"addr": "a", "ok": True}] * 9}])
def test_malformed_replies_are_the_peers_fault(meta: Any) -> None:
    with pytest.raises(BadPeerMessage):
        DialbackReply.from_meta(meta)


def test_replies_drop_unknown_keys_and_round_trip() -> None:
    meta = {"results": [{"addr": "/ip4/1.2.3.4/tcp/5", "ok": False, "reason": "refused",
                         "extra": 1}], "junk": True}
    reply = DialbackReply.from_meta(meta)
    assert DialbackReply.from_meta(reply.to_meta()) == reply


@pytest.mark.parametrize("addr, target", [
    ("/ip4/1.2.3.4/tcp/5/p2p/x", ("1.2.3.4", 5)), ("/ip6/::1/tcp/7", ("::1", 7)),
    ("/ip4/1.2.3.4/udp/5/quic", None), ("/dns4/a.b/tcp/5", None), ("/ip4/1.2.3.4/tcp/0", None),
    ("/ip4/1.2.3.4/tcp/5/p2p/x/p2p-circuit/p2p/y", None)])
def test_only_tcp_addresses_are_dialed(addr: str, target: Any) -> None:
    assert tcp_target(addr) == target


# ---- real hosts ------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def hosts(n: int) -> AsyncIterator[list[Host]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(Host(identity.generate(), HostOptions(pubsub=None)))
               for _ in range(n)]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(coro: Any) -> Any:
    return uvloop.run(asyncio.wait_for(coro, 60))


def test_peers_that_can_dial_us_back_make_us_public_and_a_closed_port_private() -> None:
    async def main() -> tuple[str, str, dict[str, int]]:
        async with hosts(3) as (me, a, b):
            verdicts = []
            for announced in (me.addrs, [f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{me.peer_id}"]):
                servers = [DialbackService(h, PROTO, addrs_of=lambda _p, x=announced: x,
                                           own_addrs=lambda: (), candidates=lambda: ())
                           for h in (a, b)]
                async with contextlib.AsyncExitStack() as stack:
                    for s in servers:
                        await stack.enter_async_context(s)
                    for h in (a, b):
                        await me.dial(h.addrs[0])
                    asker = DialbackService(me, PROTO, addrs_of=lambda _p: (),
                                            own_addrs=lambda x=announced: x,
                                            candidates=lambda: [a.peer_id, b.peer_id])
                    async with asker:
                        while asker.verdict() == UNKNOWN:  # bounded by run()'s 60 s
                            await asyncio.sleep(0.05)
                        verdicts.append(asker.verdict())
            return verdicts[0], verdicts[1], servers[0].counters

    public, private, counters = run(main())
    assert (public, private) == (PUBLIC, PRIVATE)
    assert counters.get("dialback.served") == 1


def test_a_server_refuses_strangers_and_repeat_askers_and_keeps_serving() -> None:
    async def main() -> list[str]:
        async with hosts(2) as (server_host, client):
            known = {client.peer_id: client.addrs}
            server = DialbackService(server_host, PROTO, addrs_of=lambda p: known.get(p, ()),
                                     own_addrs=lambda: (), candidates=lambda: ())
            async with server:
                await client.dial(server_host.addrs[0])
                codes = []
                for meta_kind in ("dialback", "dialback", "garbage"):
                    try:
                        reply = await client.request(server_host.peer_id, PROTO,
                                                     Message(kind=meta_kind, meta={"x": 1}))
                        codes.append("ok" if DialbackReply.from_meta(dict(reply.meta)).results[0].ok
                                     else "not-ok")
                    except RemoteError as exc:
                        codes.append(exc.code)
                known.clear()  # a peer without a signed announcement is never dialed
                server._served.clear()
                try:
                    await client.request(server_host.peer_id, PROTO, Message(kind="dialback"))
                except RemoteError as exc:
                    codes.append(exc.code)
                return codes

    assert run(main()) == ["ok", "busy", "bad_peer_message", "bad_peer_message"]
