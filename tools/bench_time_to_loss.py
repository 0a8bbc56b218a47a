"""Time to a loss (issue 26): where bandwidth is the limit, the wall-clock time a swarm needs to
reach the single-process reference's final validation loss, per wire codec, in one run.

    sudo .venv/bin/python tools/bench_time_to_loss.py --json                 # int8 vs int2
    sudo .venv/bin/python tools/bench_time_to_loss.py --json --codecs int8,int4,int2 --seed 1
    sudo .venv/bin/python tools/bench_time_to_loss.py --json --preset llama --repeats 1

1. **The reference** (``tools/bench_quality.py``'s plain single-process loop): the preset's
   model, data, seed and cosine schedule over its steps, with ``--microbatches`` a step (16:
   a shorter run than the swarm's default 64, for the same comparison). Its final validation
   loss is the target.
2. **The link.** A short calibration run of the int8 swarm through the unshaped lab (stage 0,
   stage 1 and the trainer on three lab hosts) measures this machine's compute per
   microbatch (its tokens over the pipeline's tokens/s); the lab's ``uplink`` profile (10 ms
   one way, the same rate both ways on every host) is then set so that one int8 hop (a
   microbatch's output forward and its input gradient back) takes ``TARGET_RATIO`` times that
   compute (``tools/bench_wan_bandwidth.py``'s rule: bandwidth, not compute, is the limit), or
   ``--uplink-mbit``.
3. **Each codec** (``wire.codec``, a swarm setting): fresh daemons and trainer through that
   link, the reference's schedule and then on at its last learning rate (``decay_steps`` is
   the reference's steps), evaluated every ``EVAL_EVERY`` steps, until an evaluation is at or
   under the target or ``--max-steps-factor`` x the reference's steps ran.

**Time to the loss**: the trainer's time from its first step to the step of the first
evaluation at or under the target, the evaluations' own time left out (``time_to_loss``: from
the timestamps of ``train-metrics.jsonl``). Reported per codec with its steps, tokens, hop
bytes (``bytes_vs_int8``), tokens/s, restarted and lost, and ``time_vs_int8``. A codec that
never reaches the target within the steps has ``time_to_loss_s`` null and its last
validation loss over the target.

**Seeds** (``--repeats N``, 3 by default: seeds ``--seed`` to ``--seed + N - 1``, each with its
own reference, calibration and runs, in ``by_seed``): the steps to a loss swing from run to
run wherever the curve has a plateau (the demo preset's: either codec's steps to the target
vary by 2x between seeds, and int8 has reached it in two thirds of the reference's steps), so
one seed's ratio is mostly which codec broke through first. ``summary`` gives, per compressed
codec, each seed's ratio and ``time_vs_int8_of_totals``, its times summed over the seeds over
int8's: the figure of issue 26 (<= 0.5), as ``bench_quality``'s ratio of means is for the loss.
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
from typing import Any, Iterable, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: evaluate the swarm's model every this many steps (the resolution of the time to the loss)
EVAL_EVERY = 3
#: the calibration run's steps (the first is left out: connections, warm-up)
CALIBRATION_STEPS = 6
#: issue 26's figure: the compressed setting's time to the loss over int8's
TARGET_TIME_RATIO = 0.5
#: a codec's run is stopped after this long whatever happened
RUN_LIMIT_S = 3600.0
POLL_S = 0.5


def say(text: str) -> None:
    print(f"[bench_time_to_loss] {text}", file=sys.stderr, flush=True)


# ---- pure: what the metrics file says --------------------------------------------------------

def time_to_loss(lines: Iterable[Mapping[str, Any]], target: float) -> dict[str, Any]:
    """From a trainer's ``train-metrics.jsonl`` records (step records hold ``loss``,
    evaluations ``val_loss``; each has ``step`` and a wall-clock ``time``): the training time
    (seconds; each step's time since the record before it, so an evaluation's own time, from
    its step's record to its own, is left out) at the first evaluation after step 0 whose
    loss is at or under ``target``. ``time_to_loss_s`` None: never reached; ``train_s`` and
    ``last_val_loss`` say how far the run got. Records out of order or without a finite time
    are skipped."""
    train_s, prev = 0.0, None
    at_step: dict[int, float] = {}
    reached: dict[str, Any] | None = None
    last: tuple[int, float] | None = None
    for x in lines:
        t, step = x.get("time"), x.get("step")
        if not isinstance(t, (int, float)) or not isinstance(step, int) or t != t:
            continue
        if prev is not None and t < prev:
            continue
        if "loss" in x:
            if prev is not None:
                train_s += t - prev
            at_step[step] = train_s
        elif "val_loss" in x:
            loss = x["val_loss"]
            if not isinstance(loss, (int, float)) or loss != loss:
                prev = t
                continue
            if step > 0:
                last = (step, float(loss))
                if reached is None and loss <= target and step in at_step:
                    reached = {"steps": step, "time_to_loss_s": at_step[step],
                               "val_loss_at": float(loss)}
        else:
            continue
        prev = t
    return {"time_to_loss_s": None, "steps": None, "val_loss_at": None, **(reached or {}),
            "train_s": train_s, "last_step": last[0] if last else None,
            "last_val_loss": last[1] if last else None}


def reached(lines: Iterable[Mapping[str, Any]], target: float) -> bool:
    """Whether an evaluation after step 0 is at or under ``target``."""
    return any("val_loss" in x and isinstance(x.get("step"), int) and x["step"] > 0
               and isinstance(x["val_loss"], (int, float)) and x["val_loss"] <= target
               for x in lines)


def tokens_per_s(lines: Iterable[Mapping[str, Any]], tokens_per_step: int) -> float | None:
    """The pipeline's tokens/s over the step records after the first (its connections and
    warm-up left out); None with fewer than 3 steps."""
    times = [x["time"] for x in lines if "loss" in x and isinstance(x.get("time"), (int, float))]
    if len(times) < 3 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) * tokens_per_step / (times[-1] - times[0])


def summarise(by_seed: list[Mapping[str, Any]], codecs: list[str]) -> dict[str, Any]:
    """Per compressed codec (every codec after int8), over the seeds' results (``measure``):
    ``time_vs_int8_per_seed``, ``seeds_within_target`` and ``time_vs_int8_of_totals``, its
    times to the loss summed over the seeds over int8's (None when a run of either never
    reached the loss)."""
    base = [r["runs"]["int8"]["time_to_loss_s"] for r in by_seed]
    out: dict[str, Any] = {}
    for codec in codecs[1:]:
        times = [r["runs"][codec]["time_to_loss_s"] for r in by_seed]
        ratios = [r["runs"][codec]["time_vs_int8"] for r in by_seed]
        reached_all = None not in times and None not in base and sum(base) > 0
        out[codec] = {
            "time_vs_int8_per_seed": ratios,
            "seeds_within_target": sum(x is not None and x <= TARGET_TIME_RATIO
                                       for x in ratios),
            "time_vs_int8_of_totals": sum(times) / sum(base) if reached_all else None}
    return out


# ---- the runs ---------------------------------------------------------------------------------

def _metrics(home: Path) -> list[dict[str, Any]]:
    path = home / "train-metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def swarm_run(lab: Any, root: Path, env: dict[str, str], *, steps: int,
              target: float | None) -> dict[str, Any]:
    """Stage 0 and 1 and ``swarmd train`` on the lab's hosts, fresh homes under ``root``;
    the trainer is stopped once an evaluation reaches ``target`` (None: runs its steps)."""
    from tools.wanlab import daemons as lab_daemons

    trainer_home = root / "trainer"
    trainer_home.mkdir(parents=True, exist_ok=True)
    started = lab_daemons.start_swarm(lab, root, ("s0", ("--stage", "0")),
                                      [("s1", ("--stage", "1"))], env=env)
    s0 = started[0]
    proc = None
    try:
        with open(trainer_home / "train.stderr", "w") as err:
            proc = lab.run("tr", [sys.executable, "-m", "swarmd", "train", "--home",
                                  str(trainer_home), "--json", "--bootstrap", s0.addr,
                                  "--steps", str(steps), "--listen",
                                  f"/ip4/{lab.addr('tr')}/tcp/0"],
                           stdout=subprocess.DEVNULL, stderr=err, cwd=trainer_home,
                           env={**os.environ, "SWARMD_LOG_LEVEL": "warning", **env})
        deadline = time.monotonic() + RUN_LIMIT_S
        stopped = False
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not finish within {RUN_LIMIT_S:.0f} s")
            if target is not None and reached(_metrics(trainer_home), target):
                proc.send_signal(signal.SIGTERM)  # reached: the rest would not change it
                stopped = True
                break
            time.sleep(POLL_S)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not stopped and proc.returncode != 0:
            raise RuntimeError(f"swarmd train failed ({proc.returncode}):\n"
                               f"{(trainer_home / 'train.stderr').read_text()[-3000:]}")
        counters = [d.get("/api/v0/status")["counters"] for d in started]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        lab_daemons.stop_all(started, seconds=30.0)
    lines = _metrics(trainer_home)
    steps_done = [x for x in lines if "loss" in x]
    return {"lines": lines, "steps_run": len(steps_done),
            "restarted": max((x.get("restarted", 0) for x in steps_done), default=0),
            "lost": max((x.get("lost", 0) for x in steps_done), default=0),
            "stage_optimizer_steps": [int(c.get("stage.optimizer_steps", 0)) for c in counters],
            "stopped_at_target": stopped}


def measure(*, preset_name: str, codecs: list[str], seed: int, microbatches: int,
            uplink_mbit: float, max_steps_factor: float) -> dict[str, Any]:
    from bench_quality import preset, reference
    from bench_wan import PROFILES, link_of
    from bench_wan_bandwidth import TARGET_RATIO, hop_bytes, uplink_rate_for
    from tools.wanlab import HostSpec, WanLab

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-ttl-") as tmp:
        root = Path(tmp)
        p = preset(preset_name, root, None, seed,
                   {"SWARMD_TRAINING_MICROBATCHES": str(microbatches)})
        say(f"reference: {p.name}, {p.steps} steps of {microbatches} microbatches")
        ref = reference(p)
        target = ref["final_val_loss"]
        say(f"reference {ref['initial_val_loss']:.4f} -> {target:.4f} in "
            f"{ref['seconds']:.0f} s: the target")
        tokens_per_mb = ref["tokens_per_microbatch"]
        tokens_per_step = tokens_per_mb * microbatches
        max_steps = max(p.steps, round(max_steps_factor * p.steps))
        run_env = {**p.env, "SWARMD_TRAINING_EVAL_EVERY": str(EVAL_EVERY)}
        int8_bytes = hop_bytes({**run_env, "SWARMD_WIRE_CODEC": "int8"})["hop_bytes"]
        uplink = link_of("uplink")
        calibration: dict[str, Any] = {}
        runs: dict[str, dict[str, Any]] = {}
        with WanLab(hosts=[HostSpec(name=h) for h in ("s0", "s1", "tr")]) as lab:
            if not uplink_mbit:
                say(f"calibration: int8 through the unshaped lab, {CALIBRATION_STEPS} steps")
                cal = swarm_run(lab, root / "calibration",
                                {**run_env, "SWARMD_WIRE_CODEC": "int8",
                                 "SWARMD_TRAINING_EVAL_EVERY": "0"},
                                steps=CALIBRATION_STEPS, target=None)
                rate = tokens_per_s(cal["lines"], tokens_per_step)
                if rate is None:
                    raise RuntimeError("the calibration run made too few steps to measure")
                uplink_mbit = uplink_rate_for(int8_bytes, tokens_per_mb, rate)
                calibration = {"unshaped_tokens_per_s": rate,
                               "compute_s_per_microbatch": tokens_per_mb / rate,
                               "lost": cal["lost"], "restarted": cal["restarted"]}
                say(f"calibration: {rate:,.0f} tokens/s unshaped; the link: "
                    f"{uplink_mbit:.2f} Mbit/s (an int8 hop {TARGET_RATIO}x its compute)")
            for h in lab.hosts:
                lab.set_link(h, rate_down=uplink_mbit, rate_up=uplink_mbit,
                             delay_ms=uplink.delay_ms, loss=0.0)
            for codec in codecs:
                env = {**run_env, "SWARMD_WIRE_CODEC": codec}
                wire = hop_bytes(env)
                say(f"{codec}: through the {uplink_mbit:.2f} Mbit/s link, at most {max_steps} "
                    f"steps, until validation <= {target:.4f}")
                run = swarm_run(lab, root / codec, env, steps=max_steps, target=target)
                ttl = time_to_loss(run["lines"], target)
                compute_s = calibration.get("compute_s_per_microbatch")
                transfer_s = wire["hop_bytes"] * 8 / (uplink_mbit * 1e6)
                runs[codec] = {
                    **ttl, "tokens_to_loss": None if ttl["steps"] is None
                    else ttl["steps"] * tokens_per_step,
                    "hop_bytes": wire["hop_bytes"], "bytes_vs_int8": wire["hop_bytes"]
                    / int8_bytes, "transfer_s": transfer_s,
                    "transfer_over_compute": transfer_s / compute_s if compute_s else None,
                    "tokens_per_s": tokens_per_s(run["lines"], tokens_per_step),
                    "val_curve": [(x["step"], x["val_loss"]) for x in run["lines"]
                                  if "val_loss" in x],
                    **{k: run[k] for k in ("steps_run", "restarted", "lost",
                                           "stage_optimizer_steps", "stopped_at_target")}}
                r = runs[codec]
                say(f"{codec}: " + (f"reached {r['val_loss_at']:.4f} at step {r['steps']} "
                                    f"after {r['time_to_loss_s']:.1f} s of training"
                                    if r["time_to_loss_s"] is not None else
                                    f"not reached in {r['steps_run']} steps (last "
                                    f"{r['last_val_loss']})")
                    + f"; restarted {r['restarted']}, lost {r['lost']}")
    base = runs.get("int8", {}).get("time_to_loss_s")
    for codec, r in runs.items():
        r["time_vs_int8"] = (None if base is None or r["time_to_loss_s"] is None
                             else r["time_to_loss_s"] / base)
    reference_out = {k: ref[k] for k in ("initial_val_loss", "final_val_loss", "val_curve",
                                         "settled_change_last_tenth", "seconds")}
    return {
        "preset": preset_name, "seed": seed, "microbatches": microbatches,
        "reference_steps": p.steps, "max_steps": max_steps, "eval_every": EVAL_EVERY,
        "tokens_per_step": tokens_per_step, "target_val_loss": target,
        "reference": reference_out,
        "uplink": {"mbit": uplink_mbit, "one_way_ms": PROFILES["uplink"][0],
                   "chosen_for_ratio": None if not calibration else TARGET_RATIO},
        "calibration": calibration, "runs": runs,
        "targets": {f"{codec}_time_le_{TARGET_TIME_RATIO}x_int8": r["time_vs_int8"] is not None
                    and r["time_vs_int8"] <= TARGET_TIME_RATIO
                    for codec, r in runs.items() if codec != "int8"},
        "lost": sum(r["lost"] for r in runs.values()),
        "cores": os.cpu_count(), "seconds": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preset", choices=("demo", "llama"), default="demo")
    parser.add_argument("--codecs", default="int8,int2",
                        help="wire.codec values, comma-separated (int8 first: the baseline)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--repeats", type=int, default=3,
                        help="seeds, one after another (the figure: their summed times)")
    parser.add_argument("--microbatches", type=int, default=16,
                        help="microbatches a step, the reference's and the swarm's")
    parser.add_argument("--uplink-mbit", type=float, default=0.0,
                        help="the link's rate, both ways (0: chosen by the calibration run)")
    parser.add_argument("--max-steps-factor", type=float, default=2.0,
                        help="a codec's run stops after this many times the reference's steps")
    args = parser.parse_args(argv)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not codecs or codecs[0] != "int8":
        parser.error("--codecs must start with int8 (the baseline the times are compared with)")
    if (args.microbatches < 1 or args.max_steps_factor < 1 or args.uplink_mbit < 0
            or args.repeats < 1):
        parser.error("--microbatches, --repeats and --max-steps-factor must be >= 1, "
                     "--uplink-mbit >= 0")
    if os.geteuid() != 0:
        parser.error("the WAN lab needs root (network namespaces): run it with sudo")
    t0 = time.monotonic()
    seeds = list(range(args.seed, args.seed + args.repeats))
    by_seed = []
    for seed in seeds:
        say(f"seed {seed}")
        by_seed.append(measure(preset_name=args.preset, codecs=codecs, seed=seed,
                               microbatches=args.microbatches, uplink_mbit=args.uplink_mbit,
                               max_steps_factor=args.max_steps_factor))
    summary = summarise(by_seed, codecs)
    result = {
        "preset": args.preset, "seeds": seeds,
        "codecs": codecs, "summary": summary,
        "targets": {f"{codec}_time_le_{TARGET_TIME_RATIO}x_int8":
                    s["time_vs_int8_of_totals"] is not None
                    and s["time_vs_int8_of_totals"] <= TARGET_TIME_RATIO
                    for codec, s in summary.items()},
        "lost": sum(r["lost"] for r in by_seed), "cores": os.cpu_count(),
        "seconds": time.monotonic() - t0, "by_seed": by_seed}
    for codec, s in summary.items():
        say(f"{codec}: time to the loss / int8's per seed "
            + ", ".join("-" if x is None else f"{x:.3f}" for x in s["time_vs_int8_per_seed"])
            + "; of the summed times "
            + ("-" if s["time_vs_int8_of_totals"] is None
               else f"{s['time_vs_int8_of_totals']:.3f}"))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
