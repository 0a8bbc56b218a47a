"""Two trainers through a local swarm of 2 stage daemons; one trainer SIGKILLed mid-run.

    python tools/bench_trainer_crash.py --json

What the other trainer goes through (docs/pipeline.md, "Several trainers"): its longest gap
between steps against its median one (the wait until the dead trainer leaves its view: its
share of the step never comes), its steps after the kill and how many were exact, lost, and
the stages' steps. The model is ``bench_scale``'s small one; trainer i reads data shard i/2.
Everything started is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_scale import SMALL_ENV  # noqa: E402

#: a run is given up after this long
LIMIT_S = 900.0


def _steps(home: Path) -> list[dict[str, Any]]:
    path = home / "train-metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if '"loss"' in x]


def run(steps: int, kill_at: int, root: Path) -> dict[str, Any]:
    from swarmd.local.swarm import DaemonProcess, stop_all

    env = {**SMALL_ENV, "SWARMD_SWARM_NAME": f"trainer-crash-{os.getpid()}"}
    daemons: list[Any] = []
    procs: list[subprocess.Popen[str]] = []
    try:
        first = DaemonProcess(root / "s0", "--stage", "0", env=env)
        daemons.append(first)
        first.wait_started()
        second = DaemonProcess(root / "s1", "--stage", "1", "--bootstrap", first.addr, env=env)
        daemons.append(second)
        second.wait_started()
        homes = [root / "t0", root / "t1"]
        for i, home in enumerate(homes):
            home.mkdir()
            with open(home / "train.stderr", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "swarmd", "train", "--home", str(home), "--json",
                     "--bootstrap", first.addr, "--steps", str(steps),
                     "--listen", "/ip4/127.0.0.1/tcp/0"],
                    stdout=subprocess.PIPE, stderr=err, text=True, cwd=home,
                    env={**os.environ, "SWARMD_LOG_LEVEL": "warning", **env,
                         "SWARMD_DATA_SHARD": f"{i}/2"}))
        deadline = time.monotonic() + LIMIT_S
        while len(_steps(homes[1])) < kill_at:
            if time.monotonic() > deadline or procs[1].poll() is not None:
                raise RuntimeError(f"trainer 1 did not reach step {kill_at}")
            time.sleep(0.2)  # polling a file another process writes
        killed_at = time.time()  # the metrics file's timestamps are wall clock
        killed_step = len(_steps(homes[1]))
        procs[1].send_signal(signal.SIGKILL)
        out, _ = procs[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
        if procs[0].returncode != 0:
            raise RuntimeError((homes[0] / "train.stderr").read_text()[-3000:])
        result = json.loads(out.strip().splitlines()[-1])
        rows = _steps(homes[0])
        times = [x["time"] for x in rows]
        gaps = [b - a for a, b in zip(times, times[1:])]
        median = sorted(gaps)[len(gaps) // 2]
        after = [x for x in rows if x["time"] > killed_at]
        return {
            "steps": steps, "killed_at_step": killed_step,
            "survivor": {k: result[k] for k in ("steps", "microbatches", "steps_exact", "lost",
                                                "final_val_loss")},
            "max_gap_s": max(gaps), "median_gap_s": median,
            "max_gap_over_median": max(gaps) / max(1e-9, median),
            "steps_after_kill": len(after),
            "exact_after_kill": sum(1 for x in after if x.get("clip_coefficient") is not None),
            "stage_steps": [d.get("/api/v0/stage")["step"] for d in daemons],
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        stop_all(daemons, seconds=30.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=40, help="steps per trainer (default 40)")
    parser.add_argument("--kill-at", type=int, default=10,
                        help="the second trainer's step at which it is killed (default 10)")
    args = parser.parse_args(argv)
    if not 1 <= args.kill_at < args.steps:
        parser.error("--kill-at must be at least 1 and below --steps")
    with tempfile.TemporaryDirectory(prefix="swarmd-trainer-crash-") as tmp:
        result = run(args.steps, args.kill_at, Path(tmp))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
