"""Averaging benchmark: all-reduce of 100 MB of float32 gradients among 2 and 3 local peers,
each in its own process, against the transport's own throughput measured in the same run.

    python tools/bench_averaging.py --json [--codec fp16] [--quick]

Prints one JSON object. For each codec (``--codec``, default fp16, and ``none``) and each
group size n in (2, 3), over ``repeats`` timed rounds after one warm-up, best of the repeats
(the machine is shared: other load moves single figures by 2-3x, and the fastest repeat is
the least disturbed one; the ``*_all`` lists hold every repeat):

- ``seconds``: one all-reduce round, the slowest peer's time from its call to its return
  (every peer is told to start at the same moment)
- ``algbw_MBps`` = S / seconds, S = the vector's float32 bytes (MB = 10**6 bytes)
- ``busbw_MBps`` = algbw x 2(n-1)/n, as NCCL defines bus bandwidth: the float32 bytes each peer
  sends (and receives) per second in a bandwidth-optimal all-reduce
- ``single_stream_MBps``: the transport alone, one stream, one way: S float32 bytes in one
  ``host.request`` with the same codec from one peer process to another (encode, send,
  decode, acknowledge), S / seconds. What the issue names "transport throughput".
- ``concurrent_busbw_MBps``: the transport alone moving the all-reduce's own traffic: the same
  n processes at once, each sending S/n to every other peer and getting S/n back (one stream
  per pair, kept open between runs as the averager keeps its own, same codec, nothing
  aggregated), expressed as bus bandwidth like ``busbw_MBps``. On a machine with fewer cores
  than 2 x n this is the fair reference: in an all-reduce every process encrypts and decrypts
  at once, while in the single stream each side does only one of the two, so a CPU-bound
  transport gives the all-reduce about half the single stream's rate per peer, and less when
  the processes outnumber the cores.
- ``busbw_vs_single_stream`` and ``busbw_vs_concurrent``: the ratios of those best figures;
  ``median_*``: the median of the per-repeat ratios (a repeat runs the three back to back)
- ``cpu_seconds`` and ``concurrent_cpu_seconds``: CPU time of one round, all peer processes
  together (user + system, all threads): what the all-reduce costs beyond moving its bytes
- ``identical``: every peer ended with the same bits; ``rel_err``: against the exact mean

``targets``: ``{"name": {"value", "target", "ok"}}``. Traffic stays on 127.0.0.1; every loop is
bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ELEMENTS = 25_000_000  # 100 MB of float32
QUICK_ELEMENTS = 1_000_000
SINK = "/bench/avg/sink/1"
PAIR = "/bench/avg/pair/1"
PROTOCOL = "/swarmd/bench/1/allreduce"
COMMAND_TIMEOUT_S = 180.0


# ---- one peer process -----------------------------------------------------------------------

def _vector(seed: int, n: int) -> Any:
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (user + system)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _digest(t: Any) -> str:
    """sha256 of a contiguous CPU tensor's bytes (no numpy here)."""
    import ctypes

    n = t.numel() * t.element_size()
    return hashlib.sha256((ctypes.c_char * n).from_address(t.data_ptr())).hexdigest()[:16]


async def _peer(seed: int) -> None:
    import torch
    from bench_transport import _host_options

    from swarmd.averaging.allreduce import Averager
    from transport import identity
    from transport.codecs import CodecSpec
    from transport.frames import Message
    from transport.host import Host

    if os.environ.get("BENCH_AVG_DEBUG"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(message)s")
        logging.getLogger("swarmd.averaging.allreduce").setLevel(logging.DEBUG)
    host = Host(identity.generate(), _host_options(torch_threads=1))
    payloads: dict[int, Any] = {}
    state: dict[str, Any] = {}
    streams: dict[str, Any] = {}  # the pattern's, kept open between runs like the averager's

    def payload(n: int) -> Any:
        if n not in payloads:
            payloads[n] = torch.randn(n)
        return payloads[n]

    async def sink(message: Message, peer: str) -> Message:
        return Message(kind="ack", meta={"n": int(message.tensors[0].numel())})

    async def pair(stream: Any) -> None:  # the owner's side of the traffic pattern
        while (message := await stream.receive(timeout=600)) is not None:
            await stream.send(Message(kind="part", tensors=(payload(message.meta["n"]),)),
                              codec=CodecSpec.parse(message.meta["c"]))

    host.set_request_handler(SINK, sink)
    host.set_handler(PAIR, pair)
    loop = asyncio.get_running_loop()
    async with host, Averager(host, PROTOCOL) as averager:
        print(json.dumps({"peer_id": host.peer_id, "addrs": host.addrs}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            op, out, cpu = cmd["op"], {}, _cpu_seconds()
            if op == "connect":
                for peer, addrs in cmd["peers"].items():
                    if peer != host.peer_id:
                        await host.ensure_connected(peer, addrs, timeout=10)
            elif op == "prepare":  # outside the timing: this peer's vector, the exact mean
                state.clear()
                state["x"] = _vector(seed, cmd["elements"])
                state["ref"] = sum(_vector(s, cmd["elements"]) for s in cmd["seeds"]) / len(
                    cmd["seeds"])
            elif op == "allreduce":
                start = time.perf_counter()
                result = await averager.all_reduce(cmd["round"], cmd["group"], state["x"], 1.0,
                                                   codec=cmd["codec"], deadline_s=120,
                                                   **({"chunk": cmd["chunk"]} if "chunk" in cmd
                                                      else {}))
                out = {"seconds": time.perf_counter() - start, "bytes_sent": result.bytes_sent,
                       "missing": list(result.missing)}
                state["result"] = result.vector
            elif op == "check":  # after every peer finished, so nobody's timing pays for it
                v, ref = state.pop("result"), state["ref"]
                out = {"sha": _digest(v), "rel_err": float((v - ref).norm() / ref.norm())}
            elif op == "send":
                codec = CodecSpec.parse(cmd["codec"])
                x = payload(cmd["elements"])
                start = time.perf_counter()
                await host.request(cmd["to"], SINK, Message(kind="x", tensors=(x,)),
                                   codec=codec, timeout=120)
                out = {"seconds": time.perf_counter() - start}
            elif op == "pattern":
                out = {"seconds": await _pattern(host, cmd, payload, streams)}
            out["cpu"] = _cpu_seconds() - cpu
            print(json.dumps(out), flush=True)


async def _pattern(host: Any, cmd: dict[str, Any], payload: Any,
                   streams: dict[str, Any]) -> float:
    """Send S/n to every other peer and take S/n back, all at once; seconds until done. One
    stream per peer, reused from run to run (the averager reuses its streams too)."""
    from transport.codecs import CodecSpec
    from transport.frames import Message

    codec = CodecSpec.parse(cmd["codec"])
    others = [p for p in cmd["group"] if p != host.peer_id]
    n = cmd["elements"] // len(cmd["group"])

    async def one(peer: str) -> None:
        if peer not in streams:
            streams[peer] = await host.open_stream(peer, PAIR)
        await streams[peer].send(Message(kind="slice", meta={"n": n, "c": codec.name},
                                         tensors=(payload(n),)), codec=codec)
        await streams[peer].receive(timeout=120)

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(one(p) for p in others)), 120)
    return time.perf_counter() - start


# ---- the orchestrator -----------------------------------------------------------------------

class Peers:
    """n peer processes driven by JSON lines on stdin; each answers one line per command."""

    def __init__(self, n: int, logdir: Path) -> None:
        from swarmd.local.swarm import readline

        self._readline = readline
        self.procs, self.info = [], []
        for i in range(n):
            log = open(logdir / f"peer{i}.log", "w")
            proc = subprocess.Popen([sys.executable, __file__, "--peer", str(i)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                    text=True)
            self.procs.append(proc)
        for i, proc in enumerate(self.procs):
            line = readline(proc, 60)
            if not line:
                raise RuntimeError(f"peer {i} did not start: see {logdir}/peer{i}.log")
            self.info.append(json.loads(line))
        self.ids = [p["peer_id"] for p in self.info]
        self.ask_all([{"op": "connect", "peers": {p["peer_id"]: p["addrs"]
                                                  for p in self.info}}] * n)

    def ask_all(self, cmds: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
        """Send each peer its command (None: none) at once, then collect the answers."""
        for proc, cmd in zip(self.procs, cmds):
            if cmd is not None:
                proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
        out: list[dict[str, Any] | None] = []
        for i, (proc, cmd) in enumerate(zip(self.procs, cmds)):
            if cmd is None:
                out.append(None)
                continue
            line = self._readline(proc, COMMAND_TIMEOUT_S)
            if not line:
                raise RuntimeError(f"peer {i} failed on {cmd['op']} (exit {proc.poll()})")
            out.append(json.loads(line))
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def measure_group(n: int, codecs: list[str], elements: int, repeats: int,
                  logdir: Path, **extra: Any) -> dict[str, dict[str, Any]]:
    """Per codec: a warm-up, then ``repeats`` times an all-reduce round, a single-stream
    transfer and the concurrent traffic pattern, interleaved so that the three see about the
    same load from whatever else runs on the machine; ratios are taken per repeat, then the
    median."""
    peers = Peers(n, logdir)
    nbytes, bus = elements * 4, 2 * (n - 1) / n
    try:
        out = {}
        for codec in codecs:
            peers.ask_all([{"op": "prepare", "elements": elements, "seeds": list(range(n))}] * n)
            rounds, single, pattern, cpu, cpu_pattern, shas, errs = [], [], [], [], [], set(), []
            for r in range(repeats + 1):  # the first is a warm-up
                replies = peers.ask_all([{"op": "allreduce", "round": f"{codec}-{r}",
                                          "group": peers.ids, "codec": codec, **extra}] * n)
                checks = peers.ask_all([{"op": "check"}] * n)
                shas.add(tuple(x["sha"] for x in checks))  # type: ignore[index]
                errs.append(max(x["rel_err"] for x in checks))  # type: ignore[index]
                one = peers.ask_all([{"op": "send", "to": peers.ids[1], "codec": codec,
                                      "elements": elements}] + [None] * (n - 1))[0]
                many = peers.ask_all([{"op": "pattern", "group": peers.ids, "codec": codec,
                                       "elements": elements}] * n)
                if r:
                    rounds.append(max(x["seconds"] for x in replies))  # type: ignore[index]
                    cpu.append(sum(x["cpu"] for x in replies))  # type: ignore[index]
                    single.append(one["seconds"])  # type: ignore[index]
                    pattern.append(max(x["seconds"] for x in many))  # type: ignore[index]
                    cpu_pattern.append(sum(x["cpu"] for x in many))  # type: ignore[index]
            med = statistics.median
            t, t1, tp = min(rounds), min(single), min(pattern)
            out[codec] = {
                "seconds": round(t, 4), "seconds_all": [round(x, 4) for x in rounds],
                "algbw_MBps": round(nbytes / t / 1e6, 1),
                "busbw_MBps": round(nbytes / t / 1e6 * bus, 1),
                "single_stream_MBps": round(nbytes / t1 / 1e6, 1),
                "single_stream_seconds_all": [round(x, 4) for x in single],
                "concurrent_busbw_MBps": round(nbytes / tp / 1e6 * bus, 1),
                "concurrent_seconds_all": [round(x, 4) for x in pattern],
                # busbw / single = (S x bus / t) / (S / t1)
                "busbw_vs_single_stream": round(t1 * bus / t, 3),
                "busbw_vs_concurrent": round(tp / t, 3),
                "median_busbw_vs_single_stream": round(med(a * bus / b for a, b in
                                                           zip(single, rounds)), 3),
                "median_busbw_vs_concurrent": round(med(a / b for a, b in
                                                        zip(pattern, rounds)), 3),
                "cpu_seconds": round(min(cpu), 3),
                "concurrent_cpu_seconds": round(min(cpu_pattern), 3),
                "identical": all(len(set(s)) == 1 for s in shas),
                "rel_err": max(errs),
            }
        return out
    finally:
        peers.close()


def measure(codec: str = "fp16", quick: bool = False) -> dict[str, Any]:
    elements = QUICK_ELEMENTS if quick else ELEMENTS
    repeats = 1 if quick else 7
    codecs = [codec] + [c for c in ("none",) if c != codec]
    result: dict[str, Any] = {"elements": elements, "bytes": elements * 4, "repeats": repeats,
                              "cpu_count": os.cpu_count(), "codecs": {c: {} for c in codecs}}
    with tempfile.TemporaryDirectory(prefix="bench-avg-") as tmp:
        for n in (2, 3):
            for c, res in measure_group(n, codecs, elements, repeats, Path(tmp)).items():
                result["codecs"][c][str(n)] = res
    targets: dict[str, dict[str, Any]] = {}

    def target(name: str, value: Any, goal: str, ok: bool) -> None:
        targets[name] = {"value": value, "target": goal, "ok": bool(ok)}

    tol = {"none": 1e-6, "fp16": 1e-3, "int8": 2e-2}
    for c in codecs:
        for n, res in result["codecs"][c].items():
            target(f"{c}_n{n}_busbw_vs_single_stream", res["busbw_vs_single_stream"], ">= 0.7",
                   res["busbw_vs_single_stream"] >= 0.7)
            target(f"{c}_n{n}_busbw_vs_concurrent", res["busbw_vs_concurrent"], ">= 0.7",
                   res["busbw_vs_concurrent"] >= 0.7)
            target(f"{c}_n{n}_identical_on_every_peer", res["identical"], "true",
                   res["identical"])
            target(f"{c}_n{n}_rel_err", res["rel_err"], f"<= {tol.get(c.split('+')[0], 2e-2)}",
                   res["rel_err"] <= tol.get(c.split("+")[0], 2e-2))
    result["targets"] = targets
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="4 MB, one repeat (a smoke test)")
    parser.add_argument("--codec", default="fp16", help="codec of the all-reduce (default fp16;"
                        " none is measured too)")
    parser.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer is not None:
        import uvloop

        uvloop.run(_peer(args.peer))
        return 0
    result = measure(codec=args.codec, quick=args.quick)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
