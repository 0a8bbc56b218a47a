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

With ``--routing``: instead, two daemons serve the one stage of a small model, one of them with
its upload capped at ``--routing-cap`` (200 kB/s), and a trainer trains ``--steps`` steps
through them. Each peer's ``/api/v0/status`` is sampled every second. Reported for the whole
run and for its ``steady`` part (from a third of the run, once both announce a throughput):
the forwards each served, the capped peer's share of them (``capped_forward_share``), the
throughput each announced (averaged over the samples; the capped one's is what its cap carries,
``swarmd.node.caps``), the capped peer's share of that (``capped_announced_share``), and
``share_ratio`` = forward share / announced share (target, on the steady part: 0.7..1.3,
i.e. routing in proportion to the capped throughput).

``hop_verdicts``: what the trainer's own router judged of each peer's failed hops (slow: a
timeout, which divides its rate for a while; busy; broken: banned), counted from its log
records, to tell a peer that left routing from one routed by its cap. ``targets``:
``{"name": {"value", "target", "ok"}}``. Every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
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


def routing(cap: int, steps: int, average_every: int = 20) -> dict[str, Any]:
    """Two daemons of one stage, one capped; a trainer trains through them (real processes).
    The stage averages every ``average_every`` trainer steps' samples (its target batch)."""
    from swarmd.models.registry import model_seam_of
    import os
    import tempfile

    from swarmd.config import load_config
    from swarmd.local.demo import DEMO_ENV
    from swarmd.local.swarm import DaemonProcess, stop_all, wait_until
    from swarmd.trainer.run import train

    env = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
           "SWARMD_SWARM_STAGES": "1", "SWARMD_SWARM_NAME": "bench-limits"}
    step = load_config(None, {**os.environ, **env}).training
    env["SWARMD_AVERAGING_TARGET_BATCH_SIZE"] = str(
        average_every * step.batch_size * step.microbatches)
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as root:
        free = DaemonProcess(Path(root) / "free", "--stage", "0", env=env)
        started = [free]
        try:
            free.wait_started()
            capped = DaemonProcess(Path(root) / "capped", "--stage", "0", "--bootstrap",
                                   free.addr, env={**env, "SWARMD_LIMITS_UPLOAD_BYTES_S": str(cap)})
            started.append(capped)
            capped.wait_started()
            wait_until(lambda: free.get("/api/v0/swarm")["stages"][0]["routable_peers"] == 2,
                       60, "both peers of the stage routable")
            config = load_config(None, {**os.environ, **env})
            hops = _HopVerdicts({capped.peer_id: "capped", free.peer_id: "free"})
            with hops.installed():
                result, rows = uvloop.run(_train_sampling(
                    train(config, bootstrap=[free.addr], steps=steps,
                          progress=lambda line: None, bar=False),
                    {"capped": capped, "free": free}))
            limits = capped.get("/api/v0/status")["limits"]
        finally:
            stop_all(started)
    from swarmd.node.host_options import upload_bytes_per_sample

    seam, _ = model_seam_of(config)
    report = _routing_report(cap, steps, result.lost, rows, limits,
                             upload_bytes_per_sample(config, seam), config.training.batch_size,
                             hops.events)
    return {**report, "average_every_steps": average_every,
            "target_batch_size": config.target_batch_size()}


class _HopVerdicts(logging.Handler):
    """The trainer's router's judgements of failed hops (``swarmd.pipeline.router`` logs each
    one at info: stage, peer, kind, verdict, error), kept as (time, peer name, verdict)."""

    MAX_EVENTS = 100_000

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__(logging.INFO)
        self.names = names
        self.events: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and len(self.events) < self.MAX_EVENTS:
            self.events.append((time.monotonic(), self.names.get(str(args[1]), "other"),
                                str(args[3])))

    def installed(self) -> Any:
        import contextlib

        logger = logging.getLogger("swarmd.pipeline.router")

        @contextlib.contextmanager
        def scope() -> Any:
            level = logger.level
            logger.addHandler(self)
            logger.setLevel(logging.INFO)
            try:
                yield self
            finally:
                logger.removeHandler(self)
                logger.setLevel(level)
        return scope()


async def _train_sampling(training: Any, peers: dict[str, Any]) -> tuple[Any, list[Any]]:
    """Run ``training`` while each peer's ``/api/v0/status`` (announced throughput, forwards
    served) is sampled once a second: [(throughputs, forwards)], each by peer name."""
    rows: list[tuple[dict[str, float], dict[str, int], dict[str, float]]] = []

    def sample() -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
        status = {name: d.get("/api/v0/status") for name, d in peers.items()}
        capped = status["capped"]
        limits = capped.get("limits") or {}
        return ({n: float(s["throughput"]) for n, s in status.items()},
                {n: int(s["counters"].get("stage.forward", 0)) for n, s in status.items()},
                {"t": time.monotonic(), "upload": float(limits["upload"].get("bytes", 0)),
                 "hops": float(capped["counters"].get("stage.forward", 0)
                               + capped["counters"].get("stage.backward", 0)),
                 "compute": float(limits.get("measured_throughput") or 0.0),
                 **{f"offline_{n}": float(s.get("state") != "online")
                    for n, s in status.items()},
                 # forwards each refused busy (its compute queue full, its budget, a step)
                 **{f"busy_{n}": float(sum(v for k, v in s["counters"].items()
                                           if k.startswith("stage.busy")))
                    for n, s in status.items()}})

    async def sampling() -> None:
        for _ in range(1200):  # at most 20 minutes, once a second
            rows.append(await asyncio.to_thread(sample))
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sampling())
    try:
        result = await asyncio.wait_for(training, 900)
    finally:
        sampler.cancel()
    rows.append(await asyncio.to_thread(sample))
    return result, rows


def _shares(rows: list[Any], cap: int, per_sample: float, batch: int,
            events: list[tuple[float, str, str]] | None = None) -> dict[str, Any]:
    """The capped peer's share of the forwards served between the first and the last of
    ``rows``; its share of the throughput announced (averaged over them); and its share of
    what its cap left for hops (``capped_left_share``): the cap less the other bytes (averaging,
    state) its upload bucket carried meanwhile, over the bytes a sample takes, at most its
    compute, against the uncapped peer's announced throughput. ``share_ratio``: forward share
    over the left share."""
    from swarmd.node.caps import capped_throughput, hop_upload_bytes

    first, last = rows[0][1], rows[-1][1]
    served = {n: last[n] - first[n] for n in last}
    announced = {n: sum(r[0][n] for r in rows) / len(rows) for n in last}
    total_fw, total_an = sum(served.values()), sum(announced.values())
    share = served["capped"] / total_fw if total_fw else 0.0
    expected = announced["capped"] / total_an if total_an else 0.0
    a, b = rows[0][2], rows[-1][2]
    span = max(1e-9, b["t"] - a["t"])
    other = max(0.0, (b["upload"] - a["upload"])
                - hop_upload_bytes(b["hops"] - a["hops"], per_sample, batch_size=batch)) / span
    compute = sum(r[2]["compute"] for r in rows) / len(rows)
    left_tput = capped_throughput(compute, max(0.0, cap - other), per_sample, batch_size=batch)
    left_total = left_tput + sum(v for n, v in announced.items() if n != "capped")
    left_share = left_tput / left_total if left_total else 0.0
    ratio = share / left_share if left_share else None
    busy = {n: round(b.get(f"busy_{n}", 0.0) - a.get(f"busy_{n}", 0.0)) for n in last}
    offline = {n: sum(r[2].get(f"offline_{n}", 0.0) for r in rows) for n in last}
    verdicts: dict[str, dict[str, int]] = {}
    for t, name, verdict in events or []:
        if a["t"] <= t <= b["t"]:
            by = verdicts.setdefault(name, {})
            by[verdict] = by.get(verdict, 0) + 1
    return {"samples": len(rows), "forwards": served, "busy_refusals": busy,
            "hop_verdicts": verdicts,
            "samples_not_online": offline,
            "announced": {n: round(v, 2) for n, v in announced.items()},
            "capped_other_upload_Bps": round(other), "capped_left_throughput": round(left_tput, 2),
            "capped_forward_share": round(share, 4),
            "capped_announced_share": round(expected, 4),
            "capped_left_share": round(left_share, 4),
            "announced_share_ratio": round(share / expected, 3) if expected else None,
            "share_ratio": round(ratio, 3) if ratio is not None else None}


def _routing_report(cap: int, steps: int, lost: int, rows: list[Any], limits: Any,
                    per_sample: float, batch: int,
                    events: list[tuple[float, str, str]] | None = None) -> dict[str, Any]:
    """The whole run, and its steady part: from when both peers announce a throughput and a
    third of the run has passed (the first hops follow priors; the first averaging round has
    not yet loaded the capped peer's upload) to the end. The target is judged on that part."""
    start = next((i for i, r in enumerate(rows) if all(v > 0 for v in r[0].values())), 0)
    start = min(max(start, len(rows) // 3), max(0, len(rows) - 2))
    whole = _shares(rows, cap, per_sample, batch, events or [])
    steady = _shares(rows[start:], cap, per_sample, batch, events or [])
    ratio = steady["share_ratio"]
    return {"cap_Bps": cap, "steps": steps, "lost": lost, **whole, "steady": steady,
            "capped_limits": limits,
            "targets": {"forward_share_follows_announced_share": {
                "value": ratio, "target": "0.7..1.3 (steady part)",
                "ok": ratio is not None and 0.7 <= ratio <= 1.3}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=int, default=1_000_000, help="bytes per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="5 s runs, 1 s reference")
    parser.add_argument("--routing", action="store_true",
                        help="train through a capped and an uncapped peer of one stage instead")
    parser.add_argument("--routing-cap", type=int, default=1_000_000)
    parser.add_argument("--average-every", type=int, default=20,
                        help="--routing: trainer steps of samples per averaging round")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=1, help="--routing runs, one line each")
    args = parser.parse_args()
    if args.routing:
        if args.routing_cap < 1 or not 1 <= args.steps <= 2000 or not 1 <= args.repeats <= 20 \
                or args.average_every < 1:
            parser.error("--routing-cap must be >= 1, --steps from 1 to 2000 and --repeats "
                         "from 1 to 20")
        for _ in range(args.repeats):  # one JSON line per run
            print(json.dumps(routing(args.routing_cap, args.steps, args.average_every)),
                  flush=True)
        return
    if args.cap < 1 or args.seconds <= 0 or not 1 <= args.streams <= 16:
        parser.error("--cap must be >= 1, --seconds > 0 and --streams from 1 to 16")
    seconds, reference = (5.0, 1.0) if args.quick else (args.seconds, 3.0)
    print(json.dumps(run(args.cap, seconds, args.streams, reference)))


if __name__ == "__main__":
    main()
