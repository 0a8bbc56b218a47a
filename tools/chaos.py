"""Chaos in the WAN lab (issue 14): a swarm of 2 stages x 3 peers and 2 trainers on
``continent`` links, hit by one fault every 20-40 s (seeded), against a calm run of the same
length and seed.

    sudo .venv/bin/python tools/chaos.py --minutes 10 [--seed S] [--json] [--calm-only|--no-calm]

Faults (tools/chaoslab/plan.py): SIGKILL a stage peer and restart it on its home; SIGSTOP a
peer for 30 s, then SIGCONT; partition one host for 20 s, then heal; 3% packet loss on one
host's link for 60 s; a hostile peer for 30 s sending one of the protocol fuzzer's cases
(tests/fuzz_cases.py) to a stage peer. Faults come while the trainers train, for ``--minutes``
after both trainers finished their first step; never the last free peer of a stage at once.

By default the trainers fill the window: in the chaos run each may train up to
``STEPS_CAP_PER_MINUTE`` x minutes steps (more than these links carry in that time, so they
cannot finish early) and is told to end when the window ends (a stop file,
tools/chaoslab/train_until.py: it ends after its current step, with its final validation);
the calm run then trains the steps the chaos run's trainers did (their mean, ``steps``), so
the final validation losses compare at the same number of steps. With ``--steps`` both runs
train that many steps instead; trainers that finish before the window ends end it then (no
fault is started after that; ``window_s`` says how long it lasted, ``window_filled`` whether
it lasted the whole ``--minutes``).

The report (one JSON object): per run the faults applied (time, kind, target), per trainer
steps/lost/restarted/rerouted and its loss per step, daemon crashes (an exit we did not
cause), hangs (a trainer past its deadline, a daemon that did not stop on SIGTERM), each
stage's ``step`` and ``params_digest`` per peer once the trainers stopped and whether they
agree; then the final validation loss ratio chaos/calm, the issue's verdicts
(on the chaos run) and whether the calm run's stage peers agreed too.

Everything runs inside the lab's namespaces (198.18.0.0/15) and is torn down on exit, on
Ctrl-C and on errors (the lab's context manager); every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tools.bench_wan import link_of  # noqa: E402
from tools.chaoslab import plan  # noqa: E402
from tools.chaoslab.faults import Injector  # noqa: E402
from tools.chaoslab.swarm import (HOSTILE_HOST, STAGE_HOSTS, STOP_S,  # noqa: E402
                                  TRAINER_HOSTS, LabSwarm, read_metrics)
from tools.wanlab import HostSpec, LabUnavailable, WanLab, daemons  # noqa: E402

PROFILE = "continent"
#: the calm run's steps a minute when it runs alone (``--calm-only`` without ``--steps``)
STEPS_PER_MINUTE = 120
#: the most steps a minute a trainer filling the window may take: a cap it never reaches
#: (1,200 steps took 440 s here on a quiet machine: 160 a minute)
STEPS_CAP_PER_MINUTE = 2000
#: the trainers' first step (start-up, first evaluation) must come within this
WARMUP_S = 300.0
TICK_S = 0.25
#: restarted peers must be up again within this once the trainers are done
RESTART_S = 180.0


def say(line: str) -> None:
    print(f"[chaos] {line}", file=sys.stderr, flush=True)


def lab_env(swarm_name: str) -> dict[str, str]:
    from swarmd.local.demo import DEMO_ENV

    # the demo model, smaller: 8 processes share the machine's cores
    return {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
            "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_STAGES": "2",
            "SWARMD_WIRE_CODEC": "int8", "SWARMD_BALANCING_ENABLED": "false",
            "SWARMD_SWARM_NAME": swarm_name}


class Trainers:
    """The ``swarmd train`` processes of one run, each in a thread of its own
    (tools/wanlab/daemons.py ``train``: its deadline is ``seconds``)."""

    def __init__(self, lab: Any, root: Path, bootstrap: str, steps: int, env: dict[str, str],
                 deadline_s: float, *, until_stopped: bool = False) -> None:
        self.homes = {h: root / f"trainer-{h}" for h in TRAINER_HOSTS}
        self.deadline_s = deadline_s
        #: with ``until_stopped``, each trainer also ends once its stop file exists (``stop``)
        self.stop_files = {h: root / f"stop-{h}" for h in TRAINER_HOSTS} if until_stopped \
            else {}
        self.results: dict[str, dict[str, Any]] = {}
        self.threads = [threading.Thread(target=self._one, daemon=True, name=f"train-{h}",
                                         args=(lab, h, bootstrap, steps, env, deadline_s))
                        for h in TRAINER_HOSTS]

    def _one(self, lab: Any, host: str, bootstrap: str, steps: int, env: dict[str, str],
             deadline_s: float) -> None:
        try:
            stop = self.stop_files.get(host)
            self.results[host] = daemons.train(lab, host, self.homes[host], bootstrap, steps, 1,
                                               env, seconds=deadline_s) if stop is None else \
                train_until(lab, host, self.homes[host], bootstrap, steps, env, deadline_s, stop)
        except Exception as exc:
            self.results[host] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """Tell every trainer to end after its current step (``until_stopped`` only)."""
        for path in self.stop_files.values():
            path.touch()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def first_step_done(self) -> bool:
        return all(read_metrics(home) for home in self.homes.values())

    def join(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def report(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows, hangs = [], []
        for host, home in self.homes.items():
            r = self.results.get(host, {"error": "the trainer thread did not end"})
            curve = [m.get("loss") for m in read_metrics(home)]
            err = r.get("error", "")
            if "did not finish within" in err or "did not end" in err:
                hangs.append({"trainer": host, "error": err[-500:]})
            rows.append({"host": host, **{k: r.get(k) for k in (
                "steps", "lost", "restarted", "rerouted", "initial_val_loss", "final_val_loss",
                "seconds", "tokens_per_s")}, "error": err or None, "loss_curve": curve})
        return rows, hangs


def train_until(lab: Any, host: str, home: Path, bootstrap: str, steps: int,
                env: dict[str, str], seconds: float, stop: Path) -> dict[str, Any]:
    """``swarmd train --json`` in ``host`` (at most ``steps`` steps) that also ends once
    ``stop`` exists (tools/chaoslab/train_until.py), within ``seconds``; its JSON result."""
    return daemons.train(lab, host, home, bootstrap, steps, 1, env, seconds,
                         program=(str(HERE / "chaoslab" / "train_until.py"), str(stop)))


def run_phase(name: str, *, minutes: float, seed: int, steps: int, chaos: bool,
              tmp: Path, fill: bool = False) -> dict[str, Any]:
    """One run (a lab of its own): the swarm, the trainers, the faults when ``chaos``. With
    ``fill``, ``steps`` is a cap and the trainers are stopped when the window ends."""
    from swarmd.models.registry import model_hash_of
    t0 = time.monotonic()
    swarm_name = f"chaos-{name}-{secrets.token_hex(4)}"
    env = lab_env(swarm_name)
    from swarmd.config import load_config

    model_hash = model_hash_of(load_config(None, {**os.environ, **env}))
    link = link_of(PROFILE)
    hosts = [HostSpec(name=h, link=link) for h in STAGE_HOSTS + TRAINER_HOSTS
             + (HOSTILE_HOST,)]
    window_s = minutes * 60.0
    faults = plan.schedule(random.Random(seed), window_s, STAGE_HOSTS, TRAINER_HOSTS) \
        if chaos else []
    root = tmp / name
    out: dict[str, Any] = {"profile": PROFILE, "link_per_host": {
        "delay_ms": link.delay_ms, "down_mbit": link.down_mbit, "up_mbit": link.up_mbit},
        "steps_per_trainer": None if fill else steps, "steps_cap": steps if fill else None,
        "planned_faults": len(faults)}
    with WanLab(hosts=hosts, seed=seed) as lab:
        swarm = LabSwarm(lab, root, env)
        injector = Injector(lab, swarm, faults, swarm_name=swarm_name, model_hash=model_hash)
        trainers: Trainers | None = None
        try:
            say(f"{name}: starting {len(STAGE_HOSTS)} stage peers")
            swarm.start()
            out["swarm_start_s"] = round(time.monotonic() - t0, 1)
            deadline_s = WARMUP_S + 3 * window_s + 120
            trainers = Trainers(lab, root, swarm.daemons[STAGE_HOSTS[0]].addr, steps, env,
                                deadline_s, until_stopped=fill)
            trainers.start()
            _window(name, trainers, injector, swarm, window_s, len(faults), out)
            say(f"{name}: trainers done; waiting for each stage's peers to agree")
            out.update(swarm.agreement())
        finally:
            injector.undo_all()
            stop_failures = swarm.stop()
            if trainers is not None:
                trainers.join(30)
    rows, hangs = trainers.report() if trainers else ([], [])
    out.update({
        "faults": injector.applied, "skipped_faults": injector.skipped,
        "fault_kinds": sorted({f["kind"] for f in injector.applied if "kind" in f}),
        "trainers": rows,
        "crashes": swarm.crashes + [c for c in stop_failures if c["returncode"] != -9],
        "restart_errors": swarm.restart_errors,
        "hangs": hangs + [{"daemon": c["host"], "error": f"did not stop within {STOP_S:.0f} s of SIGTERM"}
                          for c in stop_failures if c["returncode"] == -9],
        "seconds": round(time.monotonic() - t0, 1)})
    return out


def _window(name: str, trainers: Trainers, injector: Injector, swarm: LabSwarm,
            window_s: float, planned: int, out: dict[str, Any]) -> None:
    """From the trainers' first step: faults for ``window_s`` (the ones under way then run to
    their end), then the trainers' end and the restarted peers' start, each with a deadline."""
    warm_until = time.monotonic() + WARMUP_S
    while trainers.alive() and not trainers.first_step_done() \
            and time.monotonic() < warm_until:
        time.sleep(TICK_S)
    say(f"{name}: trainers at their first step; {planned} faults planned over {window_s:.0f} s")
    w0 = time.monotonic()
    while trainers.alive() and time.monotonic() - w0 < window_s + 1:
        injector.tick(time.monotonic() - w0)
        swarm.check_crashes(time.monotonic() - w0)
        time.sleep(TICK_S)
    out["window_s"] = round(time.monotonic() - w0, 1)
    out["window_filled"] = time.monotonic() - w0 >= window_s
    trainers.stop()  # filling the window: it is over (no fault starts after this)
    ends = time.monotonic() + max(plan.KINDS.values()) + 30
    while trainers.alive() and injector.running() and time.monotonic() < ends:
        injector.tick(time.monotonic() - w0)  # the faults under way run to their end
        swarm.check_crashes(time.monotonic() - w0)
        time.sleep(TICK_S)
    injector.undo_all()
    trainers.join(trainers.deadline_s)
    settle = time.monotonic() + RESTART_S
    while swarm.restarting() and time.monotonic() < settle:  # restarts under way
        swarm.check_crashes(time.monotonic() - w0)
        time.sleep(TICK_S)
    swarm.check_crashes(time.monotonic() - w0)


def measure(minutes: float, seed: int, steps: int | None, calm: bool = True,
            chaos: bool = True, workdir: Path | None = None) -> dict[str, Any]:
    """Both runs (or one); ``workdir``: keep the homes and logs there (else a temporary
    directory, removed). Without ``steps`` the chaos run's trainers fill the window and the
    calm run trains the steps they did (the module doc); ``steps`` in the report is what the
    calm run trains (or would)."""
    fill = steps is None and chaos
    load_before = os.getloadavg()[0]
    report: dict[str, Any] = {"minutes": minutes, "seed": seed, "steps": steps,
                              "fill_window": fill, "chaos": None, "calm": None}
    with tempfile.TemporaryDirectory(prefix="swarmd-chaos-") as tmp:
        tmp = str(workdir or tmp)
        if chaos:
            cap = steps or max(5, round(minutes * STEPS_CAP_PER_MINUTE))
            report["chaos"] = run_phase("chaos", minutes=minutes, seed=seed, steps=cap,
                                        chaos=True, tmp=Path(tmp), fill=fill)
        report["steps"] = steps or plan.calm_steps(
            [t.get("steps") for t in (report["chaos"] or {}).get("trainers", ())],
            fallback=max(5, round(minutes * STEPS_PER_MINUTE)))
        if calm:
            report["calm"] = run_phase("calm", minutes=minutes, seed=seed,
                                       steps=report["steps"], chaos=False, tmp=Path(tmp))

    def finals(run: dict[str, Any] | None) -> list[float]:
        return [t["final_val_loss"] for t in (run or {}).get("trainers", ())
                if t.get("final_val_loss") is not None]

    report["loss_ratio_chaos_over_calm"] = plan.loss_ratio(finals(report["chaos"]),
                                                           finals(report["calm"]))
    report["verdict"] = plan.verdict(report)
    report["calm_weights_equal"] = (report["calm"] or {}).get("weights_equal")
    report["cores"] = os.cpu_count()
    report["loadavg_before_after"] = [load_before, os.getloadavg()[0]]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, required=True,
                        help="length of the chaos window (and of the calm run's steps)")
    parser.add_argument("--seed", type=int, default=1, help="the faults' random seed")
    parser.add_argument("--steps", type=int, help="trainer steps per run (default: the chaos "
                                                  "run's trainers fill the window, the calm "
                                                  "run trains the steps they did)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--workdir", type=Path, help="keep every home and log here")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--calm-only", action="store_true", help="only the calm run")
    group.add_argument("--no-calm", action="store_true", help="only the chaos run")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 120 or (args.steps is not None and args.steps < 1):
        parser.error("--minutes must be within (0, 120] and --steps at least 1")
    try:
        WanLab.check()
    except LabUnavailable as exc:
        print(json.dumps({"unavailable": str(exc)}))
        return 2
    report = measure(args.minutes, args.seed, args.steps, calm=not args.no_calm,
                     chaos=not args.calm_only, workdir=args.workdir)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
