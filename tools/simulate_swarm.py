"""Virtual-time simulation of stage balancing under churn, with the daemon's own policy code.

    python tools/simulate_swarm.py --peers 10000 --stages 8 --hours 24 --churn 0.2 --seed 1 --json

Other tools and tests import ``simulate`` (with ``tools/`` on ``sys.path``). With ``--json`` the
last line of stdout is one JSON object; ``--check`` exits 1 when a target is missed.

Compared in the same run, on the same timeline of events: ``none`` (peers stay where they were
placed), ``petals`` (Petals' rule: every uniform(0, 2 x period) seconds, move to the stage with
the lowest total when current min / achievable min < 0.75; no hysteresis, never leaving a stage
without peers) and ``swarmd`` (:mod:`swarmd.balancing.policy`, the code the daemon runs).

What is modelled:

- **Peers** have a throughput in samples/s: a GPU class (T4 40%, L4 15%, A10G 15%, V100 15%,
  A100 15%; 1x to 4.5x a T4's 20 samples/s) times per-peer log-normal noise (sigma 0.15), and
  re-measured ``drift_per_hour`` times an hour at base x e^N(0, 0.05).
- **Joins** are placed by :func:`swarmd.balancing.placement.choose_stage` on planned totals, as the
  daemon's ``--stage auto`` does. A joining or migrating peer loads its stage's state for
  ``migration_s`` seconds and serves nothing meanwhile. The swarm starts with ``peers`` peers
  placed one by one, online.
- **Churn**: leaves and joins are Poisson processes, each ``churn`` x ``peers`` per hour, the
  leaver uniform among live peers. **Preemption waves**, ``waves_per_day`` at random times, each
  remove ``wave_fraction`` of the live peers at once; they come back as new peers 10-40 minutes
  later. At mid-run, ``drop_fraction`` (30%) of the peers of the bottleneck stage leave at once
  (they come back 30-60 minutes later): the recovery event.
- **Views are exact and current**: every peer sees every change at once (the policy's plan is
  deterministic and also copes with lagging views, but lag is not modelled here).
- **The optimum** at each moment is bounded from above, for the peers that could serve (online
  or migrating; joiners load whatever the policy): min over k < S of (total - k largest) /
  (S - k), which is >= the best min stage total of any assignment (the S - k stages without the
  k largest peers hold at most the rest). Fractions of it are therefore conservative. As a
  check of tightness, ``oracle.lpt_gap_max`` is the largest relative gap between this bound and
  an assignment that reaches it (largest-first onto the lowest stage), sampled 6 times a run.
- **Figures per policy**: ``mean_fraction_of_optimum`` (time average of min served stage total /
  upper bound), ``moves_per_peer_hour``, ``recovery_s`` (from the drop until the pipeline is
  back to >= 90% of the bound; None if never) and the same in check periods.

Cost: a check when the swarm-wide gain is at most the threshold says "stay" to every peer
(:func:`swarmd.balancing.policy.swarm_gain`), so checks are only simulated while it is above: a peer
whose check comes in a balanced swarm stops ticking; when an imbalance appears, each such peer
gets its next check at a uniformly random point of its next interval, with no confirmations
(what its skipped "stay" checks would have left). Petals likewise, on its 0.75 rule.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.balancing.policy import (  # noqa: E402
    Balancer, BalancingConfig, PeerLoad, SwarmLoad, swarm_gain,
)
from swarmd.balancing.placement import choose_stage  # noqa: E402

POLICIES = ("none", "petals", "swarmd")
#: (class, throughput relative to a T4, share of the swarm)
GPU_CLASSES = (("T4", 1.0, 0.40), ("L4", 1.4, 0.15), ("A10G", 1.8, 0.15), ("V100", 2.2, 0.15),
               ("A100", 4.5, 0.15))
T4_SAMPLES_PER_S = 20.0
RECOVERED = 0.90


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    peers: int
    stages: int
    hours: float
    #: leaves per hour as a fraction of ``peers`` (as many joins)
    churn: float
    seed: int
    #: seconds a joining or migrating peer loads its stage (state size / bandwidth)
    migration_s: float = 30.0
    waves_per_day: float = 3.0
    wave_fraction: float = 0.10
    drop_fraction: float = 0.30
    noise_sigma: float = 0.15
    drift_per_hour: float = 0.5
    drift_sigma: float = 0.05
    #: Petals' balance_quality
    petals_quality: float = 0.75

    def __post_init__(self) -> None:
        if self.peers < 2 * self.stages or self.stages < 1:
            raise ValueError("need stages >= 1 and peers >= 2 x stages")
        if not (self.hours > 0 and self.churn >= 0 and self.migration_s >= 0):
            raise ValueError("need hours > 0, churn >= 0, migration_s >= 0")
        if not (0 <= self.wave_fraction < 1 and 0 <= self.drop_fraction < 1):
            raise ValueError("wave_fraction and drop_fraction must be in [0, 1)")


# --------------------------------------------------------------------------- the timeline

def _throughput(rng: random.Random, sigma: float) -> float:
    u, rel = rng.random(), GPU_CLASSES[-1][1]
    for _, r, share in GPU_CLASSES:
        if u < share:
            rel = r
            break
        u -= share
    return T4_SAMPLES_PER_S * rel * math.exp(rng.gauss(0.0, sigma))


def _poisson_times(rng: random.Random, rate_per_s: float, end: float) -> list[float]:
    times, t = [], 0.0
    while rate_per_s > 0:
        t += rng.expovariate(rate_per_s)
        if t >= end:
            break
        times.append(t)
    return times


def timeline(sc: Scenario) -> tuple[list[float], list[tuple[float, str, tuple[Any, ...]]]]:
    """Initial throughputs and the events every policy sees: (time, kind, data), sorted."""
    rng = random.Random(sc.seed)
    end, n = sc.hours * 3600.0, sc.peers
    initial = [_throughput(rng, sc.noise_sigma) for _ in range(n)]
    events: list[tuple[float, str, tuple[Any, ...]]] = []
    rate = sc.churn * n / 3600.0
    events += [(t, "join", (_throughput(rng, sc.noise_sigma),))
               for t in _poisson_times(rng, rate, end)]
    events += [(t, "leave", (rng.random(),)) for t in _poisson_times(rng, rate, end)]
    events += [(t, "drift", (rng.random(), math.exp(rng.gauss(0.0, sc.drift_sigma))))
               for t in _poisson_times(rng, sc.drift_per_hour * n / 3600.0, end)]
    drop_at = end / 2
    for t in _poisson_times(rng, sc.waves_per_day / 86400.0, end):
        if not drop_at - 900 < t < drop_at + 1800:  # keep the recovery window clean
            events.append((t, "wave", (sc.wave_fraction, rng.getrandbits(32))))
    events.append((drop_at, "drop", (sc.drop_fraction, rng.getrandbits(32))))
    events.sort(key=lambda e: e[0])
    return initial, events


# --------------------------------------------------------------------------------- oracle

def optimum_upper_bound(total: float, largest: Sequence[float], stages: int) -> float:
    """>= the best min stage total over all assignments of peers to ``stages`` stages.

    ``total``: the peers' total throughput; ``largest``: the largest throughputs, descending
    (the ``stages - 1`` largest suffice). In any assignment the k largest peers sit on at most
    k stages, so some S - k stages share at most total - (k largest): min over k < S of
    (total - k largest) / (S - k). When no peer exceeds total / S this is total / S.
    """
    best, top = total / stages, 0.0
    for k in range(1, min(stages, len(largest) + 1)):
        top += largest[k - 1]
        best = min(best, (total - top) / (stages - k))
    return max(best, 0.0)


# ------------------------------------------------------------------------------- one run

class _Peer:
    __slots__ = ("pid", "stage", "base", "t", "state", "bal", "ticking")

    def __init__(self, pid: str, stage: int, base: float, state: str,
                 bal: Balancer | None) -> None:
        self.pid, self.stage, self.base, self.t, self.state = pid, stage, base, base, state
        self.bal, self.ticking = bal, False


class _Run:
    def __init__(self, sc: Scenario, policy: str, config: BalancingConfig) -> None:
        self.sc, self.policy, self.config = sc, policy, config
        self.rng = random.Random(sc.seed + 1)  # placement ties and check times
        self.load = SwarmLoad(sc.stages)
        self.peers: dict[str, _Peer] = {}
        self.live: list[str] = []            # for uniform picks: same order in every policy
        self.slot: dict[str, int] = {}
        self.idle: dict[str, None] = {}      # peers whose checks are not ticking (ordered)
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = self.next_pid = 0
        self.now = 0.0
        self.active = False
        self.migrating_total = 0.0
        self.t_cap = 0.0                     # largest throughput ever seen
        # figures
        self.frac = 1.0
        self.frac_integral = self.peer_seconds = 0.0
        self.frac_min = 1.0
        self.moves = 0
        self.drop_at: float | None = None
        self.recovery_s: float | None = None
        self.frac_after_drop: float | None = None
        self.lpt_gaps: list[float] = []
        self.counts = dict.fromkeys(("joins", "leaves", "wave_removed", "drop_removed",
                                     "drifts", "checks", "activations"), 0)

    # -- bookkeeping ---------------------------------------------------------------------

    def push(self, t: float, kind: str, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, data))

    def advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            self.frac_integral += dt * self.frac
            self.peer_seconds += dt * len(self.peers)
            self.now = t

    def upper_bound(self) -> float:
        """:func:`optimum_upper_bound` of the online and migrating peers."""
        s = self.sc.stages
        total = sum(self.load.served_totals()) + self.migrating_total
        if self.t_cap * s <= total:  # no peer above total / S: k = 0 is the least
            return total / s
        ts = sorted((p.t for p in self.peers.values() if p.state != "joining"), reverse=True)
        return optimum_upper_bound(total, ts[:s], s)

    def lpt_gap(self) -> float:
        """(bound - min of a largest-first assignment) / bound: how loose the bound can be."""
        ts = sorted((p.t for p in self.peers.values() if p.state != "joining"), reverse=True)
        stages = [(0.0, s) for s in range(self.sc.stages)]
        for t in ts:
            low, s = heapq.heappop(stages)
            heapq.heappush(stages, (low + t, s))
        ub = self.upper_bound()
        return (ub - stages[0][0]) / ub if ub > 0 else 0.0

    def changed(self) -> None:
        """After every change: the fraction of the optimum, recovery, and whether to tick."""
        ub = self.upper_bound()
        self.frac = min(self.load.served_totals()) / ub if ub > 0 else 1.0
        self.frac_min = min(self.frac_min, self.frac)
        if self.drop_at == self.now and self.frac_after_drop is None:
            self.frac_after_drop = self.frac
        if self.drop_at is not None and self.frac >= RECOVERED:
            self.recovery_s = self.now - self.drop_at
            self.drop_at = None
        active = self.imbalanced()
        if active and not self.active:
            self.counts["activations"] += 1
            for pid in self.idle:
                self.start_ticking(self.peers[pid], fresh=True)
            self.idle.clear()
        self.active = active

    def imbalanced(self) -> bool:
        if self.policy == "swarmd":
            return swarm_gain(self.load) > self.config.threshold
        if self.policy == "petals":
            planned = self.load.planned_totals()
            level = sum(planned) / len(planned)
            return level > 0 and min(planned) / level < self.sc.petals_quality
        return False

    # -- checks --------------------------------------------------------------------------

    def next_check(self, p: _Peer) -> float:
        if p.bal is not None:
            return p.bal.next_check_at(self.now, self.rng)
        return self.now + self.rng.uniform(0.0, 2.0 * self.config.check_period_s)

    def start_ticking(self, p: _Peer, fresh: bool) -> None:
        if fresh and p.bal is not None:
            p.bal.reset()
        at = self.next_check(p)
        if fresh:  # a uniformly random point of the interval it was in
            at = self.now + self.rng.random() * (at - self.now)
        p.ticking = True
        self.push(at, "check", p.pid)

    def check(self, pid: str) -> None:
        p = self.peers.get(pid)
        if p is None:
            return
        self.counts["checks"] += 1
        target = (p.bal.check(self.load, self.now) if p.bal is not None
                  else self.petals_decide(p))
        if target is not None:
            self.moves += 1
            self.set_state(p, "migrating", target)
            self.push(self.now + self.sc.migration_s, "ready", pid)
            self.changed()
        if self.active:
            p.ticking = True
            self.push(self.next_check(p), "check", pid)
        else:
            p.ticking = False
            self.idle[pid] = None

    def petals_decide(self, p: _Peer) -> int | None:
        """Petals' should_choose_other_blocks, for one-stage spans (see the module docstring)."""
        if p.state != "online" or self.load.online_counts()[p.stage] <= 1:
            return None
        planned = self.load.planned_totals()
        level = sum(planned) / len(planned)
        if level <= 0 or min(planned) / level >= self.sc.petals_quality:
            return None
        planned[p.stage] -= p.t
        best = min(range(len(planned)), key=lambda s: (planned[s], s))
        return None if best == p.stage else best

    # -- peers ---------------------------------------------------------------------------

    def set_state(self, p: _Peer, state: str, stage: int | None = None) -> None:
        if p.state == "migrating":
            self.migrating_total -= p.t
        p.state = state
        if stage is not None:
            p.stage = stage
        if state == "migrating":
            self.migrating_total += p.t
        self.load.set(PeerLoad(peer_id=p.pid, stage=p.stage, throughput=p.t, state=state))

    def add(self, base: float, online: bool) -> None:
        pid = f"p{self.next_pid:07d}"
        self.next_pid += 1
        stage = choose_stage(self.load.planned_totals(), self.load.planned_counts(), self.rng)
        bal = Balancer(pid, self.config) if self.policy == "swarmd" else None
        p = _Peer(pid, stage, base, "online" if online else "joining", bal)
        self.peers[pid] = p
        self.slot[pid] = len(self.live)
        self.live.append(pid)
        self.t_cap = max(self.t_cap, base)
        self.load.set(PeerLoad(peer_id=pid, stage=stage, throughput=base, state=p.state))
        if not online:
            self.push(self.now + self.sc.migration_s, "ready", pid)
        if self.policy == "none":
            return
        if self.active:
            self.start_ticking(p, fresh=False)
        else:
            self.idle[pid] = None

    def remove(self, pid: str) -> _Peer:
        p = self.peers.pop(pid)
        if p.state == "migrating":
            self.migrating_total -= p.t
        self.load.remove(pid)
        i = self.slot.pop(pid)
        last = self.live.pop()
        if last != pid:
            self.live[i] = last
            self.slot[last] = i
        self.idle.pop(pid, None)
        if not self.peers:
            self.migrating_total = 0.0
        return p

    def pick(self, u: float) -> _Peer:
        return self.peers[self.live[min(int(u * len(self.live)), len(self.live) - 1)]]

    # -- events --------------------------------------------------------------------------

    def apply(self, kind: str, data: Any) -> None:
        if kind == "check":
            self.check(data)
            return
        if kind == "ready":
            p = self.peers.get(data)
            if p is None:
                return
            self.set_state(p, "online")
        elif kind == "join":
            self.counts["joins"] += 1
            self.add(data[0], online=False)
        elif kind == "leave":
            if len(self.live) <= 2 * self.sc.stages:
                return
            self.counts["leaves"] += 1
            self.remove(self.pick(data[0]).pid)
        elif kind == "drift":
            self.counts["drifts"] += 1
            p = self.pick(data[0])
            old = p.t
            p.t = p.base * data[1]
            if p.state == "migrating":
                self.migrating_total += p.t - old
            self.t_cap = max(self.t_cap, p.t)
            self.load.set(PeerLoad(peer_id=p.pid, stage=p.stage, throughput=p.t, state=p.state))
        elif kind in ("wave", "drop"):
            self.burst(kind, data[0], random.Random(data[1]))
        self.changed()

    def burst(self, kind: str, fraction: float, rng: random.Random) -> None:
        if kind == "wave":
            k = round(fraction * len(self.live))
            victims = [self.live[i] for i in rng.sample(range(len(self.live)), k)]
            back = (600.0, 2400.0)
        else:  # the recovery event: a share of the bottleneck stage's peers
            served = self.load.served_totals()
            stage = min(range(len(served)), key=lambda s: (served[s], s))
            on_stage = [pid for pid in self.live if self.peers[pid].stage == stage]
            victims = rng.sample(on_stage, round(fraction * len(on_stage)))
            back = (1800.0, 3600.0)
        for pid in victims:
            base = self.remove(pid).base
            self.push(self.now + rng.uniform(*back), "rejoin", base)
        self.counts["wave_removed" if kind == "wave" else "drop_removed"] += len(victims)
        if kind == "drop":
            self.drop_at = self.now

    def run(self, initial: list[float],
            events: list[tuple[float, str, tuple[Any, ...]]]) -> dict[str, Any]:
        wall = time.perf_counter()
        for base in initial:
            self.add(base, online=True)
        self.changed()
        end = self.sc.hours * 3600.0
        samples = [end * (i + 0.5) / 6 for i in range(6)]
        i, heap = 0, self.heap
        while True:
            t_static = events[i][0] if i < len(events) else math.inf
            t_dyn = heap[0][0] if heap else math.inf
            t = min(t_static, t_dyn)
            while samples and samples[0] <= min(t, end):
                self.lpt_gaps.append(self.lpt_gap())
                samples.pop(0)
            if t >= end:
                break
            self.advance(t)
            if t_static <= t_dyn:
                _, kind, data = events[i]
                i += 1
            else:
                _, _, kind, data = heapq.heappop(heap)
                if kind == "rejoin":
                    kind, data = "join", (data,)
            self.apply(kind, data)
        self.advance(end)
        hours = self.peer_seconds / 3600.0
        period = self.config.check_period_s
        return {
            "mean_fraction_of_optimum": round(self.frac_integral / end, 4),
            "min_fraction_of_optimum": round(self.frac_min, 4),
            "moves": self.moves,
            "moves_per_peer_hour": round(self.moves / hours, 4) if hours else 0.0,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 1),
            "recovery_check_periods": (None if self.recovery_s is None
                                       else round(self.recovery_s / period, 2)),
            "fraction_after_drop": (None if self.frac_after_drop is None
                                    else round(self.frac_after_drop, 4)),
            "checks": self.counts["checks"],
            "activations": self.counts["activations"],
            "lpt_gap_max": round(max(self.lpt_gaps, default=0.0), 5),
            "events": {k: v for k, v in self.counts.items()
                       if k not in ("checks", "activations")},
            "final_peers": len(self.peers),
            "wall_s": round(time.perf_counter() - wall, 2),
        }


# ----------------------------------------------------------------------------- the report

def _targets(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    pol = out["policies"]
    sw = pol.get("swarmd")
    if sw is None:
        return {}
    t: dict[str, dict[str, Any]] = {}

    def target(name: str, value: Any, goal: str, ok: bool) -> None:
        t[name] = {"value": value, "target": goal, "ok": bool(ok)}

    target("swarmd_mean_fraction_of_optimum", sw["mean_fraction_of_optimum"], ">= 0.95",
           sw["mean_fraction_of_optimum"] >= 0.95)
    for other in ("none", "petals"):
        if other in pol:
            target(f"swarmd_above_{other}", sw["mean_fraction_of_optimum"],
                   f"> {pol[other]['mean_fraction_of_optimum']}",
                   sw["mean_fraction_of_optimum"] > pol[other]["mean_fraction_of_optimum"])
    target("swarmd_moves_per_peer_hour", sw["moves_per_peer_hour"], "<= 0.5",
           sw["moves_per_peer_hour"] <= 0.5)
    rec = sw["recovery_check_periods"]
    target("swarmd_recovery_check_periods", rec, "<= 3", rec is not None and rec <= 3)
    return t


def simulate(peers: int, stages: int, hours: float, churn: float, seed: int, *,
             policies: tuple[str, ...] = POLICIES, config: BalancingConfig | None = None,
             **scenario: Any) -> dict[str, Any]:
    """Run every policy on the same timeline; the figures as a JSON-able dict.

    ``scenario`` overrides :class:`Scenario` fields (``migration_s``, ``waves_per_day``...).
    """
    wall = time.perf_counter()
    sc = Scenario(peers=peers, stages=stages, hours=hours, churn=churn, seed=seed, **scenario)
    config = config or BalancingConfig()
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    initial, events = timeline(sc)
    out: dict[str, Any] = {
        "scenario": asdict(sc),
        "balancing": asdict(config),
        "oracle": "upper bound min_k<S (total - k largest) / (S - k), >= the true optimum; "
                  "lpt_gap_max: its largest gap to a largest-first assignment, sampled",
        "policies": {},
    }
    for policy in policies:
        out["policies"][policy] = _Run(sc, policy, config).run(initial, events)
    out["targets"] = _targets(out)
    out["wall_s"] = round(time.perf_counter() - wall, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--churn", type=float, default=0.2,
                    help="leaves per hour as a fraction of the swarm (as many joins)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--migration-s", type=float, default=30.0,
                    help="seconds a joining or migrating peer loads its stage")
    ap.add_argument("--threshold", type=float, default=BalancingConfig().threshold,
                    help="swarmd: move only for a larger relative gain of the minimum")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, from {', '.join(POLICIES)}")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args(argv)
    result = simulate(args.peers, args.stages, args.hours, args.churn, args.seed,
                      policies=tuple(p for p in args.policies.split(",") if p),
                      config=BalancingConfig(threshold=args.threshold),
                      migration_s=args.migration_s)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    if args.check and not all(t["ok"] for t in result["targets"].values()):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
