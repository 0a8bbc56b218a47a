#!/usr/bin/env python3
"""Reference measurements that the swarmd transport benchmark compares against.

Every network figure is measured with TWO real processes on 127.0.0.1: a server
subprocess (this file, started with ``--serve-tcp`` or ``--serve-libp2p``) that
prints one JSON line ``{"host", "port", "peer_id", "addr"}`` on stdout, and the
client in the calling process.  The server exits on its own when its stdin
closes or after a deadline (120 s, longer only for long ``seconds_cap``s), and
the client kills and reaps it in a ``finally`` in any case.  Nothing leaves
127.0.0.1.

Functions (tools/ has no ``__init__``: put tools/ on ``sys.path`` and
``import bench_refs``):

* :func:`raw_tcp_MBps`    plain uvloop TCP, length-prefixed bulk messages
* :func:`libp2p_MBps`     py-libp2p alone, Noise + yamux with library defaults
* :func:`libp2p_rtt_ms`   py-libp2p 100-byte request/response round trip
* :func:`raw_tcp_rtt_ms`  plain uvloop TCP 100-byte round trip
* :func:`memcpy_MBps`     torch ``clone()`` of a float32 tensor, one thread

Units: MB = 10**6 bytes; throughput counts payload bytes only (the 8-byte
length prefixes are not counted).

The functions are synchronous.  Each runs its own event loop (uvloop or trio);
when called from a thread that already runs an asyncio or trio loop, the
client runs in a helper thread instead.

``python tools/bench_refs.py --json`` prints one JSON object with all five
figures on stdout and nothing else (logs go to stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

log = logging.getLogger("bench_refs")

HOST = "127.0.0.1"
_HDR = struct.Struct("!Q")  # bulk: u64 payload length; 0 ends a run (server acks b"A")
_RTT_HDR = struct.Struct("!II")  # echo: u32 payload size, u32 round trips
_OP_BULK = b"T"
_OP_ECHO = b"R"
_ACK = b"A"
_MAX_MESSAGE = 1 << 30  # servers refuse larger announced messages
_MAX_ECHO = 1 << 20

PROTO_BULK = "/bench/1"
PROTO_ECHO = "/bench/echo/1"

SERVER_DEADLINE_S = 120.0  # a server subprocess exits by itself after this
STARTUP_TIMEOUT_S = 30.0  # wait for the server's JSON line at most this long
RUNS = 3  # median of this many runs for the throughput figures
RTT_WARMUP = 20  # round trips discarded before the timed ones

T = TypeVar("T")


# --------------------------------------------------------------------------
# helpers shared by client and server
# --------------------------------------------------------------------------


def _loop_running_here() -> bool:
    """True when an asyncio or trio loop already runs in this thread."""
    try:
        import asyncio

        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    if "trio" in sys.modules:
        import trio

        try:
            trio.lowlevel.current_trio_token()
            return True
        except RuntimeError:
            pass
    return False


def _call(fn: Callable[[], T], timeout: float) -> T:
    """Run ``fn`` here, or in a helper thread when a loop already runs here."""
    if not _loop_running_here():
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["v"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["e"] = e

    th = threading.Thread(target=target, name="bench_refs", daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        raise TimeoutError(f"benchmark did not finish within {timeout:.0f} s")
    if "e" in box:
        raise box["e"]
    return box["v"]


def _uvloop_run(coro_fn: Callable[[], Any]) -> Any:
    import asyncio

    try:
        import uvloop
    except ImportError:  # still measurable, but stock asyncio is ~4x slower
        log.warning("uvloop not installed: raw TCP uses stock asyncio")
        return asyncio.run(coro_fn())
    return uvloop.run(coro_fn())


def _deadline_for(client_budget_s: float) -> float:
    """Server self-exit deadline: 120 s, or longer when the client may need longer."""
    return max(SERVER_DEADLINE_S, client_budget_s + STARTUP_TIMEOUT_S + 10.0)


def _mb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("nan")


# --------------------------------------------------------------------------
# server subprocess management (client side)
# --------------------------------------------------------------------------


@contextmanager
def _server(kind: str, deadline_s: float = SERVER_DEADLINE_S) -> Iterator[dict[str, Any]]:
    """Start ``--serve-<kind>`` in a subprocess; yield its JSON line; always reap it."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        f"--serve-{kind}",
        "--deadline",
        str(deadline_s),
    ]
    # The references use library defaults: drop py-libp2p's yamux tuning variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PY_YAMUX_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,  # server logs go to our stderr
        env=env,
        close_fds=True,
    )
    try:
        info = _read_server_line(proc, STARTUP_TIMEOUT_S)
        log.debug("server %s: %s", kind, info)
        yield info
    finally:
        _reap(proc)


def _read_server_line(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    end = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    info = json.loads(line)
                except ValueError:
                    info = None
                if isinstance(info, dict) and "port" in info:
                    return info
                log.info("server stdout: %r", line[:200])
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"server gave no address within {timeout:.0f} s")
            if not sel.select(min(left, 0.5)):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited early with code {proc.returncode}")
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"server closed stdout (exit code {proc.wait(5)})")
            buf += chunk


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Close the server's stdin (it exits on EOF), then kill and wait regardless."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - should not happen
            log.error("server pid %d did not die after SIGKILL", proc.pid)
    if proc.stdout is not None:
        proc.stdout.close()


# --------------------------------------------------------------------------
# raw TCP (uvloop)
# --------------------------------------------------------------------------
# Client: uvloop streams (writer.write + drain).  Server: raw non-blocking socket,
# loop.sock_recv_into a preallocated buffer.  Measured while writing this file
# (4 MiB messages, 512 MiB): a StreamReader.readexactly server reached only
# ~450 MB/s (it copies through its internal buffer); sock_recv_into ~4000-5000.
# On the client, streams and loop.sock_sendall were equal within noise; streams
# varied less.


async def _tcp_recv_exact(loop: Any, sock: socket.socket, mv: memoryview) -> None:
    got = 0
    n = len(mv)
    while got < n:
        r = await loop.sock_recv_into(sock, mv[got:])
        if r == 0:
            raise EOFError("peer closed")
        got += r


async def _tcp_serve_conn(sock: socket.socket) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    small = bytearray(16)
    smv = memoryview(small)
    big = bytearray(0)
    try:
        await _tcp_recv_exact(loop, sock, smv[:1])
        op = bytes(smv[:1])
        if op == _OP_BULK:
            while True:
                await _tcp_recv_exact(loop, sock, smv[:8])
                (n,) = _HDR.unpack_from(small)
                if n == 0:
                    await loop.sock_sendall(sock, _ACK)
                    continue  # the client may start another run or close
                if n > _MAX_MESSAGE:
                    raise ValueError(f"message of {n} bytes refused")
                if len(big) < n:
                    big = bytearray(n)
                await _tcp_recv_exact(loop, sock, memoryview(big)[:n])
        elif op == _OP_ECHO:
            await _tcp_recv_exact(loop, sock, smv[:8])
            size, count = _RTT_HDR.unpack_from(small)
            if not 0 < size <= _MAX_ECHO:
                raise ValueError(f"echo size {size} refused")
            buf = bytearray(size)
            bmv = memoryview(buf)
            for _ in range(count):
                await _tcp_recv_exact(loop, sock, bmv)
                await loop.sock_sendall(sock, bmv)
        else:
            raise ValueError(f"unknown op {op!r}")
    except (EOFError, ConnectionError):
        pass
    except Exception as e:
        log.warning("tcp server: %r", e)
    finally:
        sock.close()


async def _tcp_serve(deadline_s: float) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((HOST, 0))
    ls.listen(16)
    ls.setblocking(False)
    port = ls.getsockname()[1]
    _announce({"host": HOST, "port": port, "peer_id": None, "addr": f"/ip4/{HOST}/tcp/{port}"})
    tasks: set[Any] = set()

    async def accept_loop() -> None:
        while True:
            s, _ = await loop.sock_accept(ls)
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = loop.create_task(_tcp_serve_conn(s))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    try:
        await asyncio.wait_for(accept_loop(), deadline_s)
    except asyncio.TimeoutError:
        pass
    finally:
        ls.close()


async def _tcp_open(port: int) -> tuple[Any, Any]:
    import asyncio

    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 10.0)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def _tcp_bulk_client(
    port: int, message_bytes: int, total_bytes: int, seconds_cap: float, runs: int
) -> list[float]:
    import asyncio

    frame = _HDR.pack(message_bytes) + bytes(message_bytes)  # built once, reused
    end_marker = _HDR.pack(0)
    reader, writer = await _tcp_open(port)
    results: list[float] = []
    try:
        writer.write(_OP_BULK)
        for _ in range(runs):
            sent = 0
            t0 = time.perf_counter()
            t_stop = t0 + seconds_cap
            while sent < total_bytes and time.perf_counter() < t_stop:
                writer.write(frame)
                await asyncio.wait_for(writer.drain(), seconds_cap + 10.0)
                sent += message_bytes
            writer.write(end_marker)
            await asyncio.wait_for(writer.drain(), 10.0)
            await asyncio.wait_for(reader.readexactly(1), seconds_cap + 10.0)
            dt = time.perf_counter() - t0
            results.append(_mb_per_s(sent, dt))
            log.info("raw tcp run: %d MiB in %.3f s = %.0f MB/s", sent >> 20, dt, results[-1])
    finally:
        writer.close()
    return results


async def _tcp_echo_client(port: int, payload: int, count: int) -> list[float]:
    import asyncio

    reader, writer = await _tcp_open(port)
    msg = bytes(payload)
    samples: list[float] = []
    try:
        writer.write(_OP_ECHO + _RTT_HDR.pack(payload, count + RTT_WARMUP))
        for i in range(count + RTT_WARMUP):
            t0 = time.perf_counter()
            writer.write(msg)
            await asyncio.wait_for(reader.readexactly(payload), 10.0)
            dt = time.perf_counter() - t0
            if i >= RTT_WARMUP:
                samples.append(dt)
    finally:
        writer.close()
    return samples


def raw_tcp_MBps(
    message_bytes: int = 4 << 20, total_bytes: int = 512 << 20, seconds_cap: float = 10.0
) -> float:
    """Plain uvloop TCP throughput on 127.0.0.1 in MB/s (10**6 bytes/s).

    Two processes.  The client (uvloop streams) sends ``message_bytes`` messages,
    each with an 8-byte length prefix, until ``total_bytes`` are sent or
    ``seconds_cap`` has passed; the server (uvloop, ``sock_recv_into`` a
    preallocated buffer) reads every message fully and acks once at the end.
    Time runs on the client from the first byte until the ack.  Median of 3 runs
    over one connection.
    """
    if message_bytes <= 0 or total_bytes <= 0:
        raise ValueError("message_bytes and total_bytes must be positive")

    budget = RUNS * (seconds_cap + 20.0)

    def go() -> float:
        with _server("tcp", _deadline_for(budget)) as info:
            res = _uvloop_run(
                lambda: _tcp_bulk_client(info["port"], message_bytes, total_bytes, seconds_cap, RUNS)
            )
        return statistics.median(res)

    return _call(go, timeout=budget + STARTUP_TIMEOUT_S)


def raw_tcp_rtt_ms(payload: int = 100, count: int = 200) -> float:
    """Plain uvloop TCP request/response round trip on 127.0.0.1, median in ms.

    Two processes; the client writes ``payload`` bytes, the server echoes them,
    the client reads them all back.  ``count`` timed round trips after 20 warm-up ones.
    """
    if not 0 < payload <= _MAX_ECHO or count <= 0:
        raise ValueError("bad payload or count")

    def go() -> float:
        with _server("tcp") as info:
            samples = _uvloop_run(lambda: _tcp_echo_client(info["port"], payload, count))
        return statistics.median(samples) * 1e3

    return _call(go, timeout=STARTUP_TIMEOUT_S + 10.0 + count * 0.05)


# --------------------------------------------------------------------------
# py-libp2p (trio): Noise + yamux with library defaults
# --------------------------------------------------------------------------


def _make_host() -> Any:
    """A py-libp2p 0.8.1 host: Noise only (no plaintext fallback), yamux only,
    one connection per peer (avoids the 250 ms post-dial delay), 127.0.0.1."""
    import libp2p  # noqa: F401  (resets the "libp2p" logger; harmless here)
    from libp2p import ConnectionConfig, NOISE_PROTOCOL_ID, NoiseTransport, Yamux, YAMUX_PROTOCOL_ID
    from libp2p import generate_new_ed25519_identity, new_host
    from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
    from libp2p.custom_types import TProtocol

    _warn_if_tuned()
    key_pair = generate_new_ed25519_identity()
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        listen_addrs=[_loopback_maddr()],
    )


def _warn_if_tuned() -> None:
    """The reference is "library defaults": say so on stderr when this process isn't."""
    import libp2p.security.noise.io as noise_io
    import libp2p.stream_muxer.yamux.yamux as yamux

    changed = [k for k in os.environ if k.startswith("PY_YAMUX_")]
    for name, default in (
        ("MAX_MESSAGE_SIZE", 64 * 1024),
        ("DEFAULT_WINDOW_SIZE", 256 * 1024),
        ("MAX_WINDOW_SIZE", 16 * 1024 * 1024),
    ):
        if getattr(yamux, name, default) != default:
            changed.append(f"yamux.{name}={getattr(yamux, name)}")
    if getattr(noise_io, "MAX_PLAINTEXT_LENGTH", 65519) != 65519:
        changed.append(f"noise.MAX_PLAINTEXT_LENGTH={noise_io.MAX_PLAINTEXT_LENGTH}")
    if changed:
        log.warning("py-libp2p is tuned in this process (%s): the client side of the "
                    "reference is not 'library defaults'", ", ".join(changed))


def _loopback_maddr() -> Any:
    import multiaddr

    return multiaddr.Multiaddr(f"/ip4/{HOST}/tcp/0")


async def _p2p_read_exact_into(stream: Any, mv: memoryview) -> None:
    """Fill ``mv`` from a libp2p stream (``stream.read(n)`` may return fewer bytes)."""
    got = 0
    n = len(mv)
    while got < n:
        chunk = await stream.read(n - got)
        if not chunk:
            raise EOFError("stream closed")
        k = len(chunk)
        mv[got : got + k] = chunk
        got += k


async def _p2p_bulk_handler(stream: Any) -> None:
    # Catch everything: an exception escaping a handler takes down the whole host.
    small = bytearray(8)
    smv = memoryview(small)
    big = bytearray(0)
    try:
        while True:
            await _p2p_read_exact_into(stream, smv)
            (n,) = _HDR.unpack_from(small)
            if n == 0:
                await stream.write(_ACK)
                break
            if n > _MAX_MESSAGE:
                raise ValueError(f"message of {n} bytes refused")
            if len(big) < n:
                big = bytearray(n)
            await _p2p_read_exact_into(stream, memoryview(big)[:n])
        await stream.close()
    except BaseException as e:  # noqa: BLE001 - see above; Cancelled re-raised below
        await _p2p_reset_quietly(stream)
        if _is_cancel(e):
            raise
        if not isinstance(e, EOFError):
            log.warning("libp2p bulk handler: %r", e)


async def _p2p_echo_handler(stream: Any) -> None:
    try:
        hdr = bytearray(8)
        await _p2p_read_exact_into(stream, memoryview(hdr))
        size, count = _RTT_HDR.unpack_from(hdr)
        if not 0 < size <= _MAX_ECHO:
            raise ValueError(f"echo size {size} refused")
        buf = bytearray(size)
        bmv = memoryview(buf)
        for _ in range(count):
            await _p2p_read_exact_into(stream, bmv)
            await stream.write(bytes(buf))
        await stream.close()
    except BaseException as e:  # noqa: BLE001
        await _p2p_reset_quietly(stream)
        if _is_cancel(e):
            raise
        if not isinstance(e, EOFError):
            log.warning("libp2p echo handler: %r", e)


def _is_cancel(e: BaseException) -> bool:
    import trio

    return isinstance(e, (trio.Cancelled, KeyboardInterrupt, SystemExit))


async def _p2p_reset_quietly(stream: Any) -> None:
    import trio

    with trio.move_on_after(2.0) as scope:
        scope.shield = True
        try:
            await stream.reset()
        except Exception:
            pass


async def _p2p_serve(deadline_s: float) -> None:
    import trio
    from libp2p.custom_types import TProtocol

    host = _make_host()
    host.set_stream_handler(TProtocol(PROTO_BULK), _p2p_bulk_handler)
    host.set_stream_handler(TProtocol(PROTO_ECHO), _p2p_echo_handler)
    async with host.run(listen_addrs=[_loopback_maddr()]):
        pid = host.get_id()
        addr = None
        for a in host.get_addrs():
            s = str(a)
            if s.startswith(f"/ip4/{HOST}/tcp/"):
                addr = s
                break
        if addr is None:
            raise RuntimeError(f"no loopback listen address in {host.get_addrs()}")
        if "/p2p/" not in addr:
            addr = f"{addr}/p2p/{pid.to_base58()}"
        port = int(addr.split("/tcp/")[1].split("/")[0])
        _announce({"host": HOST, "port": port, "peer_id": pid.to_base58(), "addr": addr})
        await trio.sleep(deadline_s)


async def _p2p_client(info: dict[str, Any], body: Callable[[Any, Any], Any], timeout: float) -> Any:
    """Run ``body(host, peer_id)`` on a fresh client host connected to the server."""
    import multiaddr
    import trio
    from libp2p.peer.peerinfo import info_from_p2p_addr

    with trio.fail_after(timeout):
        host = _make_host()
        async with host.run(listen_addrs=[_loopback_maddr()]):
            peer_info = info_from_p2p_addr(multiaddr.Multiaddr(info["addr"]))
            await host.connect(peer_info)
            try:
                return await body(host, peer_info.peer_id)
            finally:
                with trio.move_on_after(5.0) as scope:
                    scope.shield = True
                    try:
                        await host.disconnect(peer_info.peer_id)
                    except Exception:
                        pass


async def _p2p_bulk_runs(
    host: Any, peer_id: Any, message_bytes: int, total_bytes: int, seconds_cap: float, runs: int
) -> list[float]:
    import trio
    from libp2p.custom_types import TProtocol

    frame = _HDR.pack(message_bytes) + bytes(message_bytes)  # built once, reused
    results: list[float] = []
    for _ in range(runs):
        stream = await host.new_stream(peer_id, [TProtocol(PROTO_BULK)])
        try:
            sent = 0
            t0 = time.perf_counter()
            t_stop = t0 + seconds_cap
            while sent < total_bytes and time.perf_counter() < t_stop:
                await stream.write(frame)
                sent += message_bytes
            await stream.write(_HDR.pack(0))
            ack = bytearray(1)
            with trio.fail_after(30.0):
                await _p2p_read_exact_into(stream, memoryview(ack))
            dt = time.perf_counter() - t0
        finally:
            with trio.move_on_after(5.0):
                try:
                    await stream.close()
                except Exception:
                    pass
        if bytes(ack) != _ACK:
            raise RuntimeError(f"bad ack {bytes(ack)!r}")
        results.append(_mb_per_s(sent, dt))
        log.info("libp2p run: %d MiB in %.3f s = %.0f MB/s", sent >> 20, dt, results[-1])
    return results


async def _p2p_echo_runs(host: Any, peer_id: Any, payload: int, count: int) -> list[float]:
    import trio
    from libp2p.custom_types import TProtocol

    stream = await host.new_stream(peer_id, [TProtocol(PROTO_ECHO)])
    msg = bytes(payload)
    back = bytearray(payload)
    bmv = memoryview(back)
    samples: list[float] = []
    try:
        await stream.write(_RTT_HDR.pack(payload, count + RTT_WARMUP))
        for i in range(count + RTT_WARMUP):
            t0 = time.perf_counter()
            await stream.write(msg)
            with trio.fail_after(10.0):
                await _p2p_read_exact_into(stream, bmv)
            dt = time.perf_counter() - t0
            if i >= RTT_WARMUP:
                samples.append(dt)
    finally:
        with trio.move_on_after(5.0):
            try:
                await stream.close()
            except Exception:
                pass
    return samples


def libp2p_MBps(
    message_bytes: int = 4 << 20, total_bytes: int = 256 << 20, seconds_cap: float = 15.0
) -> float:
    """py-libp2p 0.8.1 alone (no swarmd layers): Noise + yamux with library defaults.

    Two processes in trio, each a ``libp2p.new_host`` with a Noise-only security
    option, yamux only, ``ConnectionConfig(max_connections_per_peer=1)``, listening
    on /ip4/127.0.0.1/tcp/0.  One stream per run on ``/bench/1``: the client
    ``stream.write``s ``message_bytes`` messages, each with an 8-byte length prefix,
    until ``total_bytes`` or ``seconds_cap``; the server ``stream.read(n)``s until it
    has each whole message (into a preallocated buffer) and writes a 1-byte ack at
    the end.  MB/s (10**6 bytes/s) from the client's first write to the ack;
    median of 3 runs over one connection.  No yamux/Noise tuning is applied: the
    stream starts with yamux's 256 KiB window and auto-tunes it (up to 16 MiB),
    frames carry at most 64 KiB, Noise messages at most 65519 plaintext bytes.
    """
    if message_bytes <= 0 or total_bytes <= 0:
        raise ValueError("message_bytes and total_bytes must be positive")
    timeout = RUNS * (seconds_cap + 30.0) + 30.0

    def go() -> float:
        import trio

        with _server("libp2p", _deadline_for(timeout)) as info:
            res = trio.run(
                _p2p_client,
                info,
                lambda h, p: _p2p_bulk_runs(h, p, message_bytes, total_bytes, seconds_cap, RUNS),
                timeout,
            )
        return statistics.median(res)

    return _call(go, timeout=timeout + STARTUP_TIMEOUT_S + 10.0)


def libp2p_rtt_ms(payload: int = 100, count: int = 200) -> float:
    """py-libp2p (Noise + yamux, library defaults, same hosts as :func:`libp2p_MBps`)
    request/response round trip of ``payload`` bytes on one stream, median in ms
    over ``count`` round trips after 20 warm-up ones."""
    if not 0 < payload <= _MAX_ECHO or count <= 0:
        raise ValueError("bad payload or count")
    timeout = 30.0 + count * 0.1

    def go() -> float:
        import trio

        with _server("libp2p", _deadline_for(timeout)) as info:
            samples = trio.run(_p2p_client, info, lambda h, p: _p2p_echo_runs(h, p, payload, count), timeout)
        return statistics.median(samples) * 1e3

    return _call(go, timeout=timeout + STARTUP_TIMEOUT_S + 10.0)


# --------------------------------------------------------------------------
# memcpy
# --------------------------------------------------------------------------


def memcpy_MBps(nbytes: int = 64 << 20, repeats: int = 9) -> float:
    """torch ``clone()`` of a float32 tensor of ``nbytes`` with one intra-op thread.

    MB/s (10**6 bytes/s) counts the bytes of the tensor once (not read + write);
    median of ``repeats`` timed clones after one warm-up.  ``clone()`` allocates a
    fresh tensor each time, so page faults are included: ~2.1-2.4 GB/s for 64 MiB
    on the 2-core dev machine, where ``copy_`` into a preallocated tensor gives ~12 GB/s.
    """
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        nb = src.numel() * 4
        dst = src.clone()  # warm-up (page faults of the allocator)
        del dst
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst = src.clone()
            times.append(time.perf_counter() - t0)
            del dst
        return _mb_per_s(nb, statistics.median(times))
    finally:
        torch.set_num_threads(prev)


# --------------------------------------------------------------------------
# server entry point
# --------------------------------------------------------------------------


def _announce(info: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()


def _start_server_watchdogs(deadline_s: float) -> None:
    """Exit the server process when stdin closes or after ``deadline_s`` (+5 s grace)."""

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read1(4096):
                pass
        except Exception:
            pass
        os._exit(0)

    def watch_deadline() -> None:
        time.sleep(deadline_s + 5.0)
        log.warning("server deadline of %.0f s reached: exiting", deadline_s)
        os._exit(3)

    threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    threading.Thread(target=watch_deadline, name="deadline", daemon=True).start()


def _serve(kind: str, deadline_s: float) -> int:
    _start_server_watchdogs(deadline_s)
    rc = 0
    try:
        if kind == "tcp":
            _uvloop_run(lambda: _tcp_serve(deadline_s))
        else:
            import trio

            trio.run(_p2p_serve, deadline_s)
    except BaseException as e:  # noqa: BLE001 - report, then exit hard below
        log.error("server %s failed: %r", kind, e)
        rc = 1
    # Exit hard: a normal interpreter shutdown aborts while the stdin watcher
    # thread is blocked reading stdin ("could not acquire lock ... <stdin>").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def all_refs() -> dict[str, float]:
    """All five figures, measured one after another (~8-15 s on 2 idle cores)."""
    t0 = time.perf_counter()
    out: dict[str, float] = {}
    for name, fn in (
        ("raw_tcp_MBps", raw_tcp_MBps),
        ("raw_tcp_rtt_ms", raw_tcp_rtt_ms),
        ("libp2p_MBps", libp2p_MBps),
        ("libp2p_rtt_ms", libp2p_rtt_ms),
        ("memcpy_MBps", memcpy_MBps),
    ):
        t = time.perf_counter()
        v = fn()
        out[name] = round(v, 4 if name.endswith("_ms") else 1)
        log.info("%s = %s (%.1f s)", name, out[name], time.perf_counter() - t)
    log.info("all references measured in %.1f s", time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object with all figures")
    ap.add_argument("--serve-tcp", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-libp2p", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=SERVER_DEADLINE_S, help=argparse.SUPPRESS)
    ap.add_argument("-v", "--verbose", action="store_true", help="log each run to stderr")
    args = ap.parse_args(argv)

    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    if args.serve_tcp:
        return _serve("tcp", args.deadline)
    if args.serve_libp2p:
        return _serve("libp2p", args.deadline)

    refs = all_refs()
    if args.json:
        sys.stdout.write(json.dumps(refs) + "\n")
    else:
        for k, v in refs.items():
            print(f"{k:16s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
