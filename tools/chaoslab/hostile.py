"""A hostile peer for the chaos run: joins the lab swarm's transport for ``--seconds`` and
sends one of the protocol fuzzer's cases (tests/fuzz_cases.py) to one stage peer, again and
again, at most ``--max-sends`` times, then prints what the victim did with them::

    python -m tools.chaoslab.hostile --peer <id> --addr <multiaddr> --swarm <name> \\
        --model-hash <hash> --listen /ip4/198.18.9.2/tcp/0 --seed 7 --seconds 30

Prints one JSON line ``{"case": {protocol, name, kind}, "sent", "outcomes": {outcome: n}}``.
Every send has a deadline; the whole run is bounded by ``--seconds`` plus one send's deadline;
SIGTERM ends it early (it still prints its line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: the protocols a stage daemon serves (tests/test_fuzz_protocols.py DAEMON_PROTOCOLS)
DAEMON_PROTOCOLS = ("forward", "backward", "round", "allreduce", "state")
SEND_TIMEOUT_S = 3.0
GAP_S = 0.5


def pick_case(swarm: str, model_hash: str, seed: int) -> Any:
    """One fuzzer case for a stage daemon, chosen by ``seed``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fuzz_cases import cases

    pool = [c for c in cases(swarm, model_hash) if c.protocol.rsplit("/", 1)[1]
            in DAEMON_PROTOCOLS]
    return random.Random(seed).choice(pool)


async def _send(host: Any, peer: str, case: Any) -> str:
    from transport.errors import RemoteError, TransportError
    from transport.frames import Message

    try:
        async with asyncio.timeout(2 * SEND_TIMEOUT_S):
            if case.raw is not None:
                stream = await host.open_stream(peer, case.protocol, timeout=SEND_TIMEOUT_S)
                try:
                    await stream.write_raw(case.raw, timeout=SEND_TIMEOUT_S)
                    reply = await stream.receive(timeout=1.0)
                finally:
                    stream.reset_soon()
                return f"reply:{reply.kind}" if reply is not None else "closed"
            reply = await host.request(peer, case.protocol, Message(
                kind=case.kind, meta=case.meta, tensors=case.tensors), timeout=SEND_TIMEOUT_S)
            return f"reply:{reply.kind}"
    except TimeoutError:
        return "no_answer"
    except RemoteError as exc:
        return f"error:{exc.code}"
    except TransportError as exc:
        return f"closed:{getattr(exc, 'code', type(exc).__name__)}"


async def attack(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from transport import identity
    from transport.host import Host, HostOptions

    torch.set_num_threads(1)
    case = pick_case(args.swarm, args.model_hash, args.seed)
    seen: Counter[str] = Counter()
    sent = 0
    end = time.monotonic() + args.seconds
    stop = asyncio.Event()  # SIGTERM: stop sending and report what was seen
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    connected = False
    async with Host(identity.generate(), HostOptions(listen=(args.listen,), pubsub=None)) as host:
        try:
            connected = await asyncio.wait_for(host.ensure_connected(args.peer, (args.addr,)),
                                               SEND_TIMEOUT_S * 3)
        except TimeoutError:
            pass
        while connected and sent < args.max_sends and time.monotonic() < end \
                and not stop.is_set():
            seen[await _send(host, args.peer, case)] += 1
            sent += 1
            try:
                await asyncio.wait_for(stop.wait(), GAP_S)
            except TimeoutError:
                pass
    return {"case": {"protocol": case.protocol, "name": case.name, "kind": case.kind,
                     "raw": case.raw is not None},
            "connected": bool(connected), "sent": sent, "outcomes": dict(seen)}


def main() -> int:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("--peer", "--addr", "--swarm", "--model-hash", "--listen"):
        parser.add_argument(name, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-sends", type=int, default=60)
    args = parser.parse_args()
    try:
        result = uvloop.run(asyncio.wait_for(attack(args), args.seconds + 4 * SEND_TIMEOUT_S))
    except Exception as exc:  # reported, never raised: the chaos run reads one line
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
