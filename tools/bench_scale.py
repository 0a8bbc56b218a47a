"""A live swarm at scale on one machine (issue 28): 24 stage daemons and 2 trainers.

    python tools/bench_scale.py --json                 # 24 daemons, then the 4-daemon reference
    python tools/bench_scale.py --json --daemons 12 --kills 1 --no-reference

Starts ``--daemons`` ``swarmd join`` processes on 127.0.0.1 (2 stages, peer i at stage i mod 2,
each in a temporary home; ``sys.executable -m swarmd``, or forks of the zygote where
``SWARMD_LOCAL_ZYGOTE=1``), waits until their membership views agree, starts ``--trainers``
``swarmd train --steps N`` at once, and while they train SIGKILLs ``--kills`` daemons (not the
bootstrap one), one at a time at evenly spaced trainer steps, restarting each with the same
home once its stage's other peers took a step without it. The model is the demo's, shrunk as
the tests shrink it (width 64, 32-token sequences, 4 microbatches of 8 a step), computing on
the CPU (``model.device = "cpu"``, one torch thread a process). Reports one JSON object:

- ``membership``: ``converge_s`` from the last daemon's start line until every daemon's view
  (``GET /api/v0/swarm``) lists every daemon, and ``converge_periods`` in announcement periods
  (``period_s``: what the membership schedule gives a swarm of this size);
  ``rejoin_s``/``rejoin_periods``: per restart, from its start line until it and every live
  daemon list each other; ``converged_at_end_s`` (after training; None: not within
  ``CONVERGE_LIMIT_S``) and
  ``peers_endpoint_lists_all``: the share of daemons whose ``GET /api/v0/peers`` lists every
  other live daemon at the end (connections and routing, not the view), and
  ``peers_endpoint_missing``: for the others, which daemons they miss.
- ``stages``: per stage, the step each of its daemons ended at and the optimizer steps each
  applied (over its restarts), ``rounds_per_step`` (rounds led over the stage's steps; a
  round with no mate answering counts, and is also one of ``local_steps``, which counts steps
  taken alone), ``mean_group`` (members of a led round, ``sync.group_members`` over
  ``sync.rounds_led``) against ``size`` (its daemons), and after the first minute of training
  ``rounds_short_after_first_minute``: rounds whose leader left a live mate out
  (``sync.rounds_short``; ``..._outside_kills``: in polls that were not between a kill and the
  restarted daemon being at its stage's step again, plus the leaders' ``SUSPECT_S`` after
  it; ``rounds_short_outside_kills``: the same
  over the whole training); ``left_out``: why live mates were left out of rounds
  (``sync.left_out.*``: suspected, silent, busy, behind); ``answers_late``: round messages
  given up on at a mate's patience (``answer_late.<kind>``) and those of them answered after
  all (``answer_came_late.<kind>``: a slow mate, not a gone one); ``rounds_failed``;
  ``prepare_answer_s``: how long mates took to answer the leaders' ``prepare`` (count, and the
  histogram bounds holding the median, the 99th percentile and the slowest answer);
  ``other_sync_counters``: every other ``sync.*`` counter summed over the stage's daemons
  (refusals by reason, strangers probed, starts refused, leader changes).
- ``trainers``: each one's steps (its step at the end, and how many it took in this run),
  its microbatches (its shares of the swarm's steps), steps exact, tokens/s, rerouted,
  restarted, lost; ``expected_stage_steps``: the target batches the trainers sent together
  (their microbatches over ``training.microbatches``: every part steps once per target batch,
  ``averaging.target_batch_size``), which the stages' steps are compared with
  (``stage_steps_vs_expected``, 1.0 when every stage step was one target batch).
- ``memory``: each daemon's peak RSS (``/proc/<pid>/status``), MiB, mean and max, and the
  trainers'.
- ``tokens_per_s`` (the trainers' sum), ``lost``, ``seconds``.

``--keep DIR`` keeps every home (logs included) under DIR, to read why a round was short.

With ``--reference`` (the default) the same run with 4 daemons and no kills follows, and
``memory_ratio`` is the mean peak RSS per daemon of the big swarm over the reference's.
``targets`` (issue 28): lost 0, rounds include all live mates after the first minute (None
when the training was shorter; ``..._outside_kills``: over the whole training), membership
within 3 periods, memory within 1.2x of the reference's. Every daemon and trainer is
stopped on exit (also on Ctrl-C, SIGTERM or an error); every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from swarmd.averaging.trigger import SUSPECT_S  # noqa: E402
from swarmd.local.demo import DEMO_ENV  # noqa: E402
from swarmd.local.swarm import DaemonProcess, start_swarm, stop_all, wait_until  # noqa: E402
from swarmd.local.zygote import swarmd_popen  # noqa: E402

STAGES = 2
#: the demo model as the tests shrink it, on the CPU, one torch thread per process
SMALL_ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
             "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_TRAINING_VAL_BATCHES": "2",
             "SWARMD_MODEL_DEVICE": "cpu", "SWARMD_MODEL_THREADS": "1",
             "SWARMD_SWARM_STAGES": str(STAGES)}
#: how often the run's counters, views and memory are sampled, and the trainers' steps
#: looked at for the next kill
POLL_S = 2.0
KILL_WATCH_S = 0.2
#: the longest a trainer may take; the longest waits for starts, views and a restart
TRAIN_LIMIT_S = 1800.0
#: (a start line: 24 fresh interpreters importing torch at once on 2 loaded cores take minutes)
START_LIMIT_S = 600.0
CONVERGE_LIMIT_S = 180.0
RESTART_AFTER_LIMIT_S = 60.0
#: rounds before this much training are start-up (issue 28: "after the first minute")
FIRST_MINUTE_S = 60.0
#: issue 28's figures
TARGET_PERIODS = 3.0
TARGET_MEMORY_RATIO = 1.2
REFERENCE_DAEMONS = 4
SYNC_KEYS = ("rounds_led", "rounds", "local_steps", "rounds_failed", "group_members",
             "mates_left_out", "rounds_short")
#: round messages given up on at a mate's patience, and those answered after all
LATE_KEYS = ("sync.answer_late.", "sync.answer_came_late.")


def say(text: str) -> None:
    print(f"[bench_scale] {text}", file=sys.stderr, flush=True)


def swarm_env(seed: int) -> dict[str, str]:
    return {**SMALL_ENV, "SWARMD_TRAINING_SEED": str(seed),
            "SWARMD_SWARM_NAME": f"bench-scale-{secrets.token_hex(4)}"}


def period_s(peers: int) -> float:
    """The announcement period the membership schedule gives a swarm of ``peers``."""
    from swarmd.membership import ScheduleConfig, SwarmEstimate, plan

    return plan(SwarmEstimate(peers=peers), ScheduleConfig()).period_s


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def view_of(d: DaemonProcess) -> set[str]:
    info = d.get("/api/v0/swarm")
    return {p["peer_id"] for s in info["stages"] for p in s["peers"]} | {
        p["peer_id"] for p in info["excluded"]}


def converged(pool: ThreadPoolExecutor, live: list[DaemonProcess]) -> bool:
    """Whether every daemon of ``live`` lists all of them (asked at once)."""
    everyone = {d.peer_id for d in live}
    return all(everyone <= v for v in pool.map(view_of, live))


def peers_missing(slots: list["Slot"]) -> dict[int, list[int]]:
    """Per ready daemon whose ``/api/v0/peers`` (its connections and the peers its router
    knows) misses another ready daemon: the missing ones' indices."""
    ready = [s for s in slots if s.ready]
    out: dict[int, list[int]] = {}
    for s in ready:
        try:
            rows = {r["peer_id"] for r in s.proc.get("/api/v0/peers")}
        except OSError:
            continue
        missing = [m.index for m in ready if m is not s and m.proc.peer_id not in rows]
        if missing:
            out[s.index] = missing
    return out


@dataclass
class Slot:
    """One daemon's place in the swarm: its home and stage, its processes over restarts."""

    index: int
    stage: int
    proc: DaemonProcess
    #: the last counters seen of each of its processes (a restart starts them at 0 again)
    counters: list[dict[str, int]] = field(default_factory=lambda: [{}])
    #: counters of each process when the first minute of training ended
    at_first_minute: list[dict[str, int]] | None = None
    rss_peak_mib: float = 0.0
    #: the last ``round_ask_seconds.prepare`` buckets seen of each of its processes
    asks: list[list[list[Any]]] = field(default_factory=lambda: [[]])
    #: the stage its status last named (balancing may move it from ``stage``)
    serving: int | None = None

    @property
    def now_stage(self) -> int:
        """The stage it serves now, as far as seen (its start stage until it said)."""
        return self.stage if self.serving is None else self.serving

    @property
    def ready(self) -> bool:
        """Running, and it printed its start line (it has an API)."""
        return self.proc.proc.poll() is None and bool(self.proc.started)

    def sample(self) -> None:
        """Its counters now (kept when it does not answer), and its memory."""
        rss = rss_mib(self.proc.proc.pid)
        if rss is not None:
            self.rss_peak_mib = max(self.rss_peak_mib, rss)
        try:
            status = self.proc.get("/api/v0/status")
            c = status["counters"]
        except (OSError, ValueError, KeyError):
            return
        self.counters[-1] = {k: int(v) for k, v in c.items()}
        if isinstance(status.get("stage"), int):
            self.serving = status["stage"]
        asked = (status.get("histograms") or {}).get("round_ask_seconds.prepare")
        if isinstance(asked, dict) and isinstance(asked.get("buckets"), list):
            self.asks[-1] = asked["buckets"]

    def total(self, key: str, since_first_minute: bool = False) -> int:
        base = self.at_first_minute if since_first_minute else None
        out = 0
        for i, c in enumerate(self.counters):
            before = base[i].get(key, 0) if base is not None and i < len(base) else 0
            out += c.get(key, 0) - before
        return out

    @property
    def step(self) -> int:
        return self.counters[-1].get("stage.step", 0)


@dataclass
class Kill:
    """One planned SIGKILL and restart, advanced a little at each poll (``Swarm.advance``)."""

    slot: int
    at_trainer_step: int
    killed_at: float | None = None
    killed_at_trainer_step: int | None = None
    mates_step: int = 0
    spawned_at: float | None = None
    restarted_at: float | None = None
    restarted_at_trainer_step: int | None = None
    rejoined_at: float | None = None
    #: the views did not agree within ``CONVERGE_LIMIT_S`` of its restart
    rejoin_failed: bool = False
    #: when the restarted daemon was at its stage's step again
    caught_up_at: float | None = None

    @property
    def down(self) -> bool:
        """Killed and not started again yet."""
        return self.killed_at is not None and self.restarted_at is None


@dataclass
class Swarm:
    """The daemons of one run, and what their kills need."""

    slots: list[Slot]
    daemons: list[DaemonProcess]  # every process started, stopped on exit
    env: dict[str, str]
    bootstrap: str
    period: float
    pool: ThreadPoolExecutor

    def ready(self) -> list[DaemonProcess]:
        return [s.proc for s in self.slots if s.ready]

    def mates_step(self, s: Slot) -> int:
        return max((m.step for m in self.slots if m.now_stage == s.now_stage and m is not s
                    and m.ready), default=0)

    def sample(self) -> None:
        list(self.pool.map(Slot.sample, [s for s in self.slots if s.ready]))

    def advance(self, k: Kill, progress: int, now: bool = False) -> None:
        """One move of a kill, never blocking: SIGKILL at its trainer step; start it again
        with its home once its stage's other peers took a step without it (``now``: at
        once); note its start line, then when the views agree again, then when it is at its
        stage's step again."""
        s = self.slots[k.slot]
        t = time.monotonic()
        if k.killed_at is None:
            if progress >= k.at_trainer_step:
                say(f"SIGKILL daemon {s.index} (stage {s.stage}) at trainer step {progress}")
                s.proc.proc.kill()
                k.killed_at, k.killed_at_trainer_step = t, progress
                stop_all([s.proc], seconds=10.0)  # reaps it and closes its stderr
                mates = [m for m in self.slots if m.now_stage == s.now_stage and m.ready]
                list(self.pool.map(Slot.sample, mates))  # their step now, not a poll ago
                k.mates_step = self.mates_step(s)
        elif k.spawned_at is None:
            if now or self.mates_step(s) > k.mates_step or (
                    t - k.killed_at > RESTART_AFTER_LIMIT_S):
                os.replace(s.proc.stderr_path, s.proc.home / f"daemon.stderr.{len(s.counters)}")
                s.proc = DaemonProcess(s.proc.home, "--stage", str(s.now_stage), "--bootstrap",
                                       self.bootstrap, env=self.env)
                self.daemons.append(s.proc)
                s.counters.append({})
                s.asks.append([])
                if s.at_first_minute is not None:
                    s.at_first_minute.append({})
                k.spawned_at = t
        elif k.restarted_at is None:
            try:
                s.proc.wait_started(0.05)
            except TimeoutError:
                if t - k.spawned_at > START_LIMIT_S:
                    raise RuntimeError(f"daemon {s.index} did not start again within "
                                       f"{START_LIMIT_S:.0f} s") from None
                return
            k.restarted_at, k.restarted_at_trainer_step = time.monotonic(), progress
            say(f"daemon {s.index} started again at trainer step {progress}, "
                f"{k.restarted_at - k.killed_at:.0f} s after its kill")
        elif k.rejoined_at is None:
            if converged(self.pool, self.ready()):
                k.rejoined_at = time.monotonic()
                took = k.rejoined_at - k.restarted_at
                say(f"daemon {s.index}: views agree {took:.1f} s after its start "
                    f"({took / self.period:.1f} periods)")
            elif t - k.restarted_at > CONVERGE_LIMIT_S:
                k.rejoined_at, k.rejoin_failed = t, True
        elif k.caught_up_at is None and s.ready and s.step >= self.mates_step(s):
            k.caught_up_at = t

    def finish(self, k: Kill, progress: int) -> None:
        """After training: a daemon still down is started again and its rejoin measured."""
        deadline = time.monotonic() + START_LIMIT_S + CONVERGE_LIMIT_S
        while k.killed_at is not None and (k.rejoined_at is None) and (
                time.monotonic() < deadline):
            self.advance(k, progress, now=True)
            time.sleep(0.1)  # a poll of the restarted daemon's start and views


def start_trainer(root: Path, i: int, bootstrap: str, steps: int, env: dict[str, str]) -> Any:
    home = root / f"trainer{i}"
    home.mkdir(parents=True, exist_ok=True)
    err = open(home / "train.stderr", "w")
    try:
        return swarmd_popen(["train", "--home", str(home), "--json", "--bootstrap", bootstrap,
                             "--steps", str(steps), "--listen", "/ip4/127.0.0.1/tcp/0"],
                            stdout=subprocess.PIPE, stderr=err, text=True, cwd=home,
                            env={**os.environ, "SWARMD_LOG_LEVEL": "warning", **env})
    finally:
        err.close()


def trainer_steps_so_far(home: Path) -> int:
    path = home / "train-metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def trainer_result(proc: Any, home: Path) -> dict[str, Any]:
    out = proc.stdout.read() if proc.stdout is not None else ""
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"swarmd train failed ({proc.returncode}):\n"
                           f"{(home / 'train.stderr').read_text()[-3000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    return {k: r.get(k) for k in ("steps", "resumed_from", "tokens_per_s", "rerouted",
                                  "restarted", "lost", "seconds", "parts_from",
                                  "trainer_rounds", "initial_val_loss", "final_val_loss",
                                  "microbatches", "steps_exact")} | {
        "steps_taken": trainer_steps_so_far(home)}


def stop_trainers(trainers: list[Any]) -> None:
    for p in trainers:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 15.0
    for p in trainers:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        except RuntimeError as exc:  # a zygote's fork whose zygote died (signalled with us)
            say(f"a trainer: {exc}")


def run_swarm(n: int, trainers: int, steps: int, kills: int, seed: int,
              root: Path) -> dict[str, Any]:
    """One run (module doc); everything it starts is stopped before it returns or raises."""
    if n < 2 * STAGES:
        raise ValueError(f"need at least {2 * STAGES} daemons (2 a stage), not {n}")
    env = swarm_env(seed)
    rng = random.Random(seed)
    period = period_s(n + trainers)
    daemons: list[DaemonProcess] = []
    running: list[Any] = []
    t_begin = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        try:
            say(f"{n} daemons: starting")
            start_swarm(root, [i % STAGES for i in range(n)], env=env, into=daemons,
                        seconds=START_LIMIT_S)
            swarm = Swarm([Slot(i, i % STAGES, d) for i, d in enumerate(daemons)], daemons,
                          env, daemons[0].addr, period, pool)
            t0 = time.monotonic()
            wait_until(lambda: converged(pool, swarm.ready()), CONVERGE_LIMIT_S,
                       f"{n} daemons' views agree", interval=0.1)
            converge = time.monotonic() - t0
            say(f"{n} daemons up in {t0 - t_begin:.0f} s, views agree {converge:.1f} s later "
                f"({converge / period:.1f} periods of {period:.1f} s)")
            homes = [root / f"trainer{i}" for i in range(trainers)]
            for i in range(trainers):
                running.append(start_trainer(root, i, swarm.bootstrap, steps, env))
            t_train = time.monotonic()
            plan = [Kill(v, max(1, round(steps * (k + 1) / (kills + 1))))
                    for k, v in enumerate(rng.sample(range(1, n), min(kills, n - 1)))]
            polls = _train(swarm, running, homes, plan, t_train)
            results = [trainer_result(p, h) for p, h in zip(running, homes)]
            for k in plan:  # a daemon killed near the end is started again all the same
                swarm.finish(k, steps)
            swarm.sample()
            polls.append((time.monotonic(), _short_by_slot(swarm.slots)))
            for k in plan:  # caught up by now?
                swarm.advance(k, steps)
            t1 = time.monotonic()
            try:
                wait_until(lambda: converged(pool, swarm.ready()), CONVERGE_LIMIT_S,
                           "views at the end", interval=0.2)
                at_end: float | None = time.monotonic() - t1
            except AssertionError:
                at_end = None
            missing = peers_missing(swarm.slots)
        finally:
            try:
                stop_trainers(running)
            finally:
                stop_all(daemons, seconds=30.0)
    return _report(n, trainers, steps, swarm.slots, plan, results, period, converge, at_end,
                   missing, polls, t_train, time.monotonic() - t_begin)


def _short_by_slot(slots: list[Slot]) -> dict[int, int]:
    return {s.index: s.total("sync.rounds_short") for s in slots}


def _train(swarm: Swarm, running: list[Any], homes: list[Path], plan: list[Kill],
           t_train: float) -> list[tuple[float, dict[int, int]]]:
    """Sample the swarm every ``POLL_S`` while the trainers train and move the kills on (one
    daemon down at a time); returns the polls: (time, rounds short of a mate per slot)."""
    polls: list[tuple[float, dict[int, int]]] = []
    deadline = t_train + TRAIN_LIMIT_S
    while any(p.poll() is None for p in running):
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"the trainers did not finish within {TRAIN_LIMIT_S:.0f} s")
        swarm.sample()
        polls.append((now, _short_by_slot(swarm.slots)))
        if swarm.slots[0].at_first_minute is None and now - t_train >= FIRST_MINUTE_S:
            for s in swarm.slots:
                s.at_first_minute = [dict(c) for c in s.counters]
        progress = min(trainer_steps_so_far(h) for h in homes)
        for k in plan:
            if k.killed_at is None and any(other.down for other in plan):
                break  # one daemon down at a time; the later kills wait
            swarm.advance(k, progress)
            if k.killed_at is None:
                break  # kills happen in order
        # until the next sample, the next kill is watched for more often: it happens at
        # its trainer step, not up to a sampling period later
        next_sample = now + POLL_S
        while time.monotonic() < next_sample and any(p.poll() is None for p in running):
            time.sleep(KILL_WATCH_S)
            due = next((k for k in plan if k.killed_at is None), None)
            if due is not None and not any(other.down for other in plan):
                swarm.advance(due, min(trainer_steps_so_far(h) for h in homes))
    return polls


def answer_quantiles(histograms: list[list[list[Any]]]) -> dict[str, Any]:
    """How long mates took to answer ``prepare`` (``round_ask_seconds.prepare``, cumulative
    buckets of several processes summed): the count and the upper bounds of the buckets that
    hold the median, the 99th percentile and the slowest answer (what a wait shorter than
    ``ASK_TIMEOUT_S`` would have to allow)."""
    totals: dict[str, int] = {}
    for buckets in histograms:
        for bound, n in buckets:
            totals[str(bound)] = totals.get(str(bound), 0) + int(n)
    order = sorted(totals, key=lambda b: float("inf") if b == "+Inf" else float(b))
    count = totals[order[-1]] if order else 0

    def bound_at(q: float) -> Any:
        for b in order:
            if count and totals[b] >= q * count:
                return b if b == "+Inf" else float(b)
        return None

    return {"count": count, "p50_le": bound_at(0.5), "p99_le": bound_at(0.99),
            "max_le": bound_at(1.0)}


def _report(n: int, trainers: int, steps: int, slots: list[Slot], plan: list[Kill],
            results: list[dict[str, Any]], period: float, converge: float,
            at_end: float | None, missing: dict[int, list[int]],
            polls: list[tuple[float, dict[int, int]]],
            t_train: float,
            seconds: float) -> dict[str, Any]:
    # one stage step per target batch: the trainers' microbatches over a step's
    expected = sum(int(r["microbatches"] or 0) for r in results) // int(
        SMALL_ENV["SWARMD_TRAINING_MICROBATCHES"])
    # a kill's window: from the kill until the restarted daemon caught up, and the leaders'
    # suspicion of it after that (they stop asking a mate that failed them for SUSPECT_S)
    kill_windows = [(k.killed_at, (k.caught_up_at or float("inf")) + SUSPECT_S) for k in plan
                    if k.killed_at is not None]
    target = int(SMALL_ENV["SWARMD_TRAINING_BATCH_SIZE"]) * int(
        SMALL_ENV["SWARMD_TRAINING_MICROBATCHES"])
    stages = []
    for stage in range(STAGES):
        # a daemon that moved counts at the stage it serves at the end (its counters of the
        # stage it left come with it: ``moved_in`` says which)
        mine = [s for s in slots if s.now_stage == stage]
        sums = {k: sum(s.total(f"sync.{k}") for s in mine) for k in SYNC_KEYS}
        stage_step = max((s.step for s in mine), default=0)
        late = sum(s.total("sync.rounds_short", since_first_minute=True) for s in mine)
        stages.append({
            "stage": stage, "size": len(mine),
            "moved_in": [s.index for s in mine if s.stage != stage],
            "steps": [s.step for s in mine],
            "optimizer_steps": [s.total("stage.optimizer_steps") for s in mine],
            "rounds_led": sums["rounds_led"], "rounds_failed": sums["rounds_failed"],
            "local_steps": sums["local_steps"],
            "rounds_per_step": sums["rounds_led"] / max(1, stage_step),
            "mean_group": sums["group_members"] / max(1, sums["rounds_led"]),
            "mates_left_out": sums["mates_left_out"], "rounds_short": sums["rounds_short"],
            "left_out": _summed(mine, "sync.left_out.", lambda k: k.startswith(
                "sync.left_out.")),
            # answers given up on at a mate's patience, and those of them that came after all
            "answers_late": _summed(mine, "sync.", lambda k: k.startswith(LATE_KEYS)),
            "rounds_short_after_first_minute": (
                late if slots[0].at_first_minute is not None else None),
            "rounds_short_after_first_minute_outside_kills": _short_outside(
                polls, kill_windows, [s.index for s in mine], t_train + FIRST_MINUTE_S),
            "rounds_short_outside_kills": _short_outside(
                polls, kill_windows, [s.index for s in mine], t_train),
            "stage_steps_vs_expected": stage_step / max(1, expected),
            # the samples its peers stepped with, per stage step, against the target
            "samples_per_step": sum(s.total("stage.stepped_samples") for s in mine)
            / max(1, stage_step), "target_samples": target,
            "prepare_answer_s": answer_quantiles([b for s in mine for b in s.asks]),
            # every other round counter (refusals, probes of strangers, starts refused,
            # leader changes...), summed over the stage's daemons: what explains a short round
            "other_sync_counters": _summed(mine, "sync.", lambda k: k.startswith("sync.")
                                           and not k.startswith(("sync.left_out.", *LATE_KEYS))
                                           and k.removeprefix("sync.") not in SYNC_KEYS)})
    rss = [s.rss_peak_mib for s in slots if s.rss_peak_mib > 0]
    rejoin = [None if k.rejoin_failed else k.rejoined_at - k.restarted_at for k in plan
              if k.rejoined_at is not None and k.restarted_at is not None]
    return {
        "daemons": n, "trainers_count": trainers, "steps": steps, "kills": len(plan),
        "membership": {"period_s": period, "converge_s": converge,
                       "converge_periods": converge / period, "rejoin_s": rejoin,
                       "rejoin_periods": [None if r is None else r / period for r in rejoin],
                       "converged_at_end_s": at_end,
                       "peers_endpoint_lists_all": 1 - len(missing) / max(1, n),
                       "peers_endpoint_missing": missing},
        "stages": stages,
        "trainers": results, "expected_stage_steps": expected,
        "memory": {"daemon_peak_rss_mib": rss, "mean_mib": sum(rss) / max(1, len(rss)),
                   "max_mib": max(rss, default=0.0)},
        "tokens_per_s": sum(float(r["tokens_per_s"] or 0) for r in results),
        "lost": sum(int(r["lost"] or 0) for r in results),
        "killed": [{"daemon": k.slot, "stage": slots[k.slot].stage,
                    "planned_at_trainer_step": k.at_trainer_step,
                    "at_trainer_step": k.killed_at_trainer_step,
                    "restarted_at_trainer_step": k.restarted_at_trainer_step,
                    "restarted_after_s": k.restarted_at - k.killed_at,
                    "caught_up_after_restart_s": None if k.caught_up_at is None
                    else k.caught_up_at - k.restarted_at}
                   for k in plan if k.killed_at is not None and k.restarted_at is not None],
        "kills_not_reached": sum(k.killed_at is None for k in plan),
        "seconds": seconds}


def _summed(slots: list[Any], prefix: str, wanted: Callable[[str], bool]) -> dict[str, int]:
    """Each ``wanted`` counter summed over ``slots`` (their restarts included), named without
    ``prefix``, in name order."""
    names = sorted({k for s in slots for c in s.counters for k in c if wanted(k)})
    return {k.removeprefix(prefix): sum(s.total(k) for s in slots) for k in names}


def _short_outside(polls: list[tuple[float, dict[int, int]]],
                   windows: list[tuple[float, float]], members: list[int],
                   after: float) -> int:
    """Rounds short of a live mate led by ``members`` between polls after ``after`` that did
    not overlap a kill's window (from the kill until the restarted daemon caught up)."""
    out = 0
    for (ta, a), (tb, b) in zip(polls, polls[1:]):
        if ta < after or any(ta <= end and start <= tb for start, end in windows):
            continue
        out += sum(max(0, b.get(i, 0) - a.get(i, 0)) for i in members)
    return out


def targets(big: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, bool | None]:
    t: dict[str, bool | None] = {
        "lost_0": big["lost"] == 0,
        # None: the training did not last a minute (then see the next one)
        "rounds_include_live_mates_after_first_minute": None if any(
            s["rounds_short_after_first_minute"] is None for s in big["stages"]) else all(
            s["rounds_short_after_first_minute_outside_kills"] == 0 for s in big["stages"]),
        "rounds_include_live_mates_outside_kills": all(
            s["rounds_short_outside_kills"] == 0 for s in big["stages"]),
        "membership_within_3_periods": big["membership"]["converge_periods"] <= TARGET_PERIODS
        and all(r is not None and r <= TARGET_PERIODS
                for r in big["membership"]["rejoin_periods"]),
        "memory_within_1_2x": None}
    if ref is not None:
        t["memory_within_1_2x"] = big["memory_ratio"] <= TARGET_MEMORY_RATIO
    return t


def measure(daemons: int, trainers: int, steps: int, kills: int, seed: int,
            reference: bool, keep: Path | None = None) -> dict[str, Any]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(keep)) if keep is not None
          else tempfile.TemporaryDirectory(prefix="swarmd-bench-scale-")) as tmp:
        big = run_swarm(daemons, trainers, steps, kills, seed, Path(tmp) / "big")
        ref = None
        if reference:
            ref = run_swarm(REFERENCE_DAEMONS, trainers, steps, 0, seed, Path(tmp) / "ref")
            big["memory_ratio"] = big["memory"]["mean_mib"] / max(1e-9, ref["memory"]["mean_mib"])
    return {**big, "reference": ref, "targets": targets(big, ref), "cores": os.cpu_count(),
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--daemons", type=int, default=24, help="stage daemons (default 24)")
    parser.add_argument("--trainers", type=int, default=2, help="trainers (default 2)")
    parser.add_argument("--steps", type=int, default=30, help="steps per trainer (default 30)")
    parser.add_argument("--kills", type=int, default=3,
                        help="daemons SIGKILLed and restarted during the run (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help=f"also run {REFERENCE_DAEMONS} daemons (no kills) for the "
                             "per-daemon figures (default on)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="put the daemons' and trainers' homes (their logs) under DIR and "
                             "keep them (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    if args.daemons < 2 * STAGES or args.trainers < 1 or args.steps < 1 or args.kills < 0:
        parser.error(f"need --daemons >= {2 * STAGES}, --trainers >= 1, --steps >= 1, "
                     "--kills >= 0")
    # SIGTERM (timeout, a supervisor) unwinds like Ctrl-C: every process is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = measure(args.daemons, args.trainers, args.steps, args.kills, args.seed,
                     args.reference, args.keep)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
