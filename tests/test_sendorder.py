"""transport.sendorder: small messages ahead of bulk ones, a peer's bulk messages one at a time
in pieces sized to the link (issue 26: control traffic waited seconds behind tensors on a slow
uplink). The piece-size policy is pure (unit and property tests); the gates are checked with
trio directly and through real hosts on loopback. The effect on a slow link is measured in the
lab: ``python -m tools.wanlab.streams contend`` (docs/compression.md)."""

from __future__ import annotations

import asyncio
import math
import socket
from typing import Any

import pytest
import torch
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from transport.errors import LocalUsageError
from transport.frames import Message
from transport.host import Host
from transport.identity import generate
from transport.liveness import find_socket
from transport.options import HostOptions
from transport.sendorder import Gates, PieceSizer, SendOrder

KiB, MiB = 1 << 10, 1 << 20


def _sizer(**kw: Any) -> PieceSizer:
    return PieceSizer(**{"min_bytes": 64 * KiB, "max_bytes": MiB, "target_s": 0.05, **kw})


def test_pieces_start_large_and_shrink_to_a_slow_links_rate() -> None:
    s = _sizer()
    assert s.size() == MiB  # nothing measured: a fast link is assumed
    for _ in range(30):
        s.observe(s.size(), s.size() / 2e6)  # 2 MB/s
    assert s.rate == pytest.approx(2e6)
    assert s.size() == 100_000  # 50 ms of 2 MB/s
    for _ in range(30):
        s.observe(s.size(), s.size() / 100e3)  # 100 kB/s: below the floor
    assert s.size() == 64 * KiB


def test_pieces_the_kernel_takes_at_once_grow_back_to_the_largest() -> None:
    s = _sizer()
    for _ in range(20):
        s.observe(s.size(), s.size() / 1e6)
    assert s.size() == 64 * KiB
    sizes = []
    for _ in range(6):
        s.observe(s.size(), 0.0)
        sizes.append(s.size())
    assert sizes == [128 * KiB, 256 * KiB, 512 * KiB, MiB, MiB, MiB]


@given(st.lists(st.tuples(st.integers(-10, 1 << 30),
                          st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                    st.floats(0, 100))), max_size=50))
def test_the_piece_size_stays_within_its_bounds_whatever_is_observed(
        observations: list[tuple[int, float]]) -> None:
    s = _sizer()
    for nbytes, seconds in observations:
        s.observe(nbytes, seconds)
        assert 64 * KiB <= s.size() <= MiB
        assert s.rate is None or (math.isfinite(s.rate) and s.rate > 0)


@pytest.mark.parametrize("bad", [{"unsent_bytes": 0}, {"min_bytes": 1}, {"target_s": 0.0},
                                 {"target_s": float("nan")}, {"unsent_bytes": 1 << 40}])
def test_send_order_refuses_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(LocalUsageError, match="SendOrder"):
        SendOrder(**bad)


def test_a_peers_bulk_writes_go_one_at_a_time_in_arrival_order_others_peers_do_not_wait() -> None:
    gates = Gates(SendOrder(), MiB)
    order: list[str] = []

    async def write(peer: str, name: str, release: trio.Event) -> None:
        gate = gates.enter(peer)
        try:
            async with gate.lock:
                order.append(f"{name} starts")
                await release.wait()
                order.append(f"{name} ends")
        finally:
            gates.leave(peer, gate)

    async def main() -> None:
        releases = {n: trio.Event() for n in ("a1", "a2", "a3", "b1")}
        async with trio.open_nursery() as nursery:
            for name in ("a1", "a2", "a3", "b1"):
                nursery.start_soon(write, name[0], name, releases[name])
                await trio.testing.wait_all_tasks_blocked()
            assert order == ["a1 starts", "b1 starts"]  # b is another peer: not behind a
            assert len(gates) == 2
            for name in ("a3", "a2", "b1", "a1"):  # a3 and a2 may not overtake a1
                releases[name].set()
                await trio.testing.wait_all_tasks_blocked()
        assert order == ["a1 starts", "b1 starts", "b1 ends", "a1 ends", "a2 starts", "a2 ends",
                         "a3 starts", "a3 ends"]
        assert len(gates) == 0  # no gate kept for a peer with nothing to send

    trio.run(main)


def test_a_dropped_gate_remembers_its_peers_rate() -> None:
    gates = Gates(SendOrder(), MiB)
    gate = gates.enter("p")
    for _ in range(30):
        gate.sizer.observe(gate.sizer.size(), gate.sizer.size() / 2e6)
    gates.leave("p", gate)
    again = gates.enter("p")
    assert again is not gate and again.sizer.size() == 100_000


async def _lowat_of(host: Host, seconds: float = 10.0) -> list[int]:
    """TCP_NOTSENT_LOWAT of each of ``host``'s connections, once it has one (the dialled
    side registers the connection after the dialler's ``dial`` returned: under load, a
    moment later), or ``[]`` after ``seconds``."""
    async def read() -> list[int]:
        out = []
        for conns in host._t_host.get_network().connections.values():
            for conn in conns if isinstance(conns, list) else [conns]:
                out.append(find_socket(conn).getsockopt(socket.IPPROTO_TCP,
                                                        socket.TCP_NOTSENT_LOWAT))
        return out

    deadline = asyncio.get_running_loop().time() + seconds
    while not (out := await host.bridge.call(read)) and \
            asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    return out


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="needs TCP_NOTSENT_LOWAT "
                    "(Linux, macOS)")
def test_real_hosts_keep_little_unsent_and_pass_bulk_messages_through_one_gate() -> None:
    """Both ends of a connection get TCP_NOTSENT_LOWAT; three large messages sent at once to
    one peer hold its gate one at a time (the others wait in it), all arrive whole, and the
    gate is dropped once they are written."""

    async def main() -> None:
        order = SendOrder(unsent_bytes=96 * KiB)
        got: list[int] = []
        async with Host(generate(), HostOptions(send_order=order,
                                                upload_bytes_s=8 * MiB)) as a, \
                Host(generate(), HostOptions(send_order=order)) as b:
            async def sink(message: Message, peer: str) -> Message:
                got.append(int(message.meta["n"]))
                return Message(kind="ok")

            b.set_request_handler("/test/sink/1", sink)
            await a.dial(b.addrs[0])
            assert await _lowat_of(a) == [96 * KiB]
            assert await _lowat_of(b) == [96 * KiB]
            x = torch.randn(MiB // 2)  # 2 MiB as float32: a quarter second at 8 MiB/s

            async def peek() -> tuple[int, int]:
                gate = a.gates._gates.get(b.peer_id)
                return (0, 0) if gate is None else (gate.users,
                                                    gate.lock.statistics().tasks_waiting)

            sends = [asyncio.create_task(a.request(b.peer_id, "/test/sink/1",
                                                   Message(kind="x", tensors=(x,),
                                                           meta={"n": n}), timeout=30))
                     for n in range(3)]
            seen = set()
            while not all(s.done() for s in sends):
                seen.add(await a.bridge.call(peek))
                await asyncio.sleep(0.01)
            await asyncio.gather(*sends)
            assert all(waiting == users - 1 for users, waiting in seen if users), seen
            assert any(waiting >= 1 for _, waiting in seen), seen  # one wrote, others waited
            assert sorted(got) == [0, 1, 2]
            assert await a.bridge.call(peek) == (0, 0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_large_requests_deadline_does_not_count_its_wait_behind_our_own_large_messages(
        ) -> None:
    """Four 4 MiB requests at once to one peer through a 4 MiB/s upload cap: the last waits
    about 3 s for the other three to go out, then takes 1 s. Its 2 s deadline is the peer's
    time: the wait behind our own uplink's backlog moves it, so all four are answered (the
    wait is counted), where a deadline counting the wait would cut the last two."""

    async def main() -> None:
        async with Host(generate(), HostOptions(upload_bytes_s=4 * MiB)) as a, \
                Host(generate(), HostOptions()) as b:
            async def sink(message: Message, peer: str) -> Message:
                return Message(kind="ok")

            b.set_request_handler("/test/sink/1", sink)
            await a.dial(b.addrs[0])
            x = torch.randn(MiB)  # 4 MiB as float32
            replies = await asyncio.gather(*(
                a.request(b.peer_id, "/test/sink/1", Message(kind="x", tensors=(x,)),
                          timeout=2.0) for _ in range(4)))
            assert [r.kind for r in replies] == ["ok"] * 4
            assert a.counters.get("send_order.queued_ms") >= 2000

    asyncio.run(asyncio.wait_for(main(), 60))
