"""One averaging or state-transfer peer inside a WAN lab host (tools/wanlab), for the lab tests
(tests/test_wan_*.py) and tools/bench_wan.py. Each runs swarmd's own Averager or state
transfer over swarmd's transport, with deadlines derived from the link (swarmd.links).

    python -m tools.wan_peer allreduce --listen /ip4/198.18.1.2/tcp/0 --mb 100 --rounds 1
    python -m tools.wan_peer state-serve --listen /ip4/198.18.1.2/tcp/0 --mb 200
    python -m tools.wan_peer state-fetch --listen /ip4/198.18.2.2/tcp/0

Every command prints ``{"peer_id", "addrs"}`` once listening, then reads one JSON line from
stdin: ``{"peers": {peer_id: [addrs]}}`` (allreduce: the whole group, itself included;
state-fetch: the sources). Results are printed as JSON lines: ``{"round": i, "ok", "seconds",
"deadline_s", "bytes_sent", "bytes_received", "digest", "error"}`` per round, or
``{"fetched": ...}``; the last line is ``{"links": <LinkEstimates.status()>}``. The process
then serves (others may still need its answers) until stdin closes or ``--linger`` passes.
Everything is bounded: ``--deadline`` ends the process whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import queue
import sys
import threading
import time
from typing import Any

MiB = 1 << 20
PROTO_STATE = "/swarmd-lab/state/1"
PROTO_AVG = "/swarmd-lab/allreduce/1"
HASH = "lab-model"


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _options(listen: str) -> Any:
    import torch

    from transport.host import HostOptions
    from transport.limits import Limits

    torch.set_num_threads(1)
    return HostOptions(listen=(listen,), limits=Limits(max_message_bytes=64 * MiB,
                                                       max_tensor_bytes=64 * MiB), pubsub=None)


async def _read_line(timeout: float) -> dict[str, Any]:
    line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
        None, sys.stdin.readline), timeout)
    if not line:
        raise SystemExit("stdin closed before the peers were given")
    return json.loads(line)


async def _linger(seconds: float) -> None:
    try:
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
            None, sys.stdin.read), seconds)
    except asyncio.TimeoutError:
        pass


async def allreduce(args: argparse.Namespace) -> None:
    import torch

    from swarmd.averaging.allreduce import AllReduceFailed, Averager
    from swarmd.links import links_for
    from transport import identity
    from transport.host import Host

    async with Host(identity.generate(), _options(args.listen)) as host:
        addrs: dict[str, list[str]] = {}
        async with Averager(host, PROTO_AVG, addrs_of=lambda p: addrs.get(p, ())) as averager:
            say({"peer_id": host.peer_id, "addrs": list(host.addrs)})
            addrs.update((await _read_line(120))["peers"])
            group = sorted(addrs)
            rank = group.index(host.peer_id)
            gen = torch.Generator().manual_seed(rank)
            vector = torch.randn(int(args.mb * 1e6) // 4, generator=gen)
            for i in range(args.rounds):
                await _one_round(averager, f"r{i}", group, vector, args, i)
                # peers finish a round at slightly different times: start the next together
                if i + 1 < args.rounds:
                    await asyncio.sleep(args.gap)
            say({"links": links_for(host).status(round_cap_s=args.cap)})
            await _linger(args.linger)


async def _one_round(averager: Any, round_id: str, group: list[str], vector: Any,
                     args: argparse.Namespace, i: int) -> None:
    from swarmd.averaging.allreduce import AllReduceFailed, bytes_per_value
    from swarmd.averaging.plan import RoundPlan
    from transport.codecs import CodecSpec

    plan = RoundPlan.build(round_id, group, vector.numel())
    transfers = plan.transfers(plan.index(averager.host.peer_id),
                               bytes_per_value(CodecSpec.parse(args.codec)))
    deadline = averager.round_deadline(transfers, cap_s=args.cap)
    t0 = time.monotonic()
    try:
        result = await averager.all_reduce(round_id, group, vector, 1.0, codec=args.codec,
                                           aggregator="mean", deadline_s=deadline)
    except AllReduceFailed as exc:
        say({"round": i, "ok": False, "seconds": time.monotonic() - t0, "deadline_s": deadline,
             "error": str(exc)})
        return
    digest = hashlib.sha256(result.vector.numpy().tobytes()).hexdigest()[:16]
    say({"round": i, "ok": True, "seconds": result.seconds, "deadline_s": deadline,
         "bytes_sent": result.bytes_sent, "bytes_received": result.bytes_received,
         "missing": list(result.missing), "digest": digest, "error": None})


async def state_serve(args: argparse.Namespace) -> None:
    import torch

    from swarmd.state.encoding import StageState
    from swarmd.state.serve import StateServer
    from transport import identity
    from transport.host import Host

    params = {"w": torch.randn(int(args.mb * 1e6) // 4, generator=torch.Generator().manual_seed(1))}
    state = StageState(stage=1, step=5, model_hash=HASH, params=params, optimizer={})

    async def snapshot() -> StageState:
        return state

    async with Host(identity.generate(), _options(args.listen)) as host:
        server = StateServer(host, PROTO_STATE, snapshot, stage=1, model_hash=HASH,
                             keep_s=600.0)
        server.start()
        say({"peer_id": host.peer_id, "addrs": list(host.addrs)})
        await _linger(args.linger)


async def state_fetch(args: argparse.Namespace) -> None:
    from swarmd.links import links_for
    from swarmd.state.fetch import fetch_state
    from swarmd.state.transfer import StateTransferFailed
    from transport import identity
    from transport.host import Host

    async with Host(identity.generate(), _options(args.listen)) as host:
        say({"peer_id": host.peer_id, "addrs": list(host.addrs)})
        sources = list((await _read_line(120))["peers"].items())
        counters: dict[str, int] = {}
        t0 = time.monotonic()
        try:
            state = await fetch_state(host, PROTO_STATE, sources, stage=1, model_hash=HASH,
                                      timeout_s=args.cap, max_bytes=1 << 31,
                                      counters=counters)
            nbytes = sum(t.numel() * t.element_size() for t in state.params.values())
            say({"fetched": True, "seconds": time.monotonic() - t0, "param_bytes": nbytes,
                 "counters": counters, "error": None})
        except StateTransferFailed as exc:
            say({"fetched": False, "seconds": time.monotonic() - t0, "counters": counters,
                 "error": str(exc)})
        say({"links": links_for(host).status()})


class LabPeer:
    """The driving side: ``LabPeer(lab, "s0", "allreduce", "--mb", "100")`` starts this module
    in lab host ``s0``; ``hello`` is its first line; ``give(peers)`` sends the peers line;
    ``line(seconds)`` reads the next JSON line (bounded); ``close()`` ends it."""

    def __init__(self, lab: Any, host: str, cmd: str, *args: str, stderr: Any = None) -> None:
        import os
        import subprocess
        from pathlib import Path

        root = Path(__file__).resolve().parents[1]
        self.host = host
        self.proc = lab.run(host, [sys.executable, "-m", "tools.wan_peer", cmd, "--listen",
                                   f"/ip4/{lab.addr(host)}/tcp/0", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=stderr, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
        self.hello: dict[str, Any] = {}
        # a thread reads whole lines: select() on a buffered pipe misses lines already read
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            self._lines.put(text)
        self._lines.put("")

    def line(self, seconds: float) -> dict[str, Any]:
        try:
            text = self._lines.get(timeout=seconds)
        except queue.Empty:
            raise TimeoutError(f"no line from wan_peer in {self.host} within {seconds} s")
        if not text:
            self._lines.put("")
            raise RuntimeError(f"wan_peer in {self.host} exited with {self.proc.poll()}")
        return json.loads(text)

    def started(self, seconds: float = 60.0) -> dict[str, Any]:
        self.hello = self.line(seconds)
        return self.hello

    def give(self, peers: dict[str, list[str]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"peers": peers}) + "\n")
        self.proc.stdin.flush()

    def close(self, seconds: float = 10.0) -> None:
        import subprocess

        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_group(lab: Any, hosts: list[str], cmd: str, *args: str,
                stderr: Any = None) -> list[LabPeer]:
    """One peer per host, started and told the whole group."""
    peers = [LabPeer(lab, h, cmd, *args, stderr=stderr) for h in hosts]
    group = {p.started()["peer_id"]: p.hello["addrs"] for p in peers}
    for p in peers:
        p.give(group)
    return peers


def main(argv: list[str] | None = None) -> int:
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m tools.wan_peer")
    parser.add_argument("cmd", choices=["allreduce", "state-serve", "state-fetch"])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--mb", type=float, default=10.0, help="MB (10**6 bytes) of float32")
    parser.add_argument("--codec", default="none")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument("--cap", type=float, default=600.0, help="deadline cap, seconds")
    parser.add_argument("--linger", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=900.0)
    args = parser.parse_args(argv)
    import libp2p  # noqa: F401  (it resets logging when first imported)
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.cmd} %(name)s %(levelname)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.WARNING)
    run = {"allreduce": allreduce, "state-serve": state_serve, "state-fetch": state_fetch}
    uvloop.run(asyncio.wait_for(run[args.cmd](args), args.deadline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
