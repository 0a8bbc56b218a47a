"""WAN benchmark: swarmd through the emulated WAN (tools/wanlab), each profile against the
unshaped lab in the same run.

    sudo .venv/bin/python tools/bench_wan.py --json     (root: the lab needs namespaces)
    sudo .venv/bin/python tools/bench_wan.py --json --step-drains first --microbatches 64

Profiles (host-to-host one-way delay; every host's link gets half of it, and the rates):
region 5 ms, 1 Gbit/s; continent 25 ms, 200 Mbit/s; far 50 ms, 100 Mbit/s; home 15 ms,
50 Mbit/s down and 10 Mbit/s up. Hosts: ``s0`` (stage 0 daemon), ``s1`` (stage 1 daemon),
``tr`` (the trainer), ``nx`` (a daemon that joins, for the join time). For each profile:

- ``rtt_ms``: TCP connect time s0 -> s1 (one round trip), the lab's own check
- ``raw_tcp_MBps``: one plain TCP connection s0 -> s1 for a few seconds (this process, sockets
  made inside the hosts); ``raw_tcp_vs_link_rate``: over the path's bottleneck rate
- ``transport_MBps``: one stream through swarmd's transport (tools/wanlab/streams.py, codec
  none, 1 MiB float32 messages) s0 -> s1, both ends in their own processes in the lab;
  ``transport_vs_raw_tcp``: the two on the same link in the same run
- ``pipeline_tokens_per_s``: ``swarmd train`` in ``tr`` through the two stage daemons, the
  rate over the second half of its steps; ``pipeline_ratio_vs_unshaped``. With
  ``--repeats N`` the pipeline runs N times per profile, in rounds (unshaped, then each
  profile, then again): ``pipeline_runs_tokens_per_s``, ``pipeline_ratios`` (each round's
  run over that round's unshaped one) and ``pipeline_ratio_vs_unshaped`` their median (the
  machine's load drifts between runs minutes apart; a round's pair drifts less);
  ``pipeline.stages``: how each stage daemon's counters changed over the run (optimizer steps,
  ms its gate stood closed for steps, busy refusals, late and stepped samples);
  ``pipeline.steady_step_seconds``: the median and longest step of the second half (a stall
  shows as one long step); ``pipeline.steady_step_phases``: where a step of the second half
  went, the median of each phase (``TrainStats.step_phases``: its first and last microbatch
  back from its start, then the trainer's own gradient, the wait for the stages' reports, the
  optimizer step; later rounds: ``pipeline_rounds_step_phases``); a profile's extra time a
  step over unshaped's shows in the phase that grew; ``pipeline_runs_others_cpu_share``: per run, the share of the
  machine that processes outside this benchmark used meanwhile (a test run beside it), and
  ``pipeline_contended_rounds`` the rounds where that passed ``CONTENDED_SHARE`` (0.1) in the
  profile's run or the unshaped one: their ratios say little, measure again on a quiet machine;
  ``pipeline_runs_delayer_cpu_share``: per run, the share of the machine the lab's delayer
  used (it holds every packet of a delayed host, in Python, on the cores the swarm computes
  on: a cost a real WAN does not have; unshaped passes no packet through it);
  ``pipeline.steady_in_flight_target`` / ``steady_round_trip_ms``: the trainer's in-flight
  target and shortest microbatch round trip over the second half (medians)
- ``join_to_online_s``: from starting ``swarmd join --stage 1`` in ``nx`` until its status
  says online (state sync from the stage-1 peer included)
- ``membership_convergence_6_daemons_s``: 6 daemons of a separate swarm on hosts m0..m5, from
  the last one's start line until every view lists all 6 (``--no-membership`` skips it)

- ``allreduce``: a stage all-reduce among 3 peers on hosts a0..a2 (swarmd's Averager over its
  transport, tools/wan_peer.py, codec none, ``ALLREDUCE_MB`` MB of float32, one warm-up round
  and ``ALLREDUCE_ROUNDS`` measured): ``bus_bandwidth_MBps`` as NCCL counts it, data bytes
  over the round's time times 2(n-1)/n (what each peer's link must carry), the median
  over peers of the best measured round; ``bus_bandwidth_vs_link_rate`` over the bottleneck
  rate. ``--allreduce-only`` measures just that (no daemons, no trainer).

MB = 10**6 bytes. Everything stays inside the lab's namespaces
(198.18.0.0/15); every loop is bounded in count and time. The machine's cores are shared:
absolute numbers vary, ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from tools.wanlab import HostSpec, LabUnavailable, Link, WanLab  # noqa: E402
from tools.wanlab import daemons, probe  # noqa: E402
from bench_pipeline import CONTENDED_SHARE, add_schedule_options, schedule_overrides  # noqa: E402
from cpu_use import OthersShare, proc_cpu_s  # noqa: E402

#: name: (host-to-host one-way delay ms, down Mbit/s, up Mbit/s); None: unshaped
PROFILES: dict[str, tuple[float, float, float] | None] = {
    "unshaped": None,
    "region": (5.0, 1000.0, 1000.0),
    "continent": (25.0, 200.0, 200.0),
    "far": (50.0, 100.0, 100.0),
    "home": (15.0, 50.0, 10.0),
    # issue 26: a volunteer's uplink, where bandwidth, not latency, limits the pipeline;
    # measured with a wider model (``--bandwidth-bound``, tools/bench_wan_bandwidth.py)
    "uplink": (10.0, 2.0, 2.0),
}
#: the profiles measured unless ``--profiles`` names others (``uplink`` needs its model)
DEFAULT_PROFILES = ("unshaped", "region", "continent", "far", "home")
HOSTS = ("s0", "s1", "tr", "nx")
MEMBERS = tuple(f"m{i}" for i in range(6))
AVERAGERS = ("a0", "a1", "a2")
NOT_MEASURED: list[str] = []
ALLREDUCE_MB = 64.0
ALLREDUCE_ROUNDS = 2


def say(line: str) -> None:
    print(f"[bench_wan] {line}", file=sys.stderr, flush=True)


def link_of(profile: str) -> Link:
    p = PROFILES[profile]
    if p is None:
        return Link()
    one_way, down, up = p
    return Link(delay_ms=one_way / 2, down_mbit=down, up_mbit=up)


def bottleneck_MBps(profile: str) -> float | None:
    p = PROFILES[profile]
    return None if p is None else min(p[1], p[2]) * 1e6 / 8 / 1e6


def transport_stream(lab: WanLab, server: dict[str, Any], seconds: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    proc = lab.run("s0", [sys.executable, "-m", "tools.wanlab.streams", "send",
                          "--to", server["addr"], "--peer", server["peer_id"],
                          "--listen", f"/ip4/{lab.addr('s0')}/tcp/0",
                          "--seconds", str(seconds)],
                   stdout=subprocess.PIPE, text=True, cwd=HERE.parent, env=env)
    out, _ = proc.communicate(timeout=seconds + 300)
    if proc.returncode != 0:
        raise RuntimeError(f"the transport stream failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def start_stream_server(lab: WanLab) -> tuple[Any, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    proc = lab.run("s1", [sys.executable, "-m", "tools.wanlab.streams", "serve",
                          "--listen", f"/ip4/{lab.addr('s1')}/tcp/0", "--deadline", "3600"],
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                   cwd=HERE.parent, env=env)
    line = daemons.readline(proc, 60)
    if not line:
        raise RuntimeError("the transport stream server did not start")
    return proc, json.loads(line)


def join_to_online(lab: WanLab, root: Path, bootstrap: str, env: dict[str, str],
                   tag: str) -> float:
    d = daemons.LabDaemon(lab, "nx", root / f"nx-{tag}", "--stage", "1", "--bootstrap",
                          bootstrap, env=env)
    try:
        d.wait_started()
        from swarmd.local.swarm import wait_until

        wait_until(lambda: d.get("/api/v0/status")["state"] == "online", 180,
                   f"the joining daemon online ({tag})", interval=0.1)
        return time.monotonic() - d.t_start
    finally:
        d.stop()


def _view(d: daemons.LabDaemon) -> set[str]:
    info = d.get("/api/v0/swarm")
    return {p["peer_id"] for s in info["stages"] for p in s["peers"]} | {
        p["peer_id"] for p in info["excluded"]}


def membership_convergence(lab: WanLab, root: Path, env: dict[str, str], tag: str) -> float:
    """6 daemons of a swarm of their own, one per host m0..m5 (the first starts it, the others
    join through it with --stage auto): seconds from the last one's start line until every
    daemon's view lists all 6, as tools/bench_membership.py measures on 127.0.0.1."""
    from swarmd.local.swarm import wait_until

    env = {**env, "SWARMD_SWARM_NAME": f"bench-wan-m-{secrets.token_hex(4)}"}
    started: list[daemons.LabDaemon] = []
    try:
        first = daemons.LabDaemon(lab, MEMBERS[0], root / f"{MEMBERS[0]}-{tag}", "--stage", "0",
                                  env=env)
        started.append(first)
        first.wait_started()
        for h in MEMBERS[1:]:
            started.append(daemons.LabDaemon(lab, h, root / f"{h}-{tag}", "--bootstrap",
                                             first.addr, env=env))
        for d in started[1:]:
            d.wait_started()
        t0 = time.monotonic()
        everyone = {d.started["peer_id"] for d in started}
        wait_until(lambda: all(_view(d) == everyone for d in started), 90,
                   f"6 daemons converged ({tag})", interval=0.1)
        return time.monotonic() - t0
    finally:
        daemons.stop_all(started)


#: stage counters a pipeline run reports (their change over the run), per stage daemon
STAGE_COUNTERS = ("stage.optimizer_steps", "stage.step_gate_closed_ms", "stage.busy",
                  "stage.late_samples", "stage.stepped_samples", "stage.compute_busy_ms",
                  "stage.busy_behind_step", "stage.ahead_of_forward", "stage.steps_noted",
                  "stage.step_notes_disagree", "stage.norm_notes_failed",
                  "stage.busy_budget.requests")


def stage_counters(stages: list[daemons.LabDaemon]) -> list[dict[str, int]]:
    out = []
    for d in stages:
        c = d.get("/api/v0/status")["counters"]
        out.append({k: int(c.get(k, 0)) for k in STAGE_COUNTERS})
    return out


def train_counted(lab: WanLab, stages: list[daemons.LabDaemon], home: Path, bootstrap: str,
                  steps: int, tokens_per_step: int, env: dict[str, str]) -> dict[str, Any]:
    """One ``swarmd train`` run (``daemons.train``) and, per stage daemon, how its
    ``STAGE_COUNTERS`` changed over it (``stages``: what draining cost, busy refusals,
    lateness); ``cpu``: how much of the machine other processes used meanwhile
    (``cpu_use.OthersShare``)."""
    before = stage_counters(stages)
    cpu = OthersShare().start()
    delayer = lab.delayer_pid
    delayer0 = 0.0 if delayer is None else proc_cpu_s(delayer)
    t = daemons.train(lab, "tr", home, bootstrap, steps, tokens_per_step, env, seconds=900)
    t["cpu"] = cpu.stop()
    # the lab's delayer runs on the cores under test (counted among ours): its share of the
    # machine is what the emulated WAN itself took from the swarm, not the swarm's own cost
    t["cpu"]["delayer_share"] = 0.0 if delayer is None else (
        (proc_cpu_s(delayer) - delayer0) / max(1e-9, t["cpu"]["seconds"] * (os.cpu_count() or 1)))
    if t["cpu"]["others_share"] > CONTENDED_SHARE:
        say(f"other processes used {t['cpu']['others_share']:.0%} of the machine during this "
            f"run: its rate is not comparable with a quiet run's")
    t["stages"] = [{k: a[k] - b[k] for k in STAGE_COUNTERS}
                   for a, b in zip(stage_counters(stages), before)]
    run_ms = max(1.0, t["cpu"]["seconds"] * 1e3)
    for s in t["stages"]:  # how much of the run each stage's compute thread computed
        s["compute_busy_share"] = s["stage.compute_busy_ms"] / run_ms
    # the rate over the second half of the steps (the whole run's when too short for one)
    t["rate"] = t.get("steady_tokens_per_s", t["tokens_per_s"])
    return t


def measure_profile(lab: WanLab, name: str, *, root: Path, server: dict[str, Any],
                    stages: list[daemons.LabDaemon], bootstrap: str, env: dict[str, str],
                    steps: int, tokens_per_step: int, stream_s: float,
                    membership: bool, secondary: bool = True) -> dict[str, Any]:
    link = set_profile(lab, name)
    say(f"{name}: {link}")
    out: dict[str, Any] = {"profile": PROFILES[name], "link_per_host": {
        "delay_ms": link.delay_ms, "down_mbit": link.down_mbit, "up_mbit": link.up_mbit}}
    out["rtt_ms"] = statistics.median(probe.connect_rtt_ms(lab, "s0", "s1", count=5))
    raw = probe.tcp_stream_MBps(lab, "s0", "s1", seconds=stream_s)
    out["raw_tcp_MBps"] = raw["MBps"]
    out["raw_tcp_second_half_MBps"] = raw["second_half_MBps"]
    tr = transport_stream(lab, server, stream_s)
    out["transport_MBps"] = tr["MBps"]
    out["transport_vs_raw_tcp"] = tr["MBps"] / raw["MBps"]
    cap = bottleneck_MBps(name)
    out["link_MBps"] = cap
    out["raw_tcp_vs_link_rate"] = None if cap is None else raw["MBps"] / cap
    say(f"{name}: rtt {out['rtt_ms']:.1f} ms, raw tcp {raw['MBps']:.1f} MB/s, transport "
        f"{tr['MBps']:.1f} MB/s")
    t = train_counted(lab, stages, root / f"trainer-{name}", bootstrap, steps,
                      tokens_per_step, env)
    out["pipeline_tokens_per_s"] = t["rate"]
    out["pipeline_runs_tokens_per_s"] = [out["pipeline_tokens_per_s"]]
    out["pipeline_whole_run_tokens_per_s"] = t["tokens_per_s"]
    out["pipeline_runs_others_cpu_share"] = [t["cpu"]["others_share"]]
    out["pipeline_runs_delayer_cpu_share"] = [t["cpu"]["delayer_share"]]
    out["pipeline_rounds_steps_started_early"] = [t.get("steps_started_early")]
    out["pipeline"] = {k: t.get(k) for k in ("steps", "seconds", "steady_steps",
                                             "steady_seconds", "steady_step_seconds",
                                             "steady_step_phases",
                                             "steady_in_flight_target", "steady_round_trip_ms",
                                             "rerouted", "restarted", "lost",
                                             "steps_exact", "steps_started_early",
                                             "initial_val_loss", "final_val_loss", "stages",
                                             "cpu")}
    say(f"{name}: pipeline {out['pipeline_tokens_per_s']:,.0f} tokens/s")
    # the secondary figures: one that fails is reported, the run goes on
    out["errors"] = {}
    others = [("join_to_online_s", lambda: join_to_online(lab, root, bootstrap, env, name)),
              ("allreduce", lambda: allreduce_bus_bandwidth(lab, name))] if secondary else []
    if membership:
        others.append(("membership_convergence_6_daemons_s",
                       lambda: membership_convergence(lab, root, env, name)))
    for key, fn in others:
        try:
            out[key] = fn()
            if isinstance(out[key], float):
                say(f"{name}: {key} {out[key]:.1f}")
        except Exception as exc:
            out[key] = None
            out["errors"][key] = f"{type(exc).__name__}: {exc}"
            say(f"{name}: {key} failed: {exc}")
    return out


def allreduce_bus_bandwidth(lab: WanLab, name: str) -> dict[str, Any]:
    """3 peers average ``ALLREDUCE_MB`` MB; see the module docstring."""
    from wan_peer import start_group

    n = len(AVERAGERS)
    peers = start_group(lab, list(AVERAGERS), "allreduce", "--mb", str(ALLREDUCE_MB),
                        "--codec", "none", "--rounds", str(1 + ALLREDUCE_ROUNDS),
                        "--gap", "2", stderr=subprocess.DEVNULL)
    try:
        rounds = [[p.line(600) for _ in range(1 + ALLREDUCE_ROUNDS)] for p in peers]
        links = [p.line(60)["links"] for p in peers]
    finally:
        for p in peers:
            p.close()
    failed = [r for per in rounds for r in per if not r["ok"]]
    # per peer: its best measured round (the warm-up round 0 includes dials and slow start)
    best = [min(r["seconds"] for r in per[1:] if r["ok"]) if any(r["ok"] for r in per[1:])
            else None for per in rounds]
    seconds = statistics.median([b for b in best if b is not None]) if any(best) else None
    data = ALLREDUCE_MB * 1e6
    bus = None if not seconds else data / seconds * 2 * (n - 1) / n / 1e6
    cap = bottleneck_MBps(name)
    out = {"peers": n, "MB": ALLREDUCE_MB, "codec": "none", "round_seconds": seconds,
           "rounds_seconds": [[r["seconds"] for r in per] for per in rounds],
           "deadlines_s": [[r["deadline_s"] for r in per] for per in rounds],
           "failed_rounds": len(failed), "bus_bandwidth_MBps": bus, "link_MBps": cap,
           "bus_bandwidth_vs_link_rate": None if bus is None or cap is None else bus / cap,
           "measured_bandwidth_MBps": [sorted(round(v["bandwidth_bytes_s"] / 1e6, 2)
                                              for v in ls["peers"].values()
                                              if v["bandwidth_bytes_s"]) for ls in links]}
    say(f"{name}: all-reduce of {ALLREDUCE_MB:g} MB among {n}: {seconds} s, bus "
        f"{bus} MB/s, {out['bus_bandwidth_vs_link_rate']} of the link rate")
    return out


def set_profile(lab: WanLab, name: str) -> Link:
    link = link_of(name)
    for h in lab.hosts:
        lab.set_link(h, rate_down=link.down_mbit, rate_up=link.up_mbit, delay_ms=link.delay_ms,
                     loss=0.0)
    return link


def measure_allreduce_only(profiles: list[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    with WanLab(hosts=[HostSpec(name=h) for h in AVERAGERS]) as lab:
        for name in profiles:
            set_profile(lab, name)
            try:
                results[name] = {"allreduce": allreduce_bus_bandwidth(lab, name)}
            except Exception as exc:
                results[name] = {"errors": {"allreduce": f"{type(exc).__name__}: {exc}"}}
    return {"profiles": results, "targets": {
        f"allreduce_bus_ge_0.7x_link_{n}": r["allreduce"]["bus_bandwidth_vs_link_rate"] >= 0.7
        for n, r in results.items() if PROFILES[n] and r.get("allreduce", {}).get(
            "bus_bandwidth_vs_link_rate") is not None},
        "cores": os.cpu_count(), "loadavg": os.getloadavg()[0],
        "seconds": time.monotonic() - t0}


#: pipeline tokens/s of unshaped, per profile (issue 11 asked 0.85 on far; issue 24 asks 0.9 on
#: both, with the default settings)
PIPELINE_TARGETS = {"far": 0.9, "continent": 0.9}
#: issue 11: one transport stream of raw TCP on the same link, every shaped profile
TRANSPORT_TARGET = 0.9
#: issue 11: stage all-reduce bus bandwidth of the link rate, on these profiles (the others are
#: measured, with no target: on ``region`` the 3 processes' CPU, not the link, sets the pace)
ALLREDUCE_TARGETS = {"continent": 0.7, "far": 0.7}


def _targets(results: dict[str, Any]) -> dict[str, bool]:
    """The lab's own checks (RTT, raw TCP near the link rate), the transport's, the
    all-reduce's and the pipeline's targets (tokens/s of unshaped, nothing lost)."""
    return {
        **{f"pipeline_ge_{v}x_unshaped_{n}": (results[n].get("pipeline_ratio_vs_unshaped")
                                              or 0.0) >= v
           for n, v in PIPELINE_TARGETS.items() if n in results},
        **{f"pipeline_lost_0_{n}": r["pipeline"]["lost"] == 0 for n, r in results.items()},
        **{f"rtt_within_20pct_{n}": abs(r["rtt_ms"] - 2 * PROFILES[n][0]) <= 0.2 * 2 *
           PROFILES[n][0] + 2.0 for n, r in results.items() if PROFILES[n]},
        **{f"raw_tcp_ge_0.6x_link_{n}": r["raw_tcp_vs_link_rate"] >= 0.6
           for n, r in results.items() if r["raw_tcp_vs_link_rate"] is not None},
        # unshaped, raw TCP runs at memory speed and the transport is CPU-bound: no target
        **{f"transport_ge_{TRANSPORT_TARGET}x_raw_tcp_{n}":
           r["transport_vs_raw_tcp"] >= TRANSPORT_TARGET for n, r in results.items() if PROFILES[n]},
        **{f"allreduce_bus_ge_{v}x_link_{n}": ((results[n].get("allreduce") or {}).get(
               "bus_bandwidth_vs_link_rate") or 0.0) >= v
           for n, v in ALLREDUCE_TARGETS.items() if n in results},
    }


def pipeline_again(lab: WanLab, profiles: list[str], results: dict[str, Any], *, root: Path,
                   stages: list[daemons.LabDaemon], bootstrap: str, env: dict[str, str],
                   steps: int, tokens_per_step: int, rounds: int) -> None:
    """``rounds`` more rounds of pipeline runs (unshaped first, then each profile), each
    appended to its profile's ``pipeline_runs_tokens_per_s``; a failed run is reported."""
    for r in range(1, 1 + rounds):
        for name in profiles:
            set_profile(lab, name)
            out = results[name]
            try:
                t = train_counted(lab, stages, root / f"trainer-{name}-{r}", bootstrap, steps,
                                  tokens_per_step, env)
            except Exception as exc:
                out["errors"][f"pipeline_round_{r}"] = f"{type(exc).__name__}: {exc}"
                out["pipeline_runs_tokens_per_s"].append(None)
                out["pipeline_runs_others_cpu_share"].append(None)
                out["pipeline_runs_delayer_cpu_share"].append(None)
                out["pipeline_rounds_steps_started_early"].append(None)
                continue
            rate = t["rate"]
            out["pipeline_runs_tokens_per_s"].append(rate)
            out["pipeline_runs_others_cpu_share"].append(t["cpu"]["others_share"])
            out["pipeline_runs_delayer_cpu_share"].append(t["cpu"]["delayer_share"])
            out.setdefault("pipeline_rounds_step_seconds", []).append(
                t.get("steady_step_seconds"))
            out.setdefault("pipeline_rounds_step_phases", []).append(
                t.get("steady_step_phases"))
            out["pipeline"]["lost"] += t.get("lost") or 0
            out.setdefault("pipeline_rounds_stages", []).append(t["stages"])
            out["pipeline_rounds_steps_started_early"].append(t.get("steps_started_early"))
            say(f"{name}: pipeline (round {r + 1}) {rate:,.0f} tokens/s")


def pipeline_ratios(results: dict[str, Any]) -> None:
    """Each profile's ``pipeline_ratios`` (a round's run over the same round's unshaped run)
    and ``pipeline_ratio_vs_unshaped``, their median; ``pipeline_contended_rounds``: the
    rounds (from 0) in which other processes used more than ``CONTENDED_SHARE`` of the
    machine during this profile's run or the unshaped one (their ratio says little)."""
    unshaped = results.get("unshaped", {})
    base = unshaped.get("pipeline_runs_tokens_per_s") or []
    base_others = unshaped.get("pipeline_runs_others_cpu_share") or []
    for r in results.values():
        runs = r.get("pipeline_runs_tokens_per_s") or []
        r["pipeline_ratios"] = [a / b for a, b in zip(runs, base) if a and b]
        r["pipeline_ratio_vs_unshaped"] = (statistics.median(r["pipeline_ratios"])
                                           if r["pipeline_ratios"] else None)
        others = r.get("pipeline_runs_others_cpu_share") or []
        r["pipeline_contended_rounds"] = [
            i for i, pair in enumerate(zip(others, base_others))
            if any(x is not None and x > CONTENDED_SHARE for x in pair)]


def measure(quick: bool, profiles: list[str], membership: bool = True,
            overrides: dict[str, str] | None = None, repeats: int = 1,
            steps: int | None = None, secondary: bool = True,
            after_profile: Callable[[str, dict[str, Any]], None] | None = None
            ) -> dict[str, Any]:
    """``overrides``: configuration for the daemons and the trainer (``SWARMD_*``);
    ``repeats``: pipeline runs per profile (``pipeline_again``); ``steps``: the trainer's
    (default 40, 10 ``quick``); ``secondary``: the join time and the all-reduce too;
    ``after_profile(name, result)``: called after each profile's first measurement (before
    the next profile's link is set)."""
    from swarmd.models.registry import model_config_of
    from bench_pipeline import bench_env

    from swarmd.config import load_config

    t0 = time.monotonic()
    load_before = os.getloadavg()
    env = {**bench_env("demo"), **(overrides or {})}
    env["SWARMD_SWARM_NAME"] = f"bench-wan-{secrets.token_hex(4)}"
    config = load_config(None, {**os.environ, **env})
    mc = model_config_of(config)
    tokens_per_step = config.training.microbatches * config.training.batch_size * mc.seq_len
    default_steps, stream_s = (10, 2.0) if quick else (40, 6.0)
    steps = steps or default_steps
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-wan-") as tmp, \
            WanLab(hosts=[HostSpec(name=h) for h in HOSTS + AVERAGERS
                          + (MEMBERS if membership else ())]) as lab:
        root = Path(tmp)
        started: list[daemons.LabDaemon] = []
        server_proc = None
        try:
            s0 = daemons.LabDaemon(lab, "s0", root / "s0", "--stage", "0", env=env)
            started.append(s0)
            s0.wait_started()
            s1 = daemons.LabDaemon(lab, "s1", root / "s1", "--stage", "1", "--bootstrap",
                                   s0.addr, env=env)
            started.append(s1)
            s1.wait_started()
            server_proc, server = start_stream_server(lab)
            for name in profiles:
                results[name] = measure_profile(
                    lab, name, root=root, server=server, stages=[s0, s1], bootstrap=s0.addr,
                    env=env, steps=steps, tokens_per_step=tokens_per_step, stream_s=stream_s,
                    membership=membership, secondary=secondary)
                if after_profile is not None:
                    after_profile(name, results[name])
            pipeline_again(lab, profiles, results, root=root, stages=[s0, s1],
                           bootstrap=s0.addr, env=env, steps=steps,
                           tokens_per_step=tokens_per_step, rounds=repeats - 1)
            counters, whole_gso = lab.counters(), lab.whole_gso
        finally:
            if server_proc is not None and server_proc.stdin:
                server_proc.stdin.close()
            daemons.stop_all(started)
    pipeline_ratios(results)
    return {
        "model": {"width": mc.width, "layers": mc.layers, "seq_len": mc.seq_len,
                  "batch_size": config.training.batch_size,
                  "microbatches": config.training.microbatches, "codec": config.wire.codec,
                  "tokens_per_step": tokens_per_step, "trainer_steps": steps,
                  "step_drains": config.serving.step_drains, "repeats": repeats},
        "profiles": results,
        "delayer_counters": counters.get("counters"),
        "delayer_whole_gso": whole_gso,
        "not_measured": NOT_MEASURED + ([] if membership else [
            "membership_convergence_6_daemons_s (--no-membership)"]),
        "targets": _targets(results),
        "cores": os.cpu_count(),
        "loadavg_before_after": [load_before[0], os.getloadavg()[0]],
        "seconds": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    parser.add_argument("--profiles", default=",".join(DEFAULT_PROFILES),
                        help=f"comma-separated, from {','.join(PROFILES)} (unshaped is always "
                             f"measured first: the ratios need it)")
    parser.add_argument("--no-membership", action="store_true",
                        help="skip the 6-daemon membership convergence (the slowest part)")
    parser.add_argument("--allreduce-only", action="store_true",
                        help="only the 3-peer all-reduce bus bandwidth, per profile")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pipeline runs per profile, in rounds; ratios are medians of "
                             "each round's pair")
    parser.add_argument("--bandwidth-bound", action="store_true",
                        help="issue 26: the wide model over the 'uplink' profile against "
                             "unshaped, per --widths (tools/bench_wan_bandwidth.py)")
    parser.add_argument("--widths", default="512",
                        help="with --bandwidth-bound: model widths, comma-separated (a sweep "
                             "at one link)")
    parser.add_argument("--uplink-mbit", type=float, default=0.0,
                        help="with --bandwidth-bound: the uplink profile's rate (both ways); "
                             "0 (default): chosen from the first unshaped run so that an int8 "
                             "hop's transfer takes 2.5x its compute")
    parser.add_argument("--codecs", default="int8",
                        help="with --bandwidth-bound: wire.codec values, comma-separated, "
                             "each measured at every width")
    parser.add_argument("--steps", type=int, help="trainer steps per run (default 40; "
                        "--bandwidth-bound: 3, of the default 64 microbatches)")
    add_schedule_options(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    wanted = [p for p in args.profiles.split(",") if p]
    unknown = [p for p in wanted if p not in PROFILES]
    if unknown:
        parser.error(f"unknown profiles {unknown}")
    profiles = ["unshaped"] + [p for p in wanted if p != "unshaped"]
    try:
        WanLab.check()
    except LabUnavailable as exc:
        print(json.dumps({"unavailable": str(exc)}))
        return 2
    if args.bandwidth_bound:
        from bench_wan_bandwidth import measure_bandwidth_bound

        try:
            widths = [int(w) for w in args.widths.split(",") if w]
        except ValueError:
            parser.error(f"--widths {args.widths!r}: comma-separated integers")
        if not widths or min(widths) < 8 or not args.uplink_mbit >= 0:
            parser.error("--widths must name widths >= 8 and --uplink-mbit must be >= 0")
        result = measure_bandwidth_bound(widths, uplink_mbit=args.uplink_mbit,
                                         steps=args.steps or 3, repeats=args.repeats,
                                         codecs=tuple(c for c in args.codecs.split(",") if c),
                                         overrides=schedule_overrides(args))
    elif args.allreduce_only:
        result = measure_allreduce_only(wanted)
    else:
        result = measure(args.quick, profiles, membership=not args.no_membership,
                         overrides=schedule_overrides(args), repeats=args.repeats,
                         steps=args.steps)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
