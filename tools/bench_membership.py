"""Membership benchmark: real local daemons, then the same view code at 1,000 and 10,000 peers.

    python tools/bench_membership.py --json

Prints one JSON object:
- ``local.<N>`` for N = 3, 6, 10 real ``swarmd join`` processes on 127.0.0.1 (one bootstrap
  peer, the others join through it): ``converge_s`` (from the last daemon's start line until
  every daemon lists all N), ``bytes_per_s`` (framed membership bytes sent plus received per
  daemon per second over a quiet window after convergence; no training runs, so all stream
  traffic is membership), and ``killed_gone_s`` / ``killed_gone_periods`` for N = 10 (a daemon
  killed with SIGKILL, until no view lists it; in announcement periods of ~2-3 s).
- ``simulated.<N>`` for N = 1,000 and 10,000 from tools/sim_membership.py (virtual time, the
  real View and Schedule code, 20%/h churn): per-peer bytes/s and stage-total error.
- ``targets``: the issue's figures, pass or fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from local_swarm import DaemonProcess, start_swarm, stop_all, wait_until  # noqa: E402

QUIET_WINDOW_S = 10.0


def _view(d: DaemonProcess) -> set[str]:
    info = d.get("/api/v0/swarm")
    return {p["peer_id"] for s in info["stages"] for p in s["peers"]} | {
        p["peer_id"] for p in info["excluded"]}


def _traffic(d: DaemonProcess) -> int:
    c = d.get("/api/v0/status")["counters"]
    return int(c.get("bytes_sent", 0)) + int(c.get("bytes_received", 0))


def local_swarm(n: int, root: Path, kill_one: bool) -> dict[str, Any]:
    daemons: list[DaemonProcess] = []
    try:
        start_swarm(root, [0, *[None] * (n - 1)], into=daemons)
        last_start = time.monotonic()
        everyone = {d.peer_id for d in daemons}
        wait_until(lambda: all(_view(d) == everyone for d in daemons), 120, "convergence",
                   interval=0.05)
        out: dict[str, Any] = {"converge_s": time.monotonic() - last_start}
        before = [_traffic(d) for d in daemons]
        t0 = time.monotonic()
        time.sleep(QUIET_WINDOW_S)  # a measurement window, not a wait for a condition
        after = [_traffic(d) for d in daemons]
        elapsed = time.monotonic() - t0
        rates = [(a - b) / elapsed for a, b in zip(after, before)]
        out["bytes_per_s"] = {"mean": sum(rates) / len(rates), "max": max(rates)}
        if kill_one:
            victim, survivors = daemons[-1], daemons[:-1]
            victim.proc.kill()
            victim.wait(10)
            t0 = time.monotonic()
            wait_until(lambda: all(victim.peer_id not in _view(d) for d in survivors), 120,
                       "the killed daemon leaving every view", interval=0.05)
            out["killed_gone_s"] = time.monotonic() - t0
        return out
    finally:
        stop_all(daemons)


def measure(sizes: tuple[int, ...] = (3, 6, 10), simulate_sizes: tuple[int, ...] = (1000, 10000)
            ) -> dict[str, Any]:
    import sim_membership

    result: dict[str, Any] = {"local": {}, "simulated": {}}
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix=f"swarmd-bench-{n}-") as root:
            result["local"][str(n)] = local_swarm(n, Path(root), kill_one=(n == max(sizes)))
    for n in simulate_sizes:
        sim = sim_membership.simulate(peers=n, stages=8, hours=2.0, churn_per_hour=0.2, seed=1)
        result["simulated"][str(n)] = sim
    big = result["local"][str(max(sizes))]
    big["period_s"] = _small_swarm_period(max(sizes))
    big["killed_gone_periods"] = big.get("killed_gone_s", 0.0) / big["period_s"]
    targets = {
        f"local_{max(sizes)}_agree_within_10s": big["converge_s"] <= 10.0,
        "killed_gone_within_3_periods": big["killed_gone_periods"] <= 3.0,
    }
    for n, sim in result["simulated"].items():
        targets[f"simulated_{n}_le_2KBps"] = _sim_bytes(sim) <= 2000
        targets[f"simulated_{n}_stage_totals_within_10pct"] = _sim_error(sim) <= 0.10
    result["targets"] = targets
    return result


def _small_swarm_period(n: int) -> float:
    """The announcement period the schedule gives a swarm of ``n`` peers."""
    from swarmd.membership import ScheduleConfig, SwarmEstimate, plan

    return plan(SwarmEstimate(peers=n),
                ScheduleConfig()).period_s


def _sim_bytes(sim: dict[str, Any]) -> float:
    t = sim["traffic"]
    return max(t["in_bytes_per_s_max"], t["out_bytes_per_s_max"])


def _sim_error(sim: dict[str, Any]) -> float:
    return float(sim["stage_totals"]["rel_error_max"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="3 daemons, 1,000 simulated peers")
    args = parser.parse_args(argv)
    result = measure((3,), (1000,)) if args.quick else measure()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
