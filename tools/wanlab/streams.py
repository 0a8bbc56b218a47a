"""One stream through swarmd's transport between two lab hosts, for tools/bench_wan.py.

    python -m tools.wanlab.streams serve --listen /ip4/198.18.2.2/tcp/0
    python -m tools.wanlab.streams send --to <addr> --peer <id> --seconds 4

``serve`` prints ``{"addr", "peer_id"}`` once listening, takes streams of tensor messages
(codec none) and acks each run with the count it decoded; it exits when its stdin closes or
after ``--deadline`` seconds. ``send`` sends messages of ``--mib`` MiB float32 on one stream
for ``--seconds`` (at most ``--max-messages``), waits for the ack and prints
``{"MBps", "bytes", "seconds"}``: payload bytes over the time from the first send to the ack.

    python -m tools.wanlab.streams contend --to <addr> --peer <id> --streams 4 --seconds 20

``contend`` is a pipeline stage's uplink in miniature: ``--streams`` streams each send
``--mib`` MiB messages back to back (each acked by the receiver, as a hop is answered) while
small requests go to the same peer every ``--probe-ms``; it prints the bulk rate, how long
each bulk message took from its send to its ack (``message_s``: p50, max) and the small
requests' round trips (``control_rtt_ms``: p50, p95, max), the delay that control traffic
(membership, stage reports) sees behind bulk tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

SINK = "/wanlab/sink/1"
ECHO = "/wanlab/echo/1"
MiB = 1 << 20


def _options(listen: str) -> Any:
    import torch

    from transport.host import HostOptions
    from transport.limits import Limits

    torch.set_num_threads(1)
    return HostOptions(listen=(listen,), limits=Limits(max_message_bytes=64 * MiB,
                                                       max_tensor_bytes=64 * MiB), pubsub=None)


async def serve(listen: str, deadline_s: float) -> None:
    from transport import identity
    from transport.frames import Message
    from transport.host import Host

    host = Host(identity.generate(), _options(listen))

    async def sink(stream: Any) -> None:
        received = 0
        while (got := await stream.receive(timeout=120)) is not None:
            if got.kind == "done":
                break
            received += 1
            if got.meta.get("ack"):
                await stream.send(Message(kind="ack", meta={"received": received}))
        await stream.send(Message(kind="ack", meta={"received": received}))

    async def echo(message: Message, peer: str) -> Message:
        return Message(kind="echo", meta=dict(message.meta))

    host.set_handler(SINK, sink)
    host.set_request_handler(ECHO, echo)
    async with host:
        print(json.dumps({"addr": host.addrs[0], "peer_id": host.peer_id}), flush=True)
        stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        try:
            await asyncio.wait_for(stdin_closed, timeout=deadline_s)
        except asyncio.TimeoutError:
            pass


async def send(addr: str, peer_id: str, listen: str, seconds: float, mib: float,
               max_messages: int) -> dict[str, float]:
    import torch

    from transport import identity
    from transport.frames import Message
    from transport.host import Host

    x = torch.zeros(int(mib * MiB) // 4)
    nbytes = x.numel() * 4
    async with Host(identity.generate(), _options(listen)) as host:
        await host.dial(addr, timeout=30)
        stream = await host.open_stream(peer_id, SINK)
        message = Message(kind="act", tensors=(x,))
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds and count < max_messages:
            await stream.send(message, timeout=120)
            count += 1
        await stream.send(Message(kind="done"))
        ack = await stream.receive(timeout=120)
        elapsed = time.perf_counter() - start
        await stream.close()
    if ack is None or ack.meta.get("received") != count:
        raise RuntimeError(f"the receiver acknowledged {ack and ack.meta} of {count} messages")
    return {"MBps": nbytes * count / elapsed / 1e6, "bytes": float(nbytes * count),
            "seconds": elapsed, "messages": float(count)}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def contend(addr: str, peer_id: str, listen: str, seconds: float, mib: float,
                  streams: int, probe_ms: float) -> dict[str, Any]:
    import torch

    from transport import identity
    from transport.frames import Message
    from transport.host import Host

    x = torch.zeros(int(mib * MiB) // 4)
    message = Message(kind="act", tensors=(x,), meta={"ack": True})
    took: list[float] = []
    rtts: list[float] = []
    sent = [0]
    async with Host(identity.generate(), _options(listen)) as host:
        await host.dial(addr, timeout=30)
        end = time.perf_counter() + seconds

        async def bulk() -> None:
            async with await host.open_stream(peer_id, SINK) as stream:
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    await stream.send(message, timeout=300)
                    await stream.receive(timeout=300)
                    took.append(time.perf_counter() - t)
                    sent[0] += 1
                await stream.send(Message(kind="done"))
                await stream.receive(timeout=300)

        async def probe() -> None:
            while time.perf_counter() < end:
                t = time.perf_counter()
                await host.request(peer_id, ECHO, Message(kind="ping", meta={"t": t}),
                                   timeout=300)
                rtts.append(time.perf_counter() - t)
                await asyncio.sleep(probe_ms / 1000)

        start = time.perf_counter()
        await asyncio.gather(probe(), *(bulk() for _ in range(streams)))
        elapsed = time.perf_counter() - start
    return {"MBps": x.numel() * 4 * sent[0] / elapsed / 1e6, "messages": sent[0],
            "message_s": {"p50": _quantile(took, 0.5), "max": max(took, default=float("nan"))},
            "control_rtt_ms": {k: 1000 * _quantile(rtts, q)
                               for k, q in (("p50", 0.5), ("p95", 0.95), ("max", 1.0))},
            "probes": len(rtts)}


def main(argv: list[str] | None = None) -> int:
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m tools.wanlab.streams")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", required=True)
    s.add_argument("--deadline", type=float, default=600.0)
    peer = argparse.ArgumentParser(add_help=False)  # where send and contend send to
    peer.add_argument("--to", required=True)
    peer.add_argument("--peer", required=True)
    peer.add_argument("--listen", required=True)
    c = sub.add_parser("send", parents=[peer])
    c.add_argument("--seconds", type=float, default=4.0)
    c.add_argument("--mib", type=float, default=1.0)
    c.add_argument("--max-messages", type=int, default=10_000)
    k = sub.add_parser("contend", parents=[peer])
    k.add_argument("--seconds", type=float, default=20.0)
    k.add_argument("--mib", type=float, default=1.0)
    k.add_argument("--streams", type=int, default=4)
    k.add_argument("--probe-ms", type=float, default=100.0)
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        uvloop.run(serve(args.listen, args.deadline))
    elif args.cmd == "contend":
        out = uvloop.run(asyncio.wait_for(contend(args.to, args.peer, args.listen, args.seconds,
                                                  args.mib, args.streams, args.probe_ms),
                                          args.seconds + 600))
        print(json.dumps(out), flush=True)
    else:
        out = uvloop.run(asyncio.wait_for(send(args.to, args.peer, args.listen, args.seconds,
                                               args.mib, args.max_messages),
                                          args.seconds + 300))
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
