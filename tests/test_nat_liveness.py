"""transport.liveness: every TCP connection a host makes or accepts carries keepalive and a TCP
user timeout, so a connection through a router that restarted dies in seconds (issue 12,
"Recovery"). Real hosts on loopback; the lab test is tests/test_nat_recovery.py."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from transport.errors import LocalUsageError
from transport.host import Host
from transport.identity import generate
from transport.liveness import Liveness, find_socket
from transport.options import HostOptions


def _options_of(host: Host) -> list[tuple[int, int, int]]:
    """(user timeout ms, keepalive, keepidle) of each of the host's TCP connections."""
    out = []
    for conns in host._t_host.get_network().connections.values():
        for conn in conns if isinstance(conns, list) else [conns]:
            sock = find_socket(conn)
            assert sock is not None, conn
            out.append((sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)))
    return out


async def _options(host: Host) -> Any:
    async def read() -> Any:
        return _options_of(host)

    return await host.bridge.call(read)


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="needs Linux's "
                    "TCP_USER_TIMEOUT")
def test_both_ends_of_a_connection_get_keepalive_and_the_user_timeout() -> None:
    async def main() -> None:
        live = Liveness(dead_after_s=7.5, keepalive_idle_s=3)
        async with Host(generate(), HostOptions(liveness=live)) as a, \
                Host(generate(), HostOptions(liveness=live)) as b, \
                Host(generate(), HostOptions(liveness=None)) as c:
            await a.dial(b.addrs[0])
            await c.dial(b.addrs[0])
            for _ in range(100):  # the notifee runs right after the connection is added
                if b.counters.get("liveness.tuned") >= 2:
                    break
                await asyncio.sleep(0.02)
            assert a.counters.get("liveness.tuned") == 1
            assert b.counters.get("liveness.tuned") == 2  # inbound ones too, c's included
            assert c.counters.get("liveness.tuned") == 0
            assert await _options(a) == [(7500, 1, 3)]
            assert sorted(await _options(b)) == [(7500, 1, 3), (7500, 1, 3)]
            assert (await _options(c))[0][0] == 0  # the kernel's default: none

    asyncio.run(main())


def test_find_socket_finds_none_where_there_is_no_tcp_connection() -> None:
    class Nothing:
        pass

    assert find_socket(Nothing()) is None
    assert find_socket(None) is None


@pytest.mark.parametrize("bad", [dict(dead_after_s=-1), dict(keepalive_idle_s=0),
                                 dict(keepalive_interval_s=0.5), dict(keepalive_probes=0)])
def test_liveness_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(LocalUsageError):
        Liveness(**bad)
