"""Training quality of the pipelined schedule against the synchronous one, at equal tokens.

    python tools/bench_schedules.py --json                 # sync, then pipelined at 16 and 32
    python tools/bench_schedules.py --json --in-flight 8,24 --steps 200
    python tools/bench_schedules.py --json --in-flight 8,16 --repeats 3   # means of 3 each
    python tools/bench_schedules.py --json --step-drains first --microbatches 64 --in-flight 32

Each run starts a fresh local swarm (2 stages, one ``swarmd join`` per stage on 127.0.0.1,
the demo model, int8 on the wire, as ``tools/bench_pipeline.py``), trains ``--steps`` steps of
``training.microbatches`` microbatches with ``swarmd.trainer.run.train()`` (within a repeat
the same seed: the same batches in the same order, the same initial weights) and reports the validation loss on
the same fixed held-out batches before and after. The synchronous schedule (``sync``: a step's
microbatches, then the step) is the reference; each pipelined run pins the number in flight
(``fixed_in_flight``) to the figure given, so its staleness is what a WAN run that keeps that
many in flight has (at most about in_flight / microbatches steps, whatever this machine's
latency; ``mean_lateness_steps`` is what each stage measured: steps from a forward to its
backward there, which depends on where the rest waits, so on the machine's load).

Target (issue 11): ``final_val_loss`` of every pipelined run within 3% of the synchronous
run's (``val_loss_ratio_vs_sync`` <= 1.03). Throughput here is not the point (loopback, shared
cores); it is reported for information. Every daemon is stopped in a ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_pipeline import add_schedule_options, schedule_overrides  # noqa: E402

TARGET = 1.03


def say(text: str) -> None:
    print(f"[bench_schedules] {text}", file=sys.stderr, flush=True)


def one_run(env: dict[str, str], steps: int, schedule: str,
            in_flight: int | None) -> dict[str, Any]:
    from swarmd.models.registry import model_config_of

    import uvloop

    from swarmd.config import load_config
    from swarmd.local.swarm import DaemonProcess, stop_all
    from swarmd.trainer.run import train

    config = load_config(None, {**os.environ, **env})
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-schedules-") as root:
        daemons: list[DaemonProcess] = []
        try:
            first = DaemonProcess(Path(root) / "stage0", "--stage", "0", env=env)
            daemons.append(first)
            first.wait_started()
            second = DaemonProcess(Path(root) / "stage1", "--stage", "1", "--bootstrap",
                                   first.addr, env=env)
            daemons.append(second)
            second.wait_started()
            home = Path(root) / "trainer"
            home.mkdir()
            result = uvloop.run(train(config, bootstrap=[first.addr], steps=steps, home=home,
                                      bar=False, schedule=schedule, fixed_in_flight=in_flight,
                                      progress=lambda s: say(f"{schedule} {in_flight}: {s}")))
            lines = [json.loads(x) for x in (home / "train-metrics.jsonl").read_text()
                     .splitlines() if x.strip()]
            lines = [x for x in lines if "loss" in x]  # steps (evaluations: "val_loss")
            counters = {name: d.get("/api/v0/status")["counters"]
                        for name, d in (("stage0", first), ("stage1", second))}
            stale = {name: int(c.get("stage.dropped_stale", 0)) for name, c in counters.items()}
            stage_steps = {name: int(c.get("stage.optimizer_steps", 0))
                           for name, c in counters.items()}
            # mean steps from a forward to its backward on each stage (Stepper's counters)
            late = {name: int(c.get("stage.late_samples", 0)) / max(1, int(c.get(
                "stage.stepped_samples", 0))) for name, c in counters.items()}
        finally:
            stop_all(daemons)
    tail = lines[len(lines) // 2:]
    return {"schedule": schedule, "in_flight": in_flight, "steps": result.steps,
            "tokens": result.steps * config.training.microbatches * config.training.batch_size
            * model_config_of(config).seq_len,
            "initial_val_loss": result.initial_val_loss, "final_val_loss": result.final_val_loss,
            "train_loss_last_half": sum(x["loss"] for x in tail) / max(1, len(tail)),
            "tokens_per_s": result.tokens_per_s, "restarted": result.restarted,
            "lost": result.lost, "dropped_stale": stale, "mean_lateness_steps": late,
            "stage_optimizer_steps": stage_steps,
            "seconds": result.seconds}


def measure(steps: int, in_flights: list[int], repeats: int = 1,
            seed: int = 0, overrides: dict[str, str] | None = None) -> dict[str, Any]:
    """Each schedule ``repeats`` times, interleaved (sync, pipelined..., sync, ...), repeat
    ``r`` with ``training.seed`` = ``seed + r``: the final loss depends on the data order by
    several percent (and the synchronous run varies by a little between invocations:
    gradients are summed in arrival order), so the target is on the ratio of the means over
    the repeats; ``paired_ratios`` are each run's against the sync run of its seed.
    ``overrides``: configuration for the daemons and the trainers (``SWARMD_*``), both
    schedules alike."""
    from bench_pipeline import bench_env

    from swarmd.config import load_config

    t0 = time.monotonic()
    env = {**bench_env("demo"), **(overrides or {})}
    config = load_config(None, {**os.environ, **env})
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        # each repeat its own data order and initial weights, the same for every schedule in
        # it: a pair differs only by its schedule, and the means are over several orders
        env = {**env, "SWARMD_TRAINING_SEED": str(seed + rep)}
        runs.append(one_run(env, steps, "sync", None))
        runs[-1]["seed"] = seed + rep
        say(f"sync #{rep + 1}: final validation loss {runs[-1]['final_val_loss']:.4f}")
        for n in in_flights:
            runs.append(one_run(env, steps, "pipelined", n))
            runs[-1]["seed"] = seed + rep
            say(f"pipelined, {n} in flight #{rep + 1}: final validation loss "
                f"{runs[-1]['final_val_loss']:.4f}, steps late {runs[-1]['mean_lateness_steps']}")
    by: dict[int | None, list[float]] = {}
    for r in runs:
        by.setdefault(r["in_flight"], []).append(r["final_val_loss"])
    ref = sum(by[None]) / len(by[None])
    sync_of = {r["seed"]: r["final_val_loss"] for r in runs if r["in_flight"] is None}
    for r in runs:
        r["val_loss_ratio_vs_sync"] = r["final_val_loss"] / ref
        r["val_loss_ratio_vs_its_sync"] = r["final_val_loss"] / sync_of[r["seed"]]
    summary = {("sync" if n is None else f"in_flight_{n}"): {
        "mean_final_val_loss": sum(v) / len(v), "min": min(v), "max": max(v),
        "ratio_vs_sync": sum(v) / len(v) / ref,
        "paired_ratios": [r["val_loss_ratio_vs_its_sync"] for r in runs
                          if r["in_flight"] == n]} for n, v in by.items()}
    return {"runs": runs, "summary": summary, "repeats": repeats, "seed": seed,
            "config": {"step_drains": config.serving.step_drains,
                       "microbatches": config.training.microbatches}, "targets": {
        f"val_loss_within_3pct_in_flight_{n}": summary[f"in_flight_{n}"]["ratio_vs_sync"]
        <= TARGET for n in in_flights}, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=150, help="steps per run (default 150)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each schedule, interleaved; ratios are of the means")
    parser.add_argument("--seed", type=int, default=0,
                        help="training.seed of the first repeat (the next ones count up)")
    parser.add_argument("--in-flight", default="16,32",
                        help="comma-separated numbers in flight for the pipelined runs")
    add_schedule_options(parser)
    args = parser.parse_args(argv)
    in_flights = [int(v) for v in args.in_flight.split(",") if v]
    if args.steps < 2 or args.repeats < 1 or any(n < 1 for n in in_flights):
        parser.error("--steps must be at least 2, --repeats and every --in-flight at least 1")
    result = measure(args.steps, in_flights, args.repeats, args.seed,
                     overrides=schedule_overrides(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
