"""Resource caps benchmark: a host with its upload (then its download) capped at 1 MB/s sends
for 20 s over real libp2p on 127.0.0.1, against an uncapped reference in the same run.

    python tools/bench_limits.py [--cap 1000000] [--seconds 20] [--streams 2] [--quick]

Prints one JSON object:

- ``upload``: the sender has ``HostOptions.upload_bytes_s = cap``; ``streams`` concurrent
  request streams (they share the one bucket) send 256 KiB messages back to back for
  ``seconds``. ``measured_Bps``: frame bytes the *receiver* counted (``bytes_received``) from the
  first acknowledged message to the end, over that time (MB = 10**6 bytes); ``ratio`` =
  measured / cap (target: within 10% of 1). ``bucket``: the sender's own accounting.
- ``download``: the same with the receiver's ``download_bytes_s = cap`` (the sender uncapped,
  held back by yamux flow control); measured at the receiver likewise.
- ``uncapped``: the same transfer with no cap for ``reference_seconds`` (3 s), MB/s: what the
  cap is taken out of.

``targets``: ``{"name": {"value", "target", "ok"}}``. Every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import uvloop  # noqa: E402

from transport import identity  # noqa: E402
from transport.codecs import CodecSpec  # noqa: E402
from transport.frames import Message  # noqa: E402
from transport.host import Host, HostOptions  # noqa: E402

SINK = "/bench/limits/sink/1"
MESSAGE_BYTES = 256 * 1024
#: most messages one run may send (a bound besides the time)
MAX_MESSAGES = 100_000


async def _transfer(sender_options: HostOptions, receiver_options: HostOptions, seconds: float,
                    streams: int) -> dict[str, Any]:
    async with Host(identity.generate(), sender_options) as a, \
            Host(identity.generate(), receiver_options) as b:
        async def sink(message: Message, peer: str) -> Message:
            return Message(kind="ok")

        b.set_request_handler(SINK, sink)
        await a.dial(b.addrs[0])
        payload = Message(kind="data", tensors=(torch.zeros(MESSAGE_BYTES, dtype=torch.uint8),))
        none = CodecSpec(name="none")
        await a.request(b.peer_id, SINK, payload, codec=none, timeout=60)  # warm the streams
        start_bytes, start = b.counters.get("bytes_received"), time.monotonic()
        deadline = start + seconds
        sent = 0

        async def send_loop() -> None:
            nonlocal sent
            while time.monotonic() < deadline and sent < MAX_MESSAGES:
                await a.request(b.peer_id, SINK, payload, codec=none, timeout=60)
                sent += 1

        async with asyncio.timeout(seconds + 120):
            await asyncio.gather(*(send_loop() for _ in range(streams)))
        elapsed = time.monotonic() - start
        got = b.counters.get("bytes_received") - start_bytes
        return {"seconds": round(elapsed, 3), "messages": sent, "bytes": got,
                "measured_Bps": round(got / elapsed), "sender": a.throttle.status(),
                "receiver": b.throttle.status()}


def run(cap: int, seconds: float, streams: int, reference_s: float) -> dict[str, Any]:
    plain = dict(pubsub=None)
    up = uvloop.run(_transfer(HostOptions(**plain, upload_bytes_s=cap), HostOptions(**plain),
                              seconds, streams))
    up["ratio"] = round(up["measured_Bps"] / cap, 4)
    up["bucket"] = up.pop("sender")["upload"]
    up.pop("receiver")
    down = uvloop.run(_transfer(HostOptions(**plain), HostOptions(**plain, download_bytes_s=cap),
                                seconds, streams))
    down["ratio"] = round(down["measured_Bps"] / cap, 4)
    down["bucket"] = down.pop("receiver")["download"]
    down.pop("sender")
    ref = uvloop.run(_transfer(HostOptions(**plain), HostOptions(**plain), reference_s, streams))
    uncapped = {"seconds": ref["seconds"], "MBps": round(ref["measured_Bps"] / 1e6, 1)}
    targets = {
        "upload_within_10pct_of_cap": {"value": up["ratio"], "target": "0.9..1.1",
                                       "ok": 0.9 <= up["ratio"] <= 1.1},
        "download_within_10pct_of_cap": {"value": down["ratio"], "target": "0.9..1.1",
                                         "ok": 0.9 <= down["ratio"] <= 1.1},
    }
    return {"cap_Bps": cap, "streams": streams, "message_bytes": MESSAGE_BYTES, "upload": up,
            "download": down, "uncapped": uncapped, "targets": targets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=int, default=1_000_000, help="bytes per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="5 s runs, 1 s reference")
    args = parser.parse_args()
    if args.cap < 1 or args.seconds <= 0 or not 1 <= args.streams <= 16:
        parser.error("--cap must be >= 1, --seconds > 0 and --streams from 1 to 16")
    seconds, reference = (5.0, 1.0) if args.quick else (args.seconds, 3.0)
    print(json.dumps(run(args.cap, seconds, args.streams, reference)))


if __name__ == "__main__":
    main()
