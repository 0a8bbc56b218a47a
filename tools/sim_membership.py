"""Virtual-time simulation of swarmd membership at up to ~10^5 peers, with the real code.

    python tools/sim_membership.py --peers 10000 --stages 8 --hours 2 --churn 0.2 --seed 1 --json

Other tools import ``simulate`` (with ``tools/`` on ``sys.path``).

What runs for real and what is modelled:

- **Every peer** runs the real ``Schedule`` (adaptive period, jitter, the gossip token bucket)
  and really signs and encodes each announcement (``encode_signed``). Peers estimate the swarm
  size as the true live count (observers: as the size of their own view).
- **Observers** (``observers`` permanent peers, 12 by default) also run a real ``View``: every
  announcement reaching them goes through ``View.apply_page``/``View.apply`` (decoding,
  signature check, staleness, expiry, overdue, tombstones), they build real digests with
  ``View.pull_request`` at every pull their ``Schedule`` orders, and every metric below is
  read from their views. Keeping 10,000 full views would cost ~10^9 entry updates.
- **Dissemination to an observer is modelled** as the pull epidemic the design runs (each peer
  pulls one uniformly random peer every P seconds): in the mean-field limit the fraction of
  peers holding a version t seconds after it was signed is x(t) = 1 / (1 + (n-1) e^(-t/P)),
  so the observer's pulls find it after a delay d with P(d > t) = n / (e^(t/P) + n - 1); we
  sample d = P ln(n (e^E - 1) + 1), E ~ Exp(1), and hand the version over at the observer's
  first pull at or after signing + d, if that pull's window (cutoff = now - W) still covers it
  and the observer's digest does not already hold it (else it is counted as missed).
  Gossiped events (when a peer's token bucket allows) reach observers 20-300 ms later.
- **Traffic of an observer** is counted in bytes on the wire: pages it receives (their real
  encoded size), its own requests (real encoded size, digest included), and the requests it
  serves: as many as a Poisson draw with mean (time since its last pull) / P, each as large as
  its own request in and as its own last page out (its neighbours hold the same window), plus
  ``message_overhead_bytes`` per message (stream framing). A gossiped message costs every peer
  ``gossip_cost`` in and out: D copies of message + envelope (mesh duplicates) and D x history
  IHAVE ids. The budget is checked on inbound bytes; outbound is reported too.
- **Churn**: leaves and joins are two Poisson processes, each at ``churn_per_hour`` x N per
  hour (N stays about constant). A leaver is graceful (signed ``leaving``) or killed (silent,
  ``kill_fraction``). A joiner announces ``joining`` at once and ``online`` 30 s later.
  Observers never leave. The swarm starts in steady state: all peers online at random phases
  of their period, plus the entries of peers killed during the previous expiry horizon.
- **Throughput drift**: each peer's throughput is base x e^X, base log-normal (median 100
  samples/s, sigma 0.5), X an Ornstein-Uhlenbeck process (stationary std ``drift``, correlation
  time ``drift_tau_s``), independent across peers. Truth of a stage = sum over its live online
  peers of their current throughput; an observer's figure = ``View.stage_totals``.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.membership import (  # noqa: E402
    Announcement, PeerState, PullPage, Schedule, ScheduleConfig, SwarmEstimate, View, ViewConfig,
    decode_page, encode_page, encode_request, encode_signed, fingerprint, plan,
)
from swarmd.membership.schedule import gossip_cost  # noqa: E402

T0 = 1.7e9  # virtual epoch: timestamps of a realistic size
MODEL_HASH = "5ca1ab1e0ddba11d"
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _key(pid: str) -> bytes:
    return pid.encode()[-64:]


def _verify(pid: str, body: bytes, sig: bytes) -> bool:
    return hashlib.blake2b(body, key=_key(pid), digest_size=64).digest() == sig


class _Peer:
    __slots__ = ("pid", "addr", "stage", "base", "x", "x_at", "state", "alive", "leaving",
                 "event", "sched", "obs", "joined_at", "died_at", "killed", "period", "sign",
                 "slot")

    def __init__(self, pid: str, number: int, stage: int, base: float, x: float,
                 now: float) -> None:
        self.pid, self.stage, self.base, self.x, self.x_at = pid, stage, base, x, now
        octets = (number // 62500 % 250, number // 250 % 250, number % 250)
        self.addr = "/ip4/10.{}.{}.{}/tcp/31337".format(*octets)
        self.state = PeerState.ONLINE
        self.alive, self.leaving, self.event, self.killed = True, False, False, False
        self.sched: Schedule = None  # type: ignore[assignment]  # set right after
        self.obs: _Observer | None = None
        self.joined_at, self.died_at, self.period = now, math.inf, 0.0
        self.slot = -1
        key = _key(pid)
        self.sign = lambda body: hashlib.blake2b(body, key=key, digest_size=64).digest()


_TRAFFIC_KEYS = ("in_entries", "in_digests", "in_framing", "in_gossip",
                 "out_entries", "out_digests", "out_framing", "out_gossip")


class _Observer:
    def __init__(self, peer: _Peer, view: View, now: float) -> None:
        self.peer, self.view = peer, view
        self.pending: list[tuple[float, int, float, bytes]] = []  # (arrival, seq, ts, wire)
        self.last_pull = now
        self.bytes = dict.fromkeys(_TRAFFIC_KEYS, 0.0)
        self.mark = dict.fromkeys(_TRAFFIC_KEYS, 0.0)


class _Sim:
    def __init__(self, peers: int, stages: int, hours: float, churn_per_hour: float, seed: int,
                 observers: int, kill_fraction: float, drift: float, drift_tau_s: float,
                 join_delay_s: float, samples: int, config: ScheduleConfig) -> None:
        self.n0, self.stages, self.hours = peers, stages, hours
        self.kill_fraction, self.drift, self.tau = kill_fraction, drift, drift_tau_s
        self.join_delay_s = join_delay_s
        self.cfg = config
        self.rng = random.Random(seed)
        self.vcfg = ViewConfig(stages=stages, model_hash=MODEL_HASH,
                               min_period_s=config.base_period_s,
                               max_period_s=config.max_period_s, min_gap_s=config.min_gap_s,
                               expiry_periods=config.expiry_periods)
        self.end = T0 + hours * 3600.0
        self.churn_rate = churn_per_hour * peers / 3600.0  # leaves/s, and joins/s
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.by_pid: dict[str, _Peer] = {}
        self.movable: list[_Peer] = []   # live non-observers not leaving, for uniform picks
        self.observers: list[_Observer] = []
        self.live = 0                    # alive and not leaving
        self.wire_mean = 205.0
        self.stats = dict.fromkeys(("versions", "gossiped", "pull_missed", "joins",
                                    "graceful_leaves", "kills", "live_expired"), 0)
        self.gossip_bytes = self.gossip_mark = 0.0   # per peer, each direction
        self.kill_removal_periods: list[float] = []
        self.leave_delays: list[float] = []
        self.join_delays: list[float] = []
        self.errors: list[float] = []
        self.ages_mean: list[float] = []
        self.ages_max = 0.0
        self.dead_listed: list[float] = []
        self.dead_routable: list[float] = []
        self.missing: list[float] = []
        self._setup(observers, samples)

    # ----------------------------------------------------------------------------- helpers

    def push(self, t: float, kind: str, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def new_peer(self, now: float) -> _Peer:
        rng = self.rng
        pid = "12D3KooW" + "".join(rng.choice(_B58) for _ in range(44))
        p = _Peer(pid, len(self.by_pid), rng.randrange(self.stages),
                  100.0 * math.exp(rng.gauss(0.0, 0.5)), rng.gauss(0.0, self.drift), now)
        self.by_pid[pid] = p
        return p

    def throughput(self, p: _Peer, now: float) -> float:
        dt = now - p.x_at
        if dt > 0:
            decay = math.exp(-dt / self.tau)
            p.x = p.x * decay + self.drift * math.sqrt(1 - decay * decay) * self.rng.gauss(0, 1)
            p.x_at = now
        return p.base * math.exp(p.x)

    def announcement(self, p: _Peer, now: float, period: float) -> bytes:
        ann = Announcement(peer_id=p.pid, addrs=(p.addr,), stage=p.stage, state=p.state,
                           throughput=round(self.throughput(p, now), 2),
                           queue=self.rng.randrange(4), version="0.1.0", model_hash=MODEL_HASH,
                           timestamp=now, period=period)
        wire = encode_signed(ann, p.sign)
        self.wire_mean += (len(wire) - self.wire_mean) / 256
        return wire

    def estimate(self, p: _Peer | None, now: float) -> SwarmEstimate:
        """What ``p`` knows of the swarm: an observer reads its view; the others know the live
        count and use observer 0's event rate (their views would show the same)."""
        if p is not None and p.obs:
            return p.obs.view.estimate(now)
        events = self.observers[0].view.estimate(now).events_per_s if self.observers else 0.0
        return SwarmEstimate(peers=max(self.live, 1), wire_bytes=self.wire_mean,
                             events_per_s=events)

    def poisson(self, lam: float) -> int:
        limit, k, prod = math.exp(-lam), 0, self.rng.random()
        while prod > limit:
            k += 1
            prod *= self.rng.random()
        return k

    def schedule_announce(self, p: _Peer) -> None:
        self.push(p.sched.next_announce_at, "announce", (p, p.sched.next_announce_at))

    # ------------------------------------------------------------------------------- setup

    def _setup(self, n_obs: int, samples: int) -> None:
        cfg, rng = self.cfg, self.rng
        # events/s in steady state: a joiner's first and "online" announcements, graceful leaves
        events = self.churn_rate * (2.0 + (1.0 - self.kill_fraction))
        est0 = SwarmEstimate(peers=self.n0, wire_bytes=self.wire_mean, events_per_s=events)
        plan0 = plan(est0, cfg)
        initial: list[bytes] = []
        for i in range(self.n0):
            p = self.new_peer(T0)
            self.live += 1
            last = T0 - rng.uniform(0.0, plan0.period_s * (1 - cfg.jitter))
            p.joined_at = last - rng.uniform(0.0, 3600.0)
            p.sched = Schedule(cfg, now=last, rng=rng)
            p.period = p.sched.announce(last, est0)
            p.sched.may_gossip(T0, est0)  # its token bucket starts now, empty
            initial.append(self.announcement(p, last, p.period))
            p.x_at = T0
            if i < n_obs:
                p.obs = _Observer(p, View(self.vcfg, _verify), T0)
                self.observers.append(p.obs)
            else:
                p.slot = len(self.movable)
                self.movable.append(p)
            self.schedule_announce(p)
        # peers killed during the last expiry horizon still have entries in every view
        kill_rate = self.churn_rate * self.kill_fraction
        horizon = plan0.expiry_s
        for _ in range(round(kill_rate * horizon)):
            ghost = self.new_peer(T0)
            ghost.alive, ghost.killed = False, True
            ghost.died_at = T0 - rng.uniform(0.0, horizon)
            ghost.period = plan0.period_s
            initial.append(self.announcement(ghost, ghost.died_at - rng.uniform(0, ghost.period),
                                             ghost.period))
        for o in self.observers:  # observers joined long ago: they hold the whole view
            for wire in initial:
                o.view.apply(wire, T0)
            order = o.peer.sched.pull(T0, o.view.estimate(T0), ("bootstrap",))
            assert order is not None
            o.peer.sched.pulled(T0, order, ok=True)
            self.push(o.peer.sched.next_pull_at, "pull", o)
        if self.churn_rate > 0:
            self.push(T0 + rng.expovariate(self.churn_rate), "leave", None)
            self.push(T0 + rng.expovariate(self.churn_rate), "join", None)
        self.warmup = min(0.25 * self.hours * 3600.0, plan0.period_s)
        span = self.hours * 3600.0 - self.warmup
        for k in range(samples):
            self.push(T0 + self.warmup + (k + 1) * span / samples - 1e-3, "sample", None)
        self.push(T0 + self.warmup, "mark", None)

    # ------------------------------------------------------------------------------ events

    def run(self) -> None:
        handlers = {"announce": self.on_announce, "online": self.on_online,
                    "leave": self.on_leave, "join": self.on_join, "gossip": self.on_gossip,
                    "pull": self.on_pull, "sample": self.on_sample, "mark": self.on_mark}
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            if now > self.end:
                break
            handlers[kind](now, data)

    def on_announce(self, now: float, data: tuple[_Peer, float]) -> None:
        p, due = data
        if not p.alive or p.sched.next_announce_at != due:
            return
        p.period = p.sched.announce(now, self.estimate(p, now))
        event, p.event = p.event or p.state is not PeerState.ONLINE, False
        if p.leaving:
            p.state = PeerState.LEAVING
        self.disseminate(p, self.announcement(p, now, p.period), now, event)
        if p.leaving:
            p.alive, p.died_at = False, now
        else:
            self.schedule_announce(p)

    def disseminate(self, p: _Peer, wire: bytes, now: float, event: bool) -> None:
        self.stats["versions"] += 1
        if p.obs:
            p.obs.view.apply(wire, now)
        gossip = event and p.sched.may_gossip(now, self.estimate(p, now))
        if gossip:
            self.stats["gossiped"] += 1
            self.gossip_bytes += gossip_cost(self.cfg, len(wire))
        pull_s = plan(self.estimate(None, now), self.cfg).pull_s
        n, rng = max(self.live, 2), self.rng
        for o in self.observers:
            if o is p.obs:
                continue
            if gossip:
                self.push(now + rng.uniform(0.02, 0.3), "gossip", (o, wire))
            else:
                delay = pull_s * math.log(n * math.expm1(rng.expovariate(1.0)) + 1.0)
                heapq.heappush(o.pending, (now + delay, self.seq, now, wire))
                self.seq += 1

    def on_online(self, now: float, p: _Peer) -> None:
        if p.alive and not p.leaving:
            p.state, p.event = PeerState.ONLINE, True
            p.sched.changed(now)
            self.schedule_announce(p)

    def on_leave(self, now: float, _: None) -> None:
        self.push(now + self.rng.expovariate(self.churn_rate), "leave", None)
        if not self.movable:
            return
        p = self.movable[self.rng.randrange(len(self.movable))]
        last = self.movable.pop()
        if last is not p:
            self.movable[p.slot] = last
            last.slot = p.slot
        self.live -= 1
        if self.rng.random() < self.kill_fraction:
            self.stats["kills"] += 1
            p.alive, p.killed, p.died_at = False, True, now
        else:
            self.stats["graceful_leaves"] += 1
            p.leaving, p.event = True, True
            p.sched.changed(now)
            self.schedule_announce(p)

    def on_join(self, now: float, _: None) -> None:
        self.push(now + self.rng.expovariate(self.churn_rate), "join", None)
        self.stats["joins"] += 1
        p = self.new_peer(now)
        p.state = PeerState.JOINING
        p.slot = len(self.movable)
        self.movable.append(p)
        self.live += 1
        p.sched = Schedule(self.cfg, now=now, rng=self.rng)
        self.schedule_announce(p)
        self.push(now + self.join_delay_s, "online", p)

    def on_gossip(self, now: float, data: tuple[_Observer, bytes]) -> None:
        o, wire = data
        self.track(o.view.apply(wire, now), now)

    def track(self, res: Any, now: float) -> None:
        p = self.by_pid.get(res.peer_id or "")
        if p is None:
            return
        if res.outcome == "added" and p.joined_at > T0 and now - p.joined_at < 600:
            self.join_delays.append(now - p.joined_at)
        elif res.outcome == "removed":
            self.leave_delays.append(now - p.died_at)

    def on_pull(self, now: float, o: _Observer) -> None:
        view, cfg = o.view, self.cfg
        for ann in view.expire(now):
            p = self.by_pid[ann.peer_id]
            if p.killed:  # when it left the view (snapshots skip expired entries at once)
                period = min(max(ann.period, self.vcfg.min_period_s), self.vcfg.max_period_s)
                gone_at = ann.timestamp + self.vcfg.expiry_periods * period
                self.kill_removal_periods.append((gone_at - p.died_at) / p.period)
            elif p.alive:
                self.stats["live_expired"] += 1
        order = o.peer.sched.pull(now, view.estimate(now), ("neighbour",))
        self.push(o.peer.sched.next_pull_at, "pull", o)
        assert order is not None and order.cutoff is not None
        request = view.pull_request(now, order.cutoff)
        request_bytes = len(encode_request(request))
        wires: list[bytes] = []
        while o.pending and o.pending[0][0] <= now:
            _, _, ts, wire = heapq.heappop(o.pending)
            if ts < request.cutoff:  # type: ignore[operator]
                self.stats["pull_missed"] += 1
            elif fingerprint(wire) not in request.have:
                wires.append(wire)
        page_bytes, pages = 0, 0
        limit = self.vcfg.limits.max_page_bytes - 1024
        while True:  # at least one page, even empty
            chunk, size = [], 0
            while wires and size + len(wires[-1]) < limit:
                size += len(wires[-1]) + 3
                chunk.append(wires.pop())
            data = encode_page(PullPage(entries=tuple(chunk), next_cursor=None))
            page_bytes += len(data)
            pages += 1
            results, _ = view.apply_page(data, now)
            for res in results:
                self.track(res, now)
            if not wires:
                break
        served = self.poisson((now - o.last_pull) / plan(self.estimate(None, now), cfg).pull_s)
        o.last_pull = now
        h = cfg.message_overhead_bytes
        b = o.bytes
        b["in_entries"] += page_bytes
        b["out_digests"] += request_bytes * pages
        b["in_digests"] += served * request_bytes
        b["out_entries"] += served * page_bytes
        b["in_framing"] += h * (pages + served)
        b["out_framing"] += h * (pages + served)
        o.peer.sched.pulled(now, order, ok=True)

    def on_mark(self, now: float, _: None) -> None:
        for o in self.observers:
            o.mark = dict(o.bytes)
        self.gossip_mark = self.gossip_bytes

    def on_sample(self, now: float, _: None) -> None:
        truth = [0.0] * self.stages
        live = [o.peer for o in self.observers] + self.movable
        for p in live:
            if p.state is PeerState.ONLINE:
                truth[p.stage] += self.throughput(p, now)
        by_pid = self.by_pid
        for o in self.observers:
            totals = o.view.stage_totals(now)
            self.errors.append(max(abs(t - r) / r for t, r in zip(totals, truth) if r > 0))
            anns = o.view.announcements(now)
            age_sum, oldest, dead, dead_routable = 0.0, now, 0, 0
            for a in anns:
                age_sum += a.timestamp
                if a.timestamp < oldest:
                    oldest = a.timestamp
                q = by_pid[a.peer_id]
                if not q.alive or q.leaving:
                    dead += 1
                    dead_routable += o.view.why_not(a.peer_id, now) is None
            self.ages_mean.append(now - age_sum / len(anns))
            self.ages_max = max(self.ages_max, now - oldest)
            self.dead_listed.append(dead / len(anns))
            self.dead_routable.append(dead_routable / len(anns))
            self.missing.append((len(live) - (len(anns) - dead)) / len(live))

    # ------------------------------------------------------------------------------ report

    def report(self) -> dict[str, Any]:
        duration = self.end - (T0 + self.warmup)
        n_obs = len(self.observers)
        rates_in, rates_out = [], []
        parts = dict.fromkeys(_TRAFFIC_KEYS, 0.0)
        gossip = self.gossip_bytes - self.gossip_mark
        for o in self.observers:
            d = {k: o.bytes[k] - o.mark[k] for k in _TRAFFIC_KEYS}
            d["in_gossip"] += gossip
            d["out_gossip"] += gossip
            for k, v in d.items():
                parts[k] += v / duration / n_obs
            rates_in.append(sum(v for k, v in d.items() if k.startswith("in_")) / duration)
            rates_out.append(sum(v for k, v in d.items() if k.startswith("out_")) / duration)
        final = plan(self.estimate(None, self.end), self.cfg)
        full_bytes, full_pages = _full_view_cost(self.observers[0].view, self.end)
        counts: dict[str, int] = {}
        dropped: dict[str, int] = {}
        for o in self.observers:
            for k, v in o.view.counts.items():
                counts[k] = counts.get(k, 0) + v
            for k, v in o.view.dropped.items():
                dropped[k] = dropped.get(k, 0) + v
        return {
            "peers": self.n0, "stages": self.stages, "hours": self.hours,
            "churn_per_hour": round(self.churn_rate * 3600.0 / self.n0, 6), "observers": n_obs,
            "live_peers_at_end": self.live, "measured_from_s": round(self.warmup, 1),
            "plan": {"period_s": round(final.period_s, 2), "pull_s": round(final.pull_s, 3),
                     "window_s": round(final.window_s, 1), "expiry_s": round(final.expiry_s, 1),
                     "modelled_in_bytes_per_s": round(final.bytes_per_s, 1),
                     "gossip_interval_s": round(final.gossip_interval_s, 1),
                     "events_per_s": round(self.estimate(None, self.end).events_per_s, 4),
                     "mean_announcement_bytes": round(self.wire_mean, 1)},
            "traffic": {"budget_bytes_per_s": self.cfg.budget_bytes_per_s,
                        "in_bytes_per_s_mean": round(_mean(rates_in), 1),
                        "in_bytes_per_s_max": round(max(rates_in), 1),
                        "out_bytes_per_s_mean": round(_mean(rates_out), 1),
                        "out_bytes_per_s_max": round(max(rates_out), 1),
                        "breakdown_bytes_per_s": {k: round(v, 1) for k, v in parts.items()}},
            "stage_totals": {"rel_error_max": round(max(self.errors, default=0.0), 4),
                             "rel_error_mean": round(_mean(self.errors), 4),
                             "checks": len(self.errors)},
            "staleness": {
                "entry_age_s_mean": round(_mean(self.ages_mean), 1),
                "entry_age_s_max": round(self.ages_max, 1),
                "dead_listed_fraction_mean": round(_mean(self.dead_listed), 4),
                "dead_listed_fraction_max": round(max(self.dead_listed, default=0.0), 4),
                "dead_routable_fraction_mean": round(_mean(self.dead_routable), 4),
                "live_missing_fraction_mean": round(_mean(self.missing), 5),
                "live_missing_fraction_max": round(max(self.missing, default=0.0), 5),
                "killed_removed_after_periods_mean": round(_mean(self.kill_removal_periods), 3),
                "killed_removed_after_periods_max": round(max(self.kill_removal_periods,
                                                           default=0.0), 3),
                "leave_seen_after_s_mean": round(_mean(self.leave_delays), 2),
                "leave_seen_after_s_max": round(max(self.leave_delays, default=0.0), 2),
                "join_seen_after_s_mean": round(_mean(self.join_delays), 2),
                "join_seen_after_s_max": round(max(self.join_delays, default=0.0), 2)},
            "events": dict(self.stats),
            "newcomer_full_view": {"bytes": full_bytes, "pages": full_pages},
            "observer_view_counts": counts, "observer_dropped": dropped,
        }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _full_view_cost(view: View, now: float) -> tuple[int, int]:
    """Bytes and pages a newcomer pulls to get ``view`` whole."""
    request = view.pull_request(now, None)
    total = pages = 0
    while True:
        data = encode_page(view.serve(request, now))
        total += len(data)
        pages += 1
        cursor = decode_page(data, view.config.limits).next_cursor
        if cursor is None:
            return total, pages
        request = request.next_page(cursor)


def simulate(peers: int, stages: int, hours: float, churn_per_hour: float, seed: int, *,
             observers: int = 12, kill_fraction: float = 0.5, drift: float = 0.3,
             drift_tau_s: float = 1800.0, join_delay_s: float = 30.0, samples: int = 24,
             config: ScheduleConfig | None = None) -> dict[str, Any]:
    """Simulate ``peers`` peers for ``hours`` of virtual time; the figures as a JSON-able dict.

    ``churn_per_hour``: leaves per hour as a fraction of ``peers`` (as many joins);
    ``kill_fraction`` of the leaves are SIGKILL-like (silent), the rest announce ``leaving``.
    """
    if peers < observers + 2 or observers < 1 or stages < 1 or hours <= 0 or churn_per_hour < 0:
        raise ValueError("need peers >= observers + 2, observers >= 1, stages >= 1, hours > 0, "
                         "churn_per_hour >= 0")
    wall = time.perf_counter()
    sim = _Sim(peers, stages, hours, churn_per_hour, seed, observers, kill_fraction, drift,
               drift_tau_s, join_delay_s, samples, config or ScheduleConfig())
    sim.run()
    out = {"seed": seed, **sim.report()}
    out["wall_s"] = round(time.perf_counter() - wall, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--churn", type=float, default=0.2,
                    help="leaves per hour as a fraction of the swarm (as many joins)")
    ap.add_argument("--kill-fraction", type=float, default=0.5)
    ap.add_argument("--observers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    result = simulate(args.peers, args.stages, args.hours, args.churn, args.seed,
                      observers=args.observers, kill_fraction=args.kill_fraction)
    if args.json:
        print(json.dumps(result))
    else:
        for section, value in result.items():
            print(f"{section}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
