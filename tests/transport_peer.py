"""A transport Host in its own process, for integration tests.

Prints one JSON line {"peer_id", "addrs"} once listening, then serves test protocols until its
stdin closes (so it never outlives the test) or a deadline passes. Modes:
  serve [MAX_MIB] [--key FILE] [--port N]
                            handlers below; with --key, the identity is kept in FILE
  send-half ADDR SIZE       dial ADDR, start a SIZE-byte message on /test/sink/1, write half of
                            it, then die with SIGKILL (a peer dying mid-message)
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop  # noqa: E402

from transport import identity  # noqa: E402
from transport.frames import Message, encode_message  # noqa: E402
from transport.codecs import CodecSpec  # noqa: E402
from transport.host import Host, HostOptions  # noqa: E402
from transport.limits import Limits  # noqa: E402

MiB = 1 << 20


def rss() -> dict[str, int]:
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024
    return status


async def serve(max_message_mib: int, key: str | None, port: int, idle: float) -> None:
    limits = Limits(max_message_bytes=max_message_mib * MiB, max_tensor_bytes=4 * max_message_mib * MiB)
    ident = identity.generate()
    if key:
        from pathlib import Path
        if Path(key).exists():
            ident = identity.load(Path(key))
        else:
            identity.save(ident, Path(key))
    host = Host(ident, HostOptions(limits=limits, listen=(f"/ip4/127.0.0.1/tcp/{port}",),
                                   idle_stream_timeout_s=idle))

    async def echo(message: Message, peer: str) -> Message:
        return message

    async def slow(message: Message, peer: str) -> Message:  # echoes after meta["s"] seconds
        await asyncio.sleep(min(5.0, float(message.meta.get("s", 0.0))))
        return message

    async def fail(message: Message, peer: str) -> Message:
        raise RuntimeError("this handler always fails")

    class Busy(Exception):
        code = "busy"

    async def refuse(message: Message, peer: str) -> Message:  # a typed refusal, every time
        raise Busy("always busy")

    async def stats(message: Message, peer: str) -> Message:
        return Message(kind="stats", meta={"counters": host.counters.snapshot(), **rss()})

    async def sink(stream) -> None:  # counts what it receives; replies with sizes
        while (message := await stream.receive()) is not None:
            sizes = [int(t.numel()) for t in message.tensors]
            del message
            await stream.send(Message(kind="got", meta={"sizes": sizes, **rss()}))

    async def typed(stream) -> None:  # only speaks kind "ping"
        while (message := await stream.receive(kinds={"ping"})) is not None:
            await stream.send(Message(kind="pong"))

    host.set_request_handler("/test/echo/1", echo)
    host.set_request_handler("/test/slow/1", slow)
    host.set_request_handler("/test/fail/1", fail)
    host.set_request_handler("/test/refuse/1", refuse)
    host.set_request_handler("/test/stats/1", stats)
    async def publish(message: Message, peer: str) -> Message:
        await host.publish(message.meta["topic"], message.meta["data"])
        return Message(kind="published")

    host.set_request_handler("/test/publish/1", publish)
    host.set_handler("/test/sink/1", sink)
    host.set_handler("/test/typed/1", typed)
    async with host:
        print(json.dumps({"peer_id": host.peer_id, "addrs": host.addrs}), flush=True)
        loop = asyncio.get_running_loop()
        stdin_closed = loop.run_in_executor(None, sys.stdin.read)
        await asyncio.wait_for(stdin_closed, timeout=600)


async def send_half(addr: str, size: int) -> None:
    async with Host(identity.generate()) as host:
        peer = await host.dial(addr)
        stream = await host.open_stream(peer, "/test/sink/1")
        import torch
        frame = encode_message(Message(kind="data", tensors=(torch.zeros(size // 4),)),
                               CodecSpec(name="none"))
        data = frame.head + bytes(frame.parts[0][: size // 2])
        await stream.write_raw(data)
        print(json.dumps({"sent": len(data)}), flush=True)
        # the bytes are in the kernel's buffers (yamux only returns once the peer granted
        # window for them); the kernel still delivers them after the kill, then the FIN
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode = sys.argv[1]
    if mode == "serve":
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("max_mib", type=int, nargs="?", default=64)
        parser.add_argument("--key")
        parser.add_argument("--port", type=int, default=0)
        parser.add_argument("--idle", type=float, default=120.0)
        args = parser.parse_args(sys.argv[2:])
        uvloop.run(serve(args.max_mib, args.key, args.port, args.idle))
    elif mode == "send-half":
        uvloop.run(send_half(sys.argv[2], int(sys.argv[3])))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
