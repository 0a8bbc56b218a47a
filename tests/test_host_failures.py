"""Every libp2p failure reaches the caller of ``Host`` as a ``transport.errors`` type: a dial to
a port nobody listens on, an address of another peer, garbage addresses, a stream or request to
a peer that cannot be reached (real py-libp2p, one host in this process)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from transport import identity
from transport.errors import PeerUnavailable, TransportError
from transport.frames import Message
from transport.host import MAX_DIAL_ADDRS, Host, HostOptions

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there now
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_peers_raise_transport_errors_only() -> None:
    other = identity.generate().peer_id
    dead = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{other}"

    async def scenario() -> None:
        async with Host(identity.generate(), HostOptions(pubsub=None)) as host:
            assert await host.ensure_connected(other, [dead], timeout=2.0) is False
            with pytest.raises(PeerUnavailable, match="cannot reach"):
                await host.connect(other, [dead], timeout=2.0)
            # garbage, someone else's address, non-strings: skipped or refused, never raised raw
            junk = ["not a multiaddr", f"/ip4/127.0.0.1/tcp/1/p2p/{identity.generate().peer_id}",
                    5, f"/dns4/x/p2p/{other}", f"/ip4/127.0.0.1/tcp/99999/p2p/{other}"]
            assert await host.ensure_connected(other, junk, timeout=1.0) is False  # type: ignore
            for call in (host.open_stream(other, "/test/x/1", timeout=2.0),
                         host.request(other, "/test/x/1", Message(kind="x"), timeout=2.0),
                         host.ping(other, timeout=2.0)):
                with pytest.raises(TransportError):
                    await call
            await host.disconnect(other)  # not connected: nothing to do, nothing raised
            before = host.counters.snapshot().get("dial_failures", 0)
            many = [dead] * (10 * MAX_DIAL_ADDRS)
            assert await host.ensure_connected(other, many, timeout=1.0) is False
            tried = host.counters.snapshot().get("dial_failures", 0) - before
            assert 1 <= tried <= MAX_DIAL_ADDRS

    uvloop.run(asyncio.wait_for(scenario(), 60))
