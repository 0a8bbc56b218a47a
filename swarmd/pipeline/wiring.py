"""Which peer of a stage gets the next microbatch: SWARM's stochastic wiring. Pure.

One :class:`Wiring` per stage, owned by whoever sends that stage its microbatches. Time and
randomness are parameters (``now``, ``rng``), so the daemon and the swarm simulator run this
same code.

Policy, in the paper's terms (SWARM, Ryabinin et al. 2023, "interleaved weighted round-robin"):

* Each peer ``p`` has a *throughput estimate* ``t_p`` in forward samples per second: its
  announced throughput until we have measured it, then an exponential moving average of what
  we measure (``samples x cost(kind) / seconds``, so a backward pass, ``backward_cost`` = 2.5
  forward passes, counts 2.5 times its samples). A peer that announced nothing starts at
  ``prior_throughput`` (default: the median estimate of the stage's other peers). At the first
  measurement, the load charged under the announced or prior estimate is re-charged at the
  measured rate (else a peer whose prior was 100x too low would sit idle for 100 tasks).
* A peer may have a *ceiling*: the most it says it sustains (the router passes its announced
  throughput, which ``[limits]`` caps to what its upload carries, ``swarmd.node.caps``). A hop
  measures the peer's compute and our link, not its own upload (passing its output on is held
  time, the chain's), and a hop that fits in a rate cap's burst never waits: only the
  announcement knows the cap. It is in compute terms (an uncapped peer announces what it
  computes), while ``t_p`` counts the hop's transfer too (a far peer gets less), so the
  ceiling is brought into hop terms: times the share of a hop that is its compute,
  ``share_p = t_p / c_p`` (1 while unknown), where ``c_p`` is its compute rate: the moving
  average of ``samples x cost / compute_s`` over the ``compute_s`` its replies say
  (:meth:`Wiring.success`), averaged as ``t_p`` is and as the peer averages what it announces
  (one reply moves it ``_JUMP``-fold at most: a wild one would starve the peer). The rate used is ``t_p x min(_MOST_GAIN, ceiling_p / c_p)``: the same form for every peer,
  its hop rate times the fraction of its compute its announcement stands for, so the noise in
  hop and compute times counts alike for all and cancels in the shares (a median of per-hop
  shares stood 1.3-1.5x above what an uncapped peer's ``t_p`` follows on a loaded machine;
  ``min(t_p, ...)`` clipped an uncapped peer's noise on one side only: +4-19% to a capped
  one). An uncapped peer announces what it computes (a factor about 1), a capped one gets its
  cap's fraction of what its hops show, and one that announces more than its replies say it
  computes at most ``_MOST_GAIN`` times its hop rate. With no compute time said (an older
  peer): ``min(t_p, ceiling_p)``. The time a reply waited in the peer's own upload cap
  (``HopReply.upload_wait_s``) is not in a hop's seconds: the cap and what else fills it are
  in the announcement already, so the wait counts once (docs/limits.md "Routing").
* Each peer has a *cumulative load* ``L_p`` (seconds of work we have sent it). A task of
  ``samples`` of ``kind`` goes to the peer with the least *expected finish time*::

      L_p + samples x cost(kind) / t_p + queue_p x queue_weight / t_p

  (exact ties broken at random) and then ``L_p += samples x cost(kind) / t_p``. Over many
  tasks every peer's loads advance together, so each gets work in proportion to ``t_p``. The
  announced queue stands for work other senders gave it: a one-off head start for the others,
  refreshed with each announcement, not a change of share.
* Loads are relative: a newcomer (or a peer back from a ban) enters at the current minimum
  load of the peers in service, so it is tried within about one round but gets no burst; and
  once the minimum exceeds ``_RENORMALISE_AT`` seconds it is subtracted from every load, which
  keeps them small over any number of choices.
* A *timeout* means slow, not dead: the peer's estimate is divided by a slow factor
  (x ``slow_penalty`` per timeout, at most ``slow_max_factor``) that decays back to 1 with
  half-life ``slow_half_life_s``; a success clears it. The peer keeps a (smaller) share.
* An *error* bans the peer for ``ban_base_s x 2^(streak - 1)`` seconds, at most ``ban_max_s``
  (Petals: 15 s, 30 s, 60 s, ...). The streak counts errors separated by a return to
  service; errors reported while the peer is banned (tasks sent before the ban) neither
  lengthen the ban nor the streak. A success ends the streak. A fresh announcement lifts a
  ban early once ``ban_base_s`` has been served (SWARM: banned until it re-announces).
* A *violation* (the peer broke the protocol: a reply or message that fails validation, a
  wrong shape or dtype from a peer that announced our model, a forged sender) bans for
  ``violation_base_s x 2^(n - 1)`` seconds (n: its violation episodes), at most
  ``violation_max_s``: longer than a transport failure, since no network fault explains it.
  It is remembered with its reason even while the peer is not listed (a peer that leaves and
  re-announces comes back banned: ``swarmd.pipeline.penalties``), a fresh
  announcement does not lift it early, and a success does not forgive it.
* *Busy* (the peer refused new work: backpressure) is neither slow nor broken: the peer sits
  out of :meth:`Wiring.choose` for ``busy_base_s`` (doubling while it stays busy, at most
  ``busy_max_s``), so the caller tries another peer now; no ban, no error streak, its share
  of work is untouched once the pause is over. A success ends the pause and resets it.
* *Probes*: while a measured peer of the stage is in service, a peer not yet measured holds
  at most ``probe_tasks`` tasks unanswered. Every task chosen ends in exactly one outcome
  (success, timeout, busy, error, or :meth:`Wiring.released` when none judges the peer), and
  each frees its probe: a peer that just joined and answers busy for a while (one behind the
  stage's step: ``Forward.at``) is tried again after its pause, not left out for good.
* :meth:`Wiring.choose` returns None when the stage has no peer in service: the caller waits
  (until :meth:`Wiring.available_at` or the next announcement) and says which stage it lacks.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from swarmd.pipeline.penalties import ViolationBook, clean_reason
from swarmd.pipeline.wiring_config import (
    PEER_ROUTING_STATES,
    Kind,
    PeerWiringState,
    WiringConfig,
    _finite,
)

__all__ = ["Kind", "WiringConfig", "PeerWiringState", "Wiring", "PEER_ROUTING_STATES"]

#: once every peer in service has more load than this (seconds), the minimum is subtracted
_RENORMALISE_AT = 1024.0
#: expected finish times within this relative distance of the best are a tie
_TIE = 1e-12
#: a slow factor below 1 + this counts as recovered
_SLOW_EPS = 1e-3
#: throughputs (forward samples/s) are kept at least this, so that loads stay finite
_MIN_THROUGHPUT = 1e-6
#: the most a ceiling above what a peer's replies say it computes multiplies its hop rate by
_MOST_GAIN = 2.0
#: one reply's compute rate counts at most this many times the average, or a fraction of it
_JUMP = 4.0


def _ceiling(ceilings: Mapping[str, float] | None, peer_id: str) -> float:
    """``peer_id``'s ceiling from a remote announcement; 0 (none) unless usable."""
    c = ceilings.get(peer_id) if ceilings is not None else None
    return float(c) if c is not None and _finite(c) and c >= _MIN_THROUGHPUT else 0.0


@dataclass(slots=True)
class _Peer:
    estimate: float
    measured: bool
    queue: int
    load: float
    banned_until: float | None = None
    banned_at: float = 0.0
    #: "error:<reason>" or "violation:<reason>" while banned
    ban_reason: str = ""
    streak: int = 0
    slow_excess: float = 0.0  # slow factor - 1, as of slow_since
    slow_since: float = 0.0
    chosen: int = 0
    timeouts: int = 0
    errors: int = 0
    busy: int = 0
    busy_until: float = 0.0
    busy_streak: int = 0
    #: work (forward samples) and load (seconds) charged before the first measurement
    unmeasured_work: float = 0.0
    unmeasured_load: float = 0.0
    #: the most it says it sustains (forward samples/s of compute); 0: no ceiling
    ceiling: float = 0.0
    #: forward samples/s of compute its replies said (``c_p``, averaged; 0: none said yet)
    compute_rate: float = 0.0
    #: the compute time its last reply said (None: none yet)
    compute_s: float | None = None
    #: tasks given while not yet measured and not yet answered (its probing share)
    probing: int = 0

    def compute_share(self) -> float:
        """The share of its hops' time that is its compute: ``t_p / c_p`` (1: unknown)."""
        return self.estimate / self.compute_rate if self.compute_rate else 1.0

    def routing_ceiling(self) -> float | None:
        """The ceiling in hop terms (None: no ceiling)."""
        return self.ceiling * self.compute_share() if self.ceiling else None

    def rate(self) -> float:
        """The throughput routing uses (before the slow factor): the ceiling in hop terms, at
        most the estimate (``_MOST_GAIN`` times it once the compute rate is known)."""
        if not self.ceiling:
            return self.estimate
        gain = _MOST_GAIN if self.compute_rate else 1.0
        return min(gain * self.estimate, self.ceiling * self.compute_share())


class Wiring:
    """Per-peer wiring state of one stage's candidates; see the module docstring."""

    def __init__(self, config: WiringConfig | None = None) -> None:
        self.config = config or WiringConfig()
        self._peers: dict[str, _Peer] = {}
        self._banned: set[str] = set()
        #: peers sitting out a busy pause (or just back from one)
        self._paused: set[str] = set()
        #: peers that announced a throughput at least once (the others follow the prior)
        self._announced: set[str] = set()
        #: protocol violators, listed or not (swarmd.pipeline.penalties)
        self.book = ViolationBook(self.config.violation_s)
        #: tasks placed, bans imposed, timeouts reported, choices that found nobody
        self.chosen = 0
        self.banned = 0
        self.timeouts = 0
        self.unavailable = 0
        self.busy_answers = 0
        self.violations = 0

    # ---- membership ---------------------------------------------------------------------

    def update_peers(self, peers: Mapping[str, tuple[float, int]], now: float,
                     ceilings: Mapping[str, float] | None = None) -> None:
        """The stage's current peers with their announced (throughput, queue), and the
        ``ceilings`` of those that have one (forward samples/s; a peer not in it, or with a
        zero, tiny or non-finite one, has none: see the module docstring).

        Peers not listed are dropped (a ban ends with them; a violation is remembered: one
        back within its ban re-enters banned). Newcomers enter at the least load of the peers
        in service; one that announced no throughput starts at the prior (default: the median
        of the others' estimates and this update's announcements). Announced values
        come from remote peers: a negative, tiny or non-finite throughput counts as none, a
        negative queue as 0.
        """
        for gone in self._peers.keys() - peers.keys():
            del self._peers[gone]
            self._banned.discard(gone)
            self._paused.discard(gone)
        self._expire_bans(now)
        floor = self._floor() or 0.0
        new: dict[str, tuple[float, int]] = {}
        unknown: list[_Peer] = []  # neither measured nor announced: they follow the prior
        for peer_id, (tput, queue) in peers.items():
            tput = float(tput) if _finite(tput) and tput >= _MIN_THROUGHPUT else 0.0
            queue = int(queue) if _finite(queue) and queue > 0 else 0
            p = self._peers.get(peer_id)
            if p is None:
                new[peer_id] = (tput, queue)
                continue
            p.queue = queue
            p.ceiling = _ceiling(ceilings, peer_id)
            if not p.measured:
                if tput:
                    p.estimate = tput
                    self._announced.add(peer_id)
                elif peer_id not in self._announced:
                    unknown.append(p)
        if not new and not unknown:
            return
        # the prior follows the others as they get measured: a peer kept at a stale prior far
        # below them would be starved (its first task would look 100x longer than theirs)
        known = ([p.estimate for p in self._peers.values() if p.measured or p not in unknown]
                 + [t for t, _ in new.values() if t])
        prior = self.config.prior_throughput or (statistics.median(known) if known else 1.0)
        for p in unknown:
            p.estimate = prior
        for peer_id, (tput, queue) in new.items():
            p = self._peers[peer_id] = _Peer(tput or prior, False, queue, floor,
                                             ceiling=_ceiling(ceilings, peer_id))
            if tput:
                self._announced.add(peer_id)
            v = self.book.get(peer_id)
            if v is not None and v.until > now:  # it left and came back: still banned
                self._ban(peer_id, p, v.until, f"violation:{v.reason}", now)
        self._announced &= self._peers.keys()

    def reannounced(self, peer_id: str, now: float) -> bool:
        """A fresh announcement from ``peer_id``; lifts its ban once ``ban_base_s`` is served.
        Returns whether a ban was lifted."""
        p = self._peers.get(peer_id)
        if p is None or p.banned_until is None or now - p.banned_at < self.config.ban_base_s:
            return False
        if self.book.banned_until(peer_id, now) is not None:
            return False  # a protocol violation is served in full
        self.unban(peer_id)
        return True

    def unban(self, peer_id: str) -> None:
        """Lift ``peer_id``'s ban now (its error streak stays until a success)."""
        p = self._peers.get(peer_id)
        if p is not None and p.banned_until is not None:
            floor = self._floor()  # of the others: p is still banned here
            p.banned_until = None
            self._banned.discard(peer_id)
            if floor is not None:
                p.load = max(p.load, floor)

    def earliest_unban(self) -> float | None:
        """When the first ban ends (None: nobody is banned)."""
        ends = [self._peers[i].banned_until for i in self._banned]
        return min((e for e in ends if e is not None), default=None)

    def unmeasured(self) -> set[str]:
        """The listed peers none of whose tasks was measured yet (only a claim to go by)."""
        return {peer_id for peer_id, p in self._peers.items() if not p.measured}

    def available_at(self, now: float) -> float | None:
        """When a peer not in service now (banned or paused busy) comes back first; ``now``
        when one is in service; None when there is nobody to wait for."""
        ends = [p.busy_until if p.banned_until is None else p.banned_until
                for p in self._peers.values()]
        return max(now, min(ends)) if ends else None

    # ---- the decision -------------------------------------------------------------------

    def choose(self, kind: Kind, samples: int, now: float, rng: random.Random,
               exclude: Collection[str] = ()) -> str | None:
        """The peer to run ``samples`` of ``kind`` next, or None if no peer is in service
        (``exclude``: peers the caller already tried for this task, e.g. one that timed out)."""
        if not (_finite(samples) and samples > 0):
            raise ValueError("samples must be a number > 0")
        work = samples * self.config.cost(kind)
        if self._banned:
            self._expire_bans(now)
        if self._paused:
            self._expire_pauses(now)
        qw = self.config.queue_weight
        best = 0.0
        least = math.inf
        ties: list[tuple[str, _Peer, float]] = []
        claim_cap, probing = self._claim_cap(now, exclude)
        for peer_id, p in self._peers.items():
            if p.banned_until is not None or p.busy_until > now or peer_id in exclude:
                continue
            tput = p.rate()
            if not p.measured and claim_cap is not None:  # measured beats claimed
                if p.probing >= probing:
                    continue  # its probes are out: it gets more once one answered
                tput = min(tput, claim_cap)
            if p.slow_excess:
                factor = self._slow_factor(p, now)
                if factor == 1.0:
                    p.slow_excess = 0.0  # recovered: skip the decay from now on
                tput /= factor
            step = work / tput
            eft = p.load + step + p.queue * qw / tput
            if p.load < least:
                least = p.load
            if not ties or eft < best - _TIE * best:
                best, ties = eft, [(peer_id, p, step)]
            elif eft <= best + _TIE * best:
                ties.append((peer_id, p, step))
        if not ties:
            self.unavailable += 1
            return None
        peer_id, p, step = ties[0] if len(ties) == 1 else rng.choice(ties)
        p.load += step
        p.chosen += 1
        if not p.measured:
            p.unmeasured_work += work
            p.unmeasured_load += step
            p.probing += 1
        self.chosen += 1
        if least > _RENORMALISE_AT:
            for q in self._peers.values():
                q.load = max(0.0, q.load - least)
        return peer_id

    def _claim_cap(self, now: float, exclude: Collection[str]) -> tuple[float | None, int]:
        """(the most a peer not yet measured counts for, the tasks it may hold unanswered):
        ``claim_multiple`` times the best measured rate among the peers in service, and
        ``probe_tasks``; (None, 0) when no measured peer is in service (every peer is then a
        claim, and a claim is all there is to go by)."""
        best = 0.0
        for peer_id, p in self._peers.items():
            if (p.measured and p.banned_until is None and p.busy_until <= now
                    and peer_id not in exclude):
                best = max(best, p.rate())
        if best <= 0.0:
            return None, 0
        return self.config.claim_multiple * best, self.config.probe_tasks

    # ---- outcomes -----------------------------------------------------------------------

    def success(self, peer_id: str, samples: int, seconds: float, kind: Kind,
                now: float, compute_s: float | None = None) -> None:
        """A task on ``peer_id`` took ``seconds`` (``compute_s`` of them its compute, when it
        said): update its throughput, end slow and streak. A non-positive or non-finite
        duration still ends both but teaches no throughput. Outcomes for peers no longer
        listed are ignored (they left while the task ran)."""
        cost = self.config.cost(kind)
        p = self._peers.get(peer_id)
        if p is None:
            return
        p.slow_excess = 0.0
        p.streak = 0
        p.busy_streak, p.busy_until = 0, 0.0
        p.probing = max(0, p.probing - 1)
        if not (_finite(seconds) and seconds > 0 and _finite(samples) and samples > 0):
            return
        if compute_s is not None and _finite(compute_s) and 0 < compute_s:
            p.compute_s = float(compute_s)
            c = samples * cost / min(compute_s, seconds)  # (more than the hop: nonsense)
            if p.compute_rate:  # one wild reply moves it at most _JUMP-fold (a tiny compute
                c = min(max(c, p.compute_rate / _JUMP), p.compute_rate * _JUMP)  # would starve)
                p.compute_rate += self.config.ema_alpha * (c - p.compute_rate)
            else:
                p.compute_rate = c
        measured = max(samples * cost / seconds, _MIN_THROUGHPUT)
        if p.measured:
            p.estimate += self.config.ema_alpha * (measured - p.estimate)
            return
        # First measurement: re-charge the work sent so far at the measured rate, so that a
        # fast peer whose prior was low does not sit out the load it was over-charged (and is
        # not owed a burst either: never below the least loaded of the others in service).
        p.estimate, p.measured = measured, True
        load = p.load - p.unmeasured_load + p.unmeasured_work / p.rate()
        others = (q.load for q in self._peers.values() if q is not p and q.banned_until is None)
        p.load = max(load, min(others, default=0.0), 0.0)

    def timeout(self, peer_id: str, now: float, *, task_ended: bool = True) -> None:
        """A task on ``peer_id`` timed out: slow, not dead; its share shrinks for a while.
        ``task_ended`` False: judged slow while the task runs on (its end is reported then)."""
        p = self._peers.get(peer_id)
        if p is None:
            return
        cfg = self.config
        factor = min(cfg.slow_max_factor, self._slow_factor(p, now) * cfg.slow_penalty)
        p.slow_excess, p.slow_since = factor - 1.0, now
        if task_ended:
            p.probing = max(0, p.probing - 1)  # that probe is over, unanswered
        p.timeouts += 1
        self.timeouts += 1

    def busy(self, peer_id: str, now: float) -> None:
        """``peer_id`` refused a task because it is full: backpressure, not a fault. It sits
        out for ``busy_s(streak)`` so the caller tries another peer now; no ban."""
        p = self._peers.get(peer_id)
        if p is None:
            return
        p.busy += 1
        p.probing = max(0, p.probing - 1)  # an answer: that probe is over (it ran nothing)
        self.busy_answers += 1
        if p.busy_until > now:
            return  # a task sent before the pause: same episode
        p.busy_streak += 1
        p.busy_until = now + self.config.busy_s(p.busy_streak)
        self._paused.add(peer_id)

    def released(self, peer_id: str) -> None:
        """A task given to ``peer_id`` ended with no outcome that frees its probe (a later
        stage's failure passed up, our own output refused, the sender gave up; a violation,
        which ``violation`` judges also outside any task): its probe is over; nothing else
        changes. Every task chosen ends in exactly one of ``success``, ``timeout``, ``busy``,
        ``error`` or this, or a peer not yet measured keeps a probe out for good and, once
        ``probe_tasks`` are, is never chosen again."""
        p = self._peers.get(peer_id)
        if p is not None:
            p.probing = max(0, p.probing - 1)

    def error(self, peer_id: str, now: float, reason: str = "transport", *,
              task_ended: bool = True) -> None:
        """A task on ``peer_id`` failed: ban it for ban_base_s x 2^(streak - 1), capped.
        ``task_ended`` False: the ban is for a task whose end was already reported."""
        p = self._peers.get(peer_id)
        if p is None:
            return
        p.errors += 1
        if task_ended:
            p.probing = max(0, p.probing - 1)
        if p.banned_until is not None and now < p.banned_until:
            return  # a task sent before the ban: same failure
        p.streak += 1
        until = now + self.config.ban_s(p.streak)
        self._ban(peer_id, p, until, f"error:{clean_reason(reason)}", now)

    def violation(self, peer_id: str, reason: str, now: float) -> None:
        """``peer_id`` broke the protocol (``reason``: e.g. ``shape``, ``sender``, ``reply``):
        ban it for ``violation_s(episodes)``; remembered even while it is not listed. Further
        violations during the ban are counted but do not lengthen it."""
        self.violations += 1
        until = self.book.record(peer_id, reason, now)
        p = self._peers.get(peer_id)
        if until is not None and p is not None:
            self._ban(peer_id, p, until, f"violation:{clean_reason(reason)}", now)

    def _ban(self, peer_id: str, p: _Peer, until: float, reason: str, now: float) -> None:
        if p.banned_until is None or until > p.banned_until:
            p.banned_until, p.ban_reason = until, reason
        elif reason.startswith("violation:") and not (p.ban_reason or "").startswith(
                "violation:"):
            p.ban_reason = reason  # a protocol violation outranks a run of errors, whose
            # longer ban stands (hypothesis: banned for errors, then a wrong shape)
        p.banned_at = now
        self._banned.add(peer_id)
        self.banned += 1

    # ---- status -------------------------------------------------------------------------

    def snapshot(self, now: float) -> list[PeerWiringState]:
        """Every peer's state at ``now``, by peer id: those listed, then remembered violators
        that are not (``listed`` False)."""
        out = []
        for peer_id in sorted(self._peers):
            p = self._peers[peer_id]
            factor = self._slow_factor(p, now)
            until = p.banned_until
            banned = until if until is not None and now < until else None
            slow = factor > 1.0 + _SLOW_EPS
            paused = p.busy_until > now
            v = self.book.get(peer_id)
            out.append(PeerWiringState(
                peer_id=peer_id, throughput=p.estimate, measured=p.measured, queue=p.queue,
                load=p.load, banned_until=banned, error_streak=p.streak, slow_factor=factor,
                slow=slow, chosen=p.chosen, timeouts=p.timeouts,
                errors=p.errors, busy=p.busy,
                busy_until=p.busy_until if paused else None,
                state=("banned" if banned is not None else "paused" if paused
                       else "slow" if slow else "ok"),
                ban_reason=p.ban_reason if banned is not None else None,
                ban_left_s=banned - now if banned is not None else None,
                violations=v.count if v else 0, violation_reason=v.reason if v else None,
                ceiling=p.ceiling or None, compute_share=p.compute_share(),
                compute_s=p.compute_s, routing_ceiling=p.routing_ceiling(), rate=p.rate(),
                capped=p.rate() < p.estimate))
        for peer_id in sorted(set(self.book) - self._peers.keys()):
            v = self.book.get(peer_id)
            assert v is not None
            banned = v.until if v.until > now else None
            out.append(PeerWiringState(
                peer_id=peer_id, throughput=0.0, measured=False, queue=0, load=0.0,
                banned_until=banned, error_streak=0, slow_factor=1.0, slow=False, chosen=0,
                timeouts=0, errors=0, state="banned" if banned is not None else "ok",
                ban_reason=f"violation:{v.reason}" if banned is not None else None,
                ban_left_s=banned - now if banned is not None else None,
                violations=v.count, violation_reason=v.reason, listed=False))
        return out

    def __len__(self) -> int:
        return len(self._peers)

    # ---- internals ----------------------------------------------------------------------

    def _slow_factor(self, p: _Peer, now: float) -> float:
        if not p.slow_excess:
            return 1.0
        halvings = max(0.0, now - p.slow_since) / self.config.slow_half_life_s
        excess = p.slow_excess * 0.5 ** halvings
        return 1.0 if excess < _SLOW_EPS else 1.0 + excess

    def _floor(self) -> float | None:
        """Least load among peers in service (None: none is)."""
        return min((p.load for p in self._peers.values() if p.banned_until is None), default=None)

    def _expire_pauses(self, now: float) -> None:
        """Peers back from a busy pause re-enter at the least load of those in service (the
        work they missed is not owed to them as a burst)."""
        back = [i for i in self._paused if self._peers[i].busy_until <= now]
        if not back:
            return
        self._paused.difference_update(back)
        floor = min((p.load for i, p in self._peers.items() if i not in self._paused
                     and i not in back and p.banned_until is None), default=None)
        for peer_id in back:
            p = self._peers[peer_id]
            p.busy_until = 0.0
            if floor is not None:
                p.load = max(p.load, floor)

    def _expire_bans(self, now: float) -> None:
        """Peers whose ban has ended re-enter at the least load of those in service."""
        for peer_id in sorted(self._banned):
            until = self._peers[peer_id].banned_until
            if until is None or now >= until:
                self.unban(peer_id)
