"""Transport benchmark: swarmd's tensor wire against raw TCP and py-libp2p alone, same run.

    python tools/bench_transport.py --json

Prints one JSON object. Every figure that an issue names is here, with the references it is
compared against measured in the same run on the same machine (ratios are stable, absolute
numbers on these shared machines are not):

- ``raw_tcp_MBps``: plain uvloop sockets, two processes (tools/bench_refs.py)
- ``libp2p_MBps``: py-libp2p Noise + yamux alone, library defaults, two processes
- ``rtt_ms``: 100-byte request/response through ``transport.Host`` (pooled stream)
- ``dial_ms``: a fresh host's dial (TCP + Noise + yamux); py-libp2p alone waits 250 ms per dial
- ``memcpy_MBps``: ``clone()`` of the activation tensor, one thread
- ``receiver_peak_rss_growth_vs_max_message``: how much the receiver's peak RSS grows while it
  takes a message of the largest allowed size, as a multiple of that size
- ``codecs.<name>``: ``fp32_MBps`` (float32 bytes delivered and decoded per second, end to end
  through swarmd, two processes), ``wire_ratio``, ``rel_rms_error``, ``encode_MBps``,
  ``decode_MBps`` (one thread)
- ``ratios`` and ``targets``: the issue's figures, computed from the above

MB = 10**6 bytes. Traffic goes to 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SHAPE = (8, 512, 1024)
CODEC_NAMES = ("none", "fp16", "int8", "int8+zstd")
SINK = "/bench/sink/1"
ECHO = "/bench/echo/1"
STATS = "/bench/stats/1"
MiB = 1 << 20
MAX_MESSAGE_BYTES = 128 * MiB


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _host_options(torch_threads: int = 1) -> Any:
    """The same settings in both processes: one torch thread each, freed buffers reused."""
    import torch

    from transport.host import HostOptions
    from transport.limits import Limits
    from transport.memory import keep_freed_memory

    torch.set_num_threads(torch_threads)
    keep_freed_memory()
    return HostOptions(limits=Limits(max_message_bytes=MAX_MESSAGE_BYTES,
                                     max_tensor_bytes=4 * MAX_MESSAGE_BYTES),
                       pubsub=None)


# ---- the server process -------------------------------------------------------------------

async def _serve() -> None:
    from transport import identity
    from transport.frames import Message
    from transport.host import Host
    from transport.stream import decode_off_loop

    host = Host(identity.generate(), _host_options())

    async def sink(stream: Any) -> None:
        # receive the next frame while earlier ones decode: at most 2 decodes in flight
        pending: set[asyncio.Task[Any]] = set()
        received = 0
        while (got := await stream.receive_frame()) is not None:
            header, payload = got
            if header.kind == "done":
                break
            while len(pending) >= 2:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            pending.add(asyncio.ensure_future(decode_off_loop(header, payload,
                                                              host.options.limits)))
            received += 1
        if pending:
            await asyncio.wait(pending)
        for task in pending:
            task.result()  # a decode error fails the run loudly
        await stream.send(Message(kind="ack", meta={"received": received}))

    async def echo(message: Message, peer: str) -> Message:
        return message

    async def stats(message: Message, peer: str) -> Message:
        return Message(kind="stats", meta={"peak_rss": _peak_rss()})

    host.set_handler(SINK, sink)
    host.set_request_handler(ECHO, echo)
    host.set_request_handler(STATS, stats)
    async with host:
        print(json.dumps({"addr": host.addrs[0], "peer_id": host.peer_id}), flush=True)
        stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await asyncio.wait_for(stdin_closed, timeout=900)


# ---- the client -------------------------------------------------------------------------

async def _send_stream(host: Any, peer_id: str, codec: Any, x: Any, count: int) -> float:
    """Send ``count`` messages holding ``x`` with encoding pipelined against sending; return
    seconds from the first encode to the receiver's ack (all received and decoded)."""
    from transport.frames import Message
    from transport.stream import encode_off_loop

    stream = await host.open_stream(peer_id, SINK)
    message = Message(kind="act", tensors=(x,))
    start = time.perf_counter()
    next_frame = asyncio.ensure_future(encode_off_loop(message, codec))
    for i in range(count):
        frame = await next_frame
        if i + 1 < count:
            next_frame = asyncio.ensure_future(encode_off_loop(message, codec))
        await stream.send_frame(frame, timeout=60)
    await stream.send(Message(kind="done"))
    ack = await stream.receive(timeout=120)
    elapsed = time.perf_counter() - start
    await stream.close()
    if ack is None or ack.meta.get("received") != count:
        raise RuntimeError(f"receiver acknowledged {ack and ack.meta} of {count} messages")
    return elapsed


async def _client(addr: str, peer_id: str, runs: int, count: int,
                  codec_names: tuple[str, ...]) -> dict[str, Any]:
    import torch

    from transport import identity
    from transport.codecs import CodecSpec
    from transport.frames import Message
    from transport.host import Host

    out: dict[str, Any] = {}
    dials = []
    for _ in range(5):  # fresh hosts: a full dial (TCP, Noise, yamux) each time
        async with Host(identity.generate(), _host_options()) as fresh:
            t = time.perf_counter()
            await fresh.dial(addr, timeout=10)
            dials.append(time.perf_counter() - t)
    out["dial_ms"] = statistics.median(dials) * 1e3
    async with Host(identity.generate(), _host_options()) as host:
        await host.dial(addr)
        ping = Message(kind="ping", meta={"p": b"x" * 100})
        for _ in range(20):  # warm-up: stream pool, caches
            await host.request(peer_id, ECHO, ping)
        rtts = []
        for _ in range(300):
            t = time.perf_counter()
            await host.request(peer_id, ECHO, ping, timeout=10)
            rtts.append(time.perf_counter() - t)
        out["rtt_ms"] = statistics.median(rtts) * 1e3
        # memory: the receiver's peak RSS while it takes the largest message it allows
        big = torch.ones(MAX_MESSAGE_BYTES // 4)
        await _send_stream(host, peer_id, CodecSpec(name="none"), big[:1024], 1)  # warm
        before = (await host.request(peer_id, STATS, Message(kind="stats"))).meta["peak_rss"]
        await _send_stream(host, peer_id, CodecSpec(name="none"), big, 1)
        after = (await host.request(peer_id, STATS, Message(kind="stats"))).meta["peak_rss"]
        del big
        out["receiver_peak_rss_growth_vs_max_message"] = (after - before) / MAX_MESSAGE_BYTES
        x = torch.randn(*SHAPE)
        nbytes = x.numel() * 4
        for name in codec_names:
            codec = CodecSpec.parse(name)
            await _send_stream(host, peer_id, codec, x, 2)  # warm-up
            times = [await _send_stream(host, peer_id, codec, x, count) for _ in range(runs)]
            out[name] = {"fp32_MBps": nbytes * count / statistics.median(times) / 1e6}
    return out


def swarmd_figures(runs: int = 3, count: int = 16,
                   codec_names: tuple[str, ...] = CODEC_NAMES) -> dict[str, Any]:
    import uvloop

    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        from local_swarm import readline

        line = readline(proc, 60)
        if not line:
            raise RuntimeError("the benchmark server did not start")
        info = json.loads(line)
        _host_options()  # same torch threads here as in the server
        return uvloop.run(asyncio.wait_for(
            _client(info["addr"], info["peer_id"], runs, count, codec_names), 600))
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(quick: bool = False) -> dict[str, Any]:
    import bench_codecs
    import bench_refs

    result: dict[str, Any] = {"shape": list(SHAPE)}
    result["raw_tcp_MBps"] = bench_refs.raw_tcp_MBps()
    result["libp2p_MBps"] = bench_refs.libp2p_MBps()
    result["libp2p_rtt_ms"] = bench_refs.libp2p_rtt_ms()
    # 16 messages of 16 MiB float32 per run: the volume the libp2p reference moves per run
    wire = swarmd_figures(runs=1 if quick else 3, count=4 if quick else 16)
    result["rtt_ms"] = wire.pop("rtt_ms")
    result["dial_ms"] = wire.pop("dial_ms")
    result["receiver_peak_rss_growth_vs_max_message"] = wire.pop(
        "receiver_peak_rss_growth_vs_max_message")
    result["memcpy_MBps"] = bench_codecs.measure_memcpy(SHAPE)
    micro = bench_codecs.measure_codecs(SHAPE, threads=1, names=CODEC_NAMES)
    result["codecs"] = {name: {**wire[name], **micro[name]} for name in CODEC_NAMES}
    result["int8_outlier_rel_rms_error"] = bench_codecs.outlier_error()
    c, lib, mem = result["codecs"], result["libp2p_MBps"], result["memcpy_MBps"]
    result["ratios"] = {
        "none_fp32_vs_libp2p": c["none"]["fp32_MBps"] / lib,
        "int8_fp32_vs_libp2p": c["int8"]["fp32_MBps"] / lib,
        "int8_zstd_fp32_vs_libp2p": c["int8+zstd"]["fp32_MBps"] / lib,
        "int8_encode_vs_memcpy": c["int8"]["encode_MBps"] / mem,
        "int8_decode_vs_memcpy": c["int8"]["decode_MBps"] / mem,
    }
    r = result["ratios"]
    result["targets"] = {
        "none_fp32_ge_0.85x_libp2p": r["none_fp32_vs_libp2p"] >= 0.85,
        "int8_fp32_ge_3x_libp2p": r["int8_fp32_vs_libp2p"] >= 3.0,
        "int8_rel_rms_le_0.01": c["int8"]["rel_rms_error"] <= 0.01,
        "int8_wire_ratio_le_0.27": c["int8"]["wire_ratio"] <= 0.27,
        "int8_encode_ge_3000": c["int8"]["encode_MBps"] >= 3000,
        "int8_decode_ge_5000": c["int8"]["decode_MBps"] >= 5000,
        "int8_encode_ge_0.25x_memcpy": r["int8_encode_vs_memcpy"] >= 0.25,
        "int8_decode_ge_0.5x_memcpy": r["int8_decode_vs_memcpy"] >= 0.5,
        "outlier_error_le_0.06": result["int8_outlier_rel_rms_error"] <= 0.06,
        "rtt_le_2ms": result["rtt_ms"] <= 2.0,
        "dial_below_250ms": result["dial_ms"] < 250.0,
        "receiver_memory_le_2x_max_message":
            result["receiver_peak_rss_growth_vs_max_message"] <= 2.0,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer runs (a smoke test)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        uvloop.run(_serve())
        return 0
    result = measure(quick=args.quick)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
