"""Two real processes on 127.0.0.1 talking real libp2p (Noise + yamux): the peer under test
runs tests/transport_peer.py; this process is the client. Bad input must get a typed error,
close only the offending stream, count, and leave the peer serving."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgpack
import pytest
import torch
import uvloop

from daemon_harness import readline
from transport import frames, identity
from transport.codecs import CodecSpec
from transport.errors import RemoteError, TransportError
from transport.frames import Message
from transport.host import Host, HostOptions

pytestmark = pytest.mark.integration

PEER = Path(__file__).with_name("transport_peer.py")
MiB = 1 << 20
PEER_LIMIT_MIB = 64


class PeerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        line = readline(self.proc, 60.0)
        if not line:
            raise RuntimeError(f"peer process exited with {self.proc.poll()}")
        self.info = json.loads(line)
        self.peer_id: str = self.info.get("peer_id", "")
        self.addr: str = self.info["addrs"][0] if "addrs" in self.info else ""

    @property
    def port(self) -> int:
        return int(self.addr.split("/tcp/")[1].split("/")[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def peer() -> Any:
    p = PeerProcess("serve", str(PEER_LIMIT_MIB))
    yield p
    p.stop()
    assert p.proc.returncode == 0, "the peer under test must survive every test and exit cleanly"


def run(scenario: Callable[[Host], Awaitable[Any]], **options: Any) -> Any:
    async def main() -> Any:
        async with Host(identity.generate(), HostOptions(**options)) as host:
            return await asyncio.wait_for(scenario(host), 60)

    return uvloop.run(main())


async def stats(host: Host, peer: PeerProcess) -> dict[str, Any]:
    reply = await host.request(peer.peer_id, "/test/stats/1", Message(kind="stats"))
    return dict(reply.meta)


async def counter(host: Host, peer: PeerProcess, name: str) -> int:
    return int((await stats(host, peer))["counters"].get(name, 0))


async def wait_for_counter(host: Host, peer: PeerProcess, name: str, above: int,
                           seconds: float = 10.0) -> int:
    deadline = time.monotonic() + seconds
    while True:
        value = await counter(host, peer, name)
        if value > above or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


async def assert_still_serving(host: Host, peer: PeerProcess) -> None:
    reply = await host.request(peer.peer_id, "/test/echo/1", Message(kind="hello", meta={"x": 1}))
    assert reply.kind == "hello" and reply.meta == {"x": 1}


# ---- the happy paths --------------------------------------------------------------------

def test_request_reply_with_tensors_under_every_codec(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        x = torch.randn(3, 1000)
        ids = torch.arange(10, dtype=torch.int64)
        for name in ("none", "fp16", "int8", "int8+zstd"):
            reply = await host.request(peer.peer_id, "/test/echo/1",
                                       Message(kind="t", meta={"c": name}, tensors=(x, ids)),
                                       codec=CodecSpec.parse(name))
            y, got_ids = reply.tensors
            assert y.shape == x.shape and y.dtype == x.dtype
            assert torch.equal(got_ids, ids), name
            err = float((y - x).norm() / x.norm())
            assert err < {"none": 1e-7, "fp16": 1e-3}.get(name, 1e-2), (name, err)

    run(scenario)


def test_ping_and_dial_report_real_values(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        assert all("/tcp/0/" not in a and a.endswith(f"/p2p/{host.peer_id}") for a in host.addrs)
        assert await host.dial(peer.addr) == peer.peer_id
        rtt = await host.ping(peer.peer_id)
        assert 0 < rtt < 5.0
        assert peer.peer_id in await host.connected_peers()

    run(scenario)


# ---- bad input: typed error, stream closed, counter up, still serving -------------------

def test_handler_that_raises_gets_error_reply_and_host_keeps_serving(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        before = await counter(host, peer, "handler_errors")
        with pytest.raises(RemoteError) as err:
            await host.request(peer.peer_id, "/test/fail/1", Message(kind="x"))
        assert err.value.code == "internal_error"
        assert "always fails" in err.value.remote_message
        assert await counter(host, peer, "handler_errors") == before + 1
        await assert_still_serving(host, peer)

    run(scenario)


def test_hundreds_of_refused_requests_leave_the_connection_usable(peer: PeerProcess) -> None:
    """Each refusal (a typed error reply) frees its stream: py-libp2p allows 256 a connection,
    and streams kept after an error once made every later request wait out its deadline."""
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        codes = []
        for _ in range(300):  # bounded: one at a time, each within 5 s
            try:
                await host.request(peer.peer_id, "/test/refuse/1", Message(kind="x"), timeout=5)
            except RemoteError as exc:
                codes.append(exc.code)
            except TransportError as exc:
                codes.append(type(exc).__name__)
        assert codes == ["busy"] * 300, sorted(set(codes))
        await assert_still_serving(host, peer)

    run(scenario)


def test_unknown_kind_is_refused(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        before = await counter(host, peer, "protocol_errors.unknown_kind")
        stream = await host.open_stream(peer.peer_id, "/test/typed/1")
        await stream.send(Message(kind="ping"))
        assert (await stream.receive()).kind == "pong"
        await stream.send(Message(kind="bogus"))
        with pytest.raises(RemoteError) as err:
            await stream.receive(timeout=10)
        assert err.value.code == "unknown_kind"
        assert await counter(host, peer, "protocol_errors.unknown_kind") == before + 1
        await assert_still_serving(host, peer)

    run(scenario)


def _raw_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    body = msgpack.packb(header)
    return frames.PREFIX.pack(frames.MAGIC, frames.VERSION, len(body)) + body + payload


BAD_FRAMES = {
    "unknown_codec": _raw_frame({"k": "x", "m": {}, "n": 8, "t": [
        {"codec": "zz", "dtype": "float32", "shape": [2], "params": {}, "nbytes": 8}]}, b"\0" * 8),
    "shape_mismatch": _raw_frame({"k": "x", "m": {}, "n": 16, "t": [
        {"codec": "none", "dtype": "float32", "shape": [10], "params": {}, "nbytes": 16}]},
        b"\0" * 16),
    "prefix_over_limit": frames.PREFIX.pack(frames.MAGIC, frames.VERSION, 2**31) + b"\0" * 64,
    "payload_over_limit": _raw_frame({"k": "x", "m": {}, "n": 2**40, "t": [
        {"codec": "none", "dtype": "uint8", "shape": [2**40], "params": {}, "nbytes": 2**40}]}),
    "not_msgpack": frames.PREFIX.pack(frames.MAGIC, frames.VERSION, 5) + b"\xc1\xc1\xc1\xc1\xc1",
    "bad_magic": b"GET / HTTP/1.1\r\n\r\n",
}
EXPECTED_CODE = {"unknown_codec": "unknown_codec", "shape_mismatch": ("codec_error", "malformed_frame"),
                 "prefix_over_limit": "limit_exceeded", "payload_over_limit": "limit_exceeded",
                 "not_msgpack": "malformed_frame", "bad_magic": "malformed_frame"}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frames_get_typed_errors(peer: PeerProcess, case: str) -> None:
    expected = EXPECTED_CODE[case]
    expected = expected if isinstance(expected, tuple) else (expected,)

    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        before = await stats(host, peer)
        stream = await host.open_stream(peer.peer_id, "/test/sink/1")
        await stream.write_raw(BAD_FRAMES[case])
        try:
            reply = await stream.receive(timeout=10)
            pytest.fail(f"expected an error reply, got {reply}")
        except RemoteError as err:
            assert err.code in expected, err
        after = await stats(host, peer)
        counted = sum(after["counters"].get(f"protocol_errors.{c}", 0)
                      - before["counters"].get(f"protocol_errors.{c}", 0) for c in expected)
        assert counted == 1
        # refused before allocating: the peak memory of the peer did not jump
        assert after["VmHWM"] - before["VmHWM"] < 32 * MiB
        await assert_still_serving(host, peer)

    run(scenario)


def test_truncated_frame_is_not_a_clean_end(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        before = await counter(host, peer, "protocol_errors.truncated")
        stream = await host.open_stream(peer.peer_id, "/test/sink/1")
        frame = frames.encode_message(Message(kind="d", tensors=(torch.zeros(1000),)),
                                      CodecSpec(name="none"))
        await stream.write_raw(frame.head + bytes(frame.parts[0][:1000]))
        await stream.close()  # a clean FIN in the middle of the payload
        assert await wait_for_counter(host, peer, "protocol_errors.truncated", before) == before + 1
        await assert_still_serving(host, peer)

    run(scenario)


def test_peer_killed_mid_message_is_detected_as_truncation(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        before = await counter(host, peer, "protocol_errors.truncated")
        killer = await asyncio.to_thread(subprocess.run, [
            sys.executable, str(PEER), "send-half", peer.addr, str(8 * MiB)],
            capture_output=True, text=True, timeout=60)
        assert killer.returncode == -9, killer.stderr[-2000:]
        assert json.loads(killer.stdout)["sent"] > 4 * MiB
        assert await wait_for_counter(host, peer, "protocol_errors.truncated", before) == before + 1
        await assert_still_serving(host, peer)

    run(scenario)


def test_garbage_and_http_on_the_libp2p_port(peer: PeerProcess) -> None:
    def rejected(snapshot: dict[str, Any]) -> int:
        return sum(v for k, v in snapshot["counters"].items() if k.startswith("inbound_rejected."))

    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        before = rejected(await stats(host, peer))
        for garbage in (os.urandom(4096), b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", peer.port)
            writer.write(garbage)
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(), 15)  # the peer hangs up on us
            except ConnectionResetError:
                pass  # or aborts: both are a refusal
            writer.close()
        deadline = time.monotonic() + 15
        while rejected(await stats(host, peer)) < before + 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # >=: libp2p counts a garbage client when its upgrade times out, and a half-open
        # connection an earlier test left to this shared peer may time out in the same window
        assert rejected(await stats(host, peer)) >= before + 2
        await assert_still_serving(host, peer)

    run(scenario)


def test_hundreds_of_idle_sockets_do_not_lock_out_a_real_peer(peer: PeerProcess) -> None:
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", peer.port), timeout=5))

        async def scenario(host: Host) -> None:
            assert await host.dial(peer.addr, timeout=10) == peer.peer_id
            await assert_still_serving(host, peer)

        run(scenario)
    finally:
        for s in idle:
            s.close()


def test_receiver_memory_stays_within_twice_the_largest_message(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        # largest allowed payload: the limit minus nothing (codec none puts 4 bytes a value)
        x = torch.ones(PEER_LIMIT_MIB * MiB // 4)
        stream = await host.open_stream(peer.peer_id, "/test/sink/1")
        # warm up the peer's allocator with a small message, then measure the big one
        await stream.send(Message(kind="d", tensors=(torch.ones(1024),)))
        warm = await stream.receive(timeout=30)
        await stream.send(Message(kind="d", tensors=(x,)), codec=CodecSpec(name="none"))
        got = await stream.receive(timeout=60)
        await stream.close()
        assert got.meta["sizes"] == [x.numel()]
        growth = got.meta["VmHWM"] - warm.meta["VmHWM"]
        assert growth <= 2 * PEER_LIMIT_MIB * MiB, f"peak RSS grew {growth / MiB:.1f} MiB"

    run(scenario)


def test_message_over_the_limit_is_refused_and_counted(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        before = await counter(host, peer, "protocol_errors.limit_exceeded")
        x = torch.ones(PEER_LIMIT_MIB * MiB // 4 + 1)
        stream = await host.open_stream(peer.peer_id, "/test/sink/1")
        with pytest.raises(TransportError):
            await stream.send(Message(kind="d", tensors=(x,)), codec=CodecSpec(name="none"))
            await stream.receive(timeout=30)
        assert await counter(host, peer, "protocol_errors.limit_exceeded") == before + 1
        await assert_still_serving(host, peer)

    run(scenario)


# ---- standard libp2p behaviour ---------------------------------------------------------

def test_a_plain_py_libp2p_host_can_identify_and_ping_us(peer: PeerProcess) -> None:
    """Not our wrapper: py-libp2p with its own defaults, on trio, as any libp2p peer would."""
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.host.ping import PingService
    from libp2p.identity.identify.identify import ID as IDENTIFY
    from libp2p.identity.identify.pb.identify_pb2 import Identify
    from libp2p.network.stream.exceptions import StreamEOF
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.utils.varint import decode_varint_from_bytes

    async def main() -> tuple[list[int], Identify]:
        host = new_host()
        async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            info = info_from_p2p_addr(multiaddr.Multiaddr(peer.addr))
            with trio.fail_after(20):
                await host.connect(info)
                rtts = await PingService(host).ping(info.peer_id, ping_amt=3)
                stream = await host.new_stream(info.peer_id, [IDENTIFY])
                data = b""
                while True:
                    try:
                        chunk = await stream.read()
                    except StreamEOF:
                        break
                    if not chunk:
                        break
                    data += chunk
            length = decode_varint_from_bytes(data)
            start = len(data) - length
            return rtts, Identify.FromString(data[start:])

    try:
        rtts, ident = trio.run(main)
    except BaseException as exc:  # trio wraps in groups: show the cause
        raise AssertionError(f"plain libp2p client failed: {exc!r}") from exc
    assert len(rtts) == 3
    assert "/ipfs/ping/1.0.0" in ident.protocols and "/test/echo/1" in ident.protocols
    assert ident.agent_version  # identify answered with our metadata


def test_a_restarted_peer_can_be_dialled_again_at_once(tmp_path: Path) -> None:
    key = tmp_path / "peer.key"
    first = PeerProcess("serve", "--key", str(key))
    try:
        addr, port = first.addr, first.port
    finally:
        first.stop()

    async def scenario(host: Host) -> None:
        from transport.errors import PeerUnavailable

        with pytest.raises(PeerUnavailable):  # it is gone: a failure marks it in libp2p
            await host.dial(addr, timeout=5)
        second = await asyncio.to_thread(PeerProcess, "serve", "--key", str(key), "--port",
                                         str(port))
        try:
            assert second.addr == addr  # same identity, same port
            assert await host.dial(addr, timeout=5) == second.peer_id  # no 60 s blacklist
            await assert_still_serving(host, second)
        finally:
            second.stop()

    run(scenario)


def test_publish_subscribe_between_processes(peer: PeerProcess) -> None:
    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)
        sub = await host.subscribe("swarmd-test/topic")
        # the gossip mesh forms on a heartbeat: publish until one arrives (bounded)
        deadline = time.monotonic() + 20
        got = None
        while got is None and time.monotonic() < deadline:
            await host.request(peer.peer_id, "/test/publish/1", Message(
                kind="pub", meta={"topic": "swarmd-test/topic", "data": b"hello"}))
            try:
                got = await sub.get(timeout=0.5)
            except TimeoutError:
                continue  # the mesh is not formed yet: publish again
        assert got is not None, "no pubsub message arrived within 20 s"
        assert got.data == b"hello" and got.origin == peer.peer_id
        await sub.close()
        with pytest.raises(Exception):
            await host.publish("t", b"x" * ((1 << 20) + 1))  # gossipsub would drop it silently

    run(scenario)


def test_a_burst_of_requests_reuses_its_streams_the_next_time(peer: PeerProcess) -> None:
    # a trainer's step opens with a burst of microbatches to one peer: every stream of the
    # first burst is kept, so the next burst negotiates none (each open is a round trip)
    burst = 24

    async def scenario(host: Host) -> None:
        await host.dial(peer.addr)

        async def one(i: int) -> None:  # slow enough that the burst's requests overlap
            reply = await host.request(peer.peer_id, "/test/slow/1",
                                       Message(kind="x", meta={"s": 0.3, "i": i}))
            assert reply.meta["i"] == i

        await asyncio.gather(*(one(i) for i in range(burst)))
        opened = host.counters.get("request_streams_opened")
        assert opened == burst  # (they overlapped: none was free to reuse)
        await asyncio.gather(*(one(i) for i in range(burst)))
        assert host.counters.get("request_streams_opened") == opened

    run(scenario)


def test_idle_request_streams_are_closed_and_the_pool_recovers() -> None:
    quick = PeerProcess("serve", "--idle", "1")
    try:
        async def scenario(host: Host) -> None:
            await host.dial(quick.addr)
            await assert_still_serving(host, quick)  # leaves an idle pooled stream
            silent = await host.open_stream(quick.peer_id, "/test/echo/1")  # never sends
            deadline = time.monotonic() + 15
            while await counter(host, quick, "idle_streams_closed") < 2:
                assert time.monotonic() < deadline, "idle streams were not closed"
                await asyncio.sleep(0.1)
            with pytest.raises(TransportError):  # the silent stream was closed by the peer
                if await silent.receive(timeout=5) is None:
                    raise TransportError("closed")
            await assert_still_serving(host, quick)  # the stale pooled stream is replaced
            assert host.counters.get("pooled_stream_stale") >= 1

        run(scenario)
    finally:
        quick.stop()
