"""Which stage this peer should serve: SWARM's adaptive rebalancing. Pure.

The pipeline runs at the speed of its slowest stage, so the swarm's throughput is the lowest
stage total. Peers of over-served stages move to under-served ones until that minimum is close
to what the peers could reach together. Time and randomness are parameters (``now``, ``rng``):
the daemon and ``tools/simulate_swarm.py`` run this same code.

Policy:

* **Totals count arrivals.** A stage's *planned* total is the throughput of its ``online``
  peers plus that of the peers ``joining`` or ``migrating`` to it (their announcement already
  names the stage they are loading); ``leaving`` peers count nowhere. Deciding on planned
  totals means that once enough peers are on their way, nobody else follows them.
* **An empty stage is filled first, whatever the throughputs.** A stage with no online,
  joining or migrating peer stops the whole pipeline, and before any training every peer
  announces throughput 0 (the totals look balanced), so totals cannot be trusted to see it:
  two ``--stage auto`` peers that raced onto one stage would wait forever. While some stage
  is empty and another has at least 2 online peers, :func:`fill_plan` overrides everything
  below: one peer per empty stage (lowest first) moves, and nobody else (``"not_chosen"``),
  the gain being ``inf``. The donor is the stage with the most online peers left, then the
  largest planned total, then the lowest index: counts are exact integers, so peers whose
  views hold the same announcements agree even where float sums of totals could differ in
  the last bit; the most crowded stage loses least by giving one peer. Its mover is its
  online peer with the smallest throughput, then the largest peer id: the move can only
  lower its source, which keeps serving the pipeline, so the smallest peer costs least
  there; the empty stage only needs *a* peer (any peer beats none), and once measurements
  exist the rules below move the right amount there, ranked largest first, so the fill
  takes the other end of that ranking. With all throughputs 0 (the stuck case) it is simply
  the largest peer id. A donor always keeps one online peer; when no stage can spare one,
  the rules below apply as before. The move goes through the same ``confirmations``; once
  the mover announces ``migrating`` there the stage is planned and the rules below resume.
* **The level and the gain.** The peers together could bring every stage to about the mean
  planned total ``L`` (an upper bound on the best minimum; with many peers per stage it is
  reached within about one peer). The swarm's *gain* is ``L / min - 1``: how much a full
  rebalancing would raise the minimum. While it is at most ``threshold`` (5%), nobody moves,
  whatever the peer: small drifts never cost a migration. The threshold applies to the joint
  move a peer takes part in, not to its own: one peer of 10,000 is ~0.1% of a stage, so no
  single move could ever raise the minimum by 5%.
* **Who moves: the peers that gain most, and only as many as needed.** A stage above the level
  has a surplus ``q = planned - L`` to give. Its online peers are ranked by throughput (a move
  raises the target stage by the mover's throughput: the largest peers gain most, and fill a
  deficit with the fewest migrations), ties by peer id, and taken first-fit: a peer is chosen
  when it fits in what is left of the surplus, give or take half the stage's smallest peer
  (but at most what is left: a lone big peer may still fill a large deficit in a small swarm),
  and never when it would leave its stage without an online peer. So a stage gives its
  surplus to within one small peer. Every peer computes the same plan from the same view, so
  in a one-shot imbalance the peers that move are about those the deficit needs, not everyone
  who checks: no stampede, even when views lag by a few announcements. The plan is stable while
  it runs: when a chosen peer leaves, the surplus and what is left before every later peer
  shrink by its throughput, and the same others stay chosen.
* **Where to.** The surpluses, laid end to end in stage order, are matched to the deficits
  ``L - planned`` of the stages below the level, laid end to end lowest stage first; a chosen
  peer goes to the deficit in which its share starts. So the bottleneck is filled first, and
  when the chosen peers fall short of the whole deficit, the stages closest to the level are
  the ones left short. A move is refused if it would leave its stage at or below the
  target's planned total plus half the mover (a move must raise the lower of the two stages
  it touches by at least half the mover's throughput, which noise cannot fake between two
  stages one peer apart), so each move raises the lower of the two stages it touches: moves
  seen one after the other never undo each other (the sorted list of stage totals grows
  lexicographically with every move), which rules out flapping in a steady swarm. The
  bottleneck is never a source (its total is below the level).
* **Unmeasured stages.** A stage whose peers have announced no measured throughput yet
  (training has just started, or only a joining peer is there) while another stage has, is
  not a bottleneck of 0: nobody moves (``"unmeasured"``, gain 0) until every stage with peers
  has a measurement. A pipeline that trains routes through every stage, so each is measured
  within its first microbatches; before, the first check after training began saw
  ``[126, 0, 0]`` and sent a stage-0 peer to stage 1, and the next, measured, totals sent it
  back (the balancing test's flapping).
* **Hysteresis and timing.** :class:`Balancer` moves only after ``confirmations`` consecutive
  checks (3) said "move"; a single "stay" resets the count. The target may differ between
  those checks (deficits shift while others move); the move goes to the latest one. Checks are
  ``check_period_s`` apart (30 s) with +-``jitter`` randomisation; while a move is being
  confirmed the next check comes after ``confirm_period_s`` (10 s), so a real imbalance is
  acted on within about one period plus 20 s.

* **Stages it cannot hold.** ``fits`` (the stages this peer's ``limits.device_memory_bytes``
  can hold, ``swarmd.node.caps``; None: any) is known only to the peer itself. A target that
  does not fit is passed over for the next deficit, lowest first, that fits and passes the
  overshoot rule; when none does the peer stays (``"does_not_fit"``). Its stage mates planned
  with it as a mover, so that deficit waits for the next checks, when the totals have changed.
  Likewise a peer chosen to fill an empty stage it cannot hold stays (``"does_not_fit"``) and
  nobody takes its place: the others cannot know why.

New peers (``--stage auto``) use :func:`swarmd.balancing.placement.choose_stage`, fed with
:meth:`SwarmLoad.planned_totals` and :meth:`SwarmLoad.planned_counts` so that simultaneous
joiners see each other.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from swarmd.peer_states import PeerState

__all__ = ["STATES", "BalancingConfig", "PeerLoad", "Decision", "SwarmLoad", "swarm_gain",
           "fill_plan", "decide", "Balancer"]

#: the peer states the balancer counts: membership's (``swarmd.peer_states``), a peer still
#: syncing counted as joining (it is arriving)
STATES = tuple(s.value for s in PeerState if s is not PeerState.SYNCING)


def _finite(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class BalancingConfig:
    #: move only while a full rebalancing would raise the minimum stage total by more than this
    threshold: float = 0.05
    #: consecutive checks that must say "move" before the peer moves
    confirmations: int = 3
    #: mean time between checks
    check_period_s: float = 30.0
    #: mean time between checks while a move is being confirmed
    confirm_period_s: float = 10.0
    #: check intervals are drawn uniformly in period x [1 - jitter, 1 + jitter]
    jitter: float = 0.5

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"BalancingConfig: {what}")
        for name in ("threshold", "check_period_s", "confirm_period_s", "jitter"):
            need(_finite(getattr(self, name)), f"{name} must be a finite number")
        need(self.threshold >= 0, "threshold must be >= 0 (0.05: move for a 5% gain)")
        need(type(self.confirmations) is int and self.confirmations >= 1,
             "confirmations must be an int >= 1")
        need(self.check_period_s > 0 and self.confirm_period_s > 0, "periods must be > 0")
        need(0 <= self.jitter < 1, "jitter must be in [0, 1)")


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerLoad:
    """One peer as the balancer sees it (from its membership announcement)."""

    peer_id: str
    #: the stage it serves, or loads when joining or migrating
    stage: int
    #: measured throughput, samples per second
    throughput: float
    state: str

    def __post_init__(self) -> None:
        if type(self.peer_id) is not str or not self.peer_id:
            raise ValueError("peer_id must be a non-empty str")
        if type(self.stage) is not int or self.stage < 0:
            raise ValueError("stage must be an int >= 0")
        if not _finite(self.throughput) or self.throughput < 0:
            raise ValueError("throughput must be a finite number >= 0")
        if self.state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, not {self.state!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    #: the stage to move to, or None to stay
    move_to: int | None
    #: how much a full rebalancing would raise the minimum stage total, relative (inf: a stage
    #: has nothing planned, or has no peer while another stage could spare one)
    gain: float
    #: why: "move", "fill" (a move to an empty stage), "balanced", "unmeasured", "not_online",
    #: "no_throughput", "not_donor", "not_chosen", "last_peer", "overshoot", "does_not_fit"
    reason: str


#: an announced state as the balancer counts it ("syncing" peers are still arriving)
_VIEW_STATES = {s.value: (s if s is not PeerState.SYNCING else PeerState.JOINING).value
                for s in PeerState}


class SwarmLoad:
    """Peers per stage with their throughput and state, kept ready for :func:`decide`.

    Updated in place, a binary search and a list insert per change (the simulator feeds it
    event by event); the daemon can build one per check with :meth:`from_peers`. Per stage it
    keeps the online peers sorted by throughput (largest first), so that a decision costs
    O(S log S + k log n) for k chosen peers ranked above the asking one, never O(N).
    """

    def __init__(self, stages: int) -> None:
        if type(stages) is not int or stages < 1:
            raise ValueError("stages must be an int >= 1")
        self.stages = stages
        self._peers: dict[str, PeerLoad] = {}
        self._served = [0.0] * stages
        self._arriving = [0.0] * stages
        self._online = [0] * stages
        self._arrivals = [0] * stages
        #: per stage, online peers as (-throughput, peer_id) ascending, and the -throughputs
        self._keys: list[list[tuple[float, str]]] = [[] for _ in range(stages)]
        self._negs: list[list[float]] = [[] for _ in range(stages)]

    @classmethod
    def from_peers(cls, stages: int, peers: Iterable[PeerLoad]) -> SwarmLoad:
        load = cls(stages)
        for p in peers:
            load.set(p)
        return load

    @classmethod
    def from_view(cls, stages: int, info: Any) -> SwarmLoad:
        """The view (a :class:`swarmd.api.types.SwarmInfo`) as the balancer sees it: every
        peer with our model and a stage, with the stage it serves or loads, its announced
        throughput and its state; peers kept out of routing for another reason are left out."""
        load = cls(stages)
        for stage_row in info.stages:
            for p in stage_row.peers:
                state = _VIEW_STATES.get(p.state)
                if p.reason in (None, "joining", "syncing", "migrating") and state is not None:
                    load.set(PeerLoad(peer_id=p.peer_id, stage=stage_row.stage,
                                      throughput=float(p.throughput), state=state))
        return load

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def get(self, peer_id: str) -> PeerLoad | None:
        return self._peers.get(peer_id)

    def peers(self) -> list[PeerLoad]:
        return list(self._peers.values())

    def set(self, peer: PeerLoad) -> None:
        """Add or replace a peer; a ``leaving`` peer is removed."""
        if peer.stage >= self.stages:
            raise ValueError(f"stage {peer.stage} is out of range (stages: {self.stages})")
        self.remove(peer.peer_id)
        if peer.state == "leaving":
            return
        s, t = peer.stage, float(peer.throughput)
        self._peers[peer.peer_id] = peer
        if peer.state == "online":
            self._served[s] += t
            self._online[s] += 1
            key = (-t, peer.peer_id)
            i = bisect_left(self._keys[s], key)
            self._keys[s].insert(i, key)
            self._negs[s].insert(i, -t)
        else:
            self._arriving[s] += t
            self._arrivals[s] += 1

    def remove(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        s, t = peer.stage, float(peer.throughput)
        if peer.state == "online":
            self._online[s] -= 1
            # an emptied stage is exactly 0, whatever rounding the sums picked up
            self._served[s] = self._served[s] - t if self._online[s] else 0.0
            i = bisect_left(self._keys[s], (-t, peer_id))
            del self._keys[s][i]
            del self._negs[s][i]
        else:
            self._arrivals[s] -= 1
            self._arriving[s] = self._arriving[s] - t if self._arrivals[s] else 0.0

    def served_totals(self) -> list[float]:
        """Throughput of each stage's online peers: what the pipeline gets now."""
        return list(self._served)

    def planned_totals(self) -> list[float]:
        """Served plus arriving (joining, migrating) throughput of each stage."""
        return [a + b for a, b in zip(self._served, self._arriving)]

    def online_counts(self) -> list[int]:
        return list(self._online)

    def planned_counts(self) -> list[int]:
        return [a + b for a, b in zip(self._online, self._arrivals)]


def _gain(level: float, low: float) -> float:
    if level <= 0:
        return 0.0
    return math.inf if low <= 0 else level / low - 1.0


def swarm_gain(load: SwarmLoad) -> float:
    """How much a full rebalancing would raise the lowest planned stage total, relative;
    ``inf`` while an empty stage is to be filled (:func:`fill_plan`), whatever the totals; 0
    while a stage with peers has no measured throughput and another has (nobody moves then).

    :func:`decide` says "stay" to every peer while this is at most the threshold, so a caller
    that checks many peers (the simulator) may skip their checks until it rises above it.
    """
    if _has_empty_stage(load) and fill_plan(load):
        return math.inf
    if _has_unmeasured_stage(load):
        return 0.0
    planned = load.planned_totals()
    return _gain(sum(planned) / len(planned), min(planned))


def _has_empty_stage(load: SwarmLoad) -> bool:
    return any(a + b == 0 for a, b in zip(load._online, load._arrivals))


def _has_unmeasured_stage(load: SwarmLoad) -> bool:
    """Some stage has peers but no measured throughput among them, while another stage has:
    its total of 0 says nothing yet (module docstring, "Unmeasured stages")."""
    counts, planned = load.planned_counts(), load.planned_totals()
    return any(planned) and any(n > 0 and t <= 0 for n, t in zip(counts, planned))


def fill_plan(load: SwarmLoad) -> dict[str, int]:
    """The moves that fill the empty stages (no online, joining or migrating peer), peer id
    to stage; empty when no stage is empty or no stage has an online peer to spare.

    One peer per empty stage, lowest empty stage first, as long as some stage keeps two or
    more online peers: the donor is the stage with the most online peers left (then the
    largest planned total left, then the lowest index), and its mover the online peer with the
    smallest throughput (then the largest peer id), not yet taken. Counts and announced
    values only, so every peer with the same view computes the same plan; see the module
    docstring for why these choices."""
    counts = load.planned_counts()
    empty = [s for s, n in enumerate(counts) if n == 0]
    if not empty:
        return {}
    planned = load.planned_totals()
    taken = [0] * load.stages
    plan: dict[str, int] = {}
    for target in empty:
        spare = [s for s in range(load.stages) if load._online[s] - taken[s] >= 2]
        if not spare:
            break
        donor = max(spare, key=lambda s: (load._online[s] - taken[s], planned[s], -s))
        neg, pid = load._keys[donor][-1 - taken[donor]]  # smallest, then largest id
        plan[pid] = target
        taken[donor] += 1
        planned[donor] += neg
    return plan


def decide(load: SwarmLoad, peer_id: str, config: BalancingConfig,
           fits: Collection[int] | None = None) -> Decision:
    """Stay, or move ``peer_id`` to another stage (one of ``fits``, the stages it can hold,
    when given); see the module docstring. Deterministic."""
    if _has_empty_stage(load):
        fill = fill_plan(load)
        if fill:
            return _fill_decision(load, peer_id, fill, fits)
    if _has_unmeasured_stage(load):
        return Decision(move_to=None, gain=0.0, reason="unmeasured")
    planned = load.planned_totals()
    level = sum(planned) / len(planned)
    gain = _gain(level, min(planned))
    if gain <= config.threshold:
        return Decision(move_to=None, gain=gain, reason="balanced")
    me = load._peers.get(peer_id)
    if me is None or me.state != "online":
        return Decision(move_to=None, gain=gain, reason="not_online")
    if me.throughput <= 0:
        return Decision(move_to=None, gain=gain, reason="no_throughput")
    a, t = me.stage, float(me.throughput)
    surplus = planned[a] - level
    if surplus <= 0:
        return Decision(move_to=None, gain=gain, reason="not_donor")
    # first-fit, largest first: the next peer that fits in what is left, give or take
    negs = load._negs[a]
    slack = -negs[-1] / 2  # half the stage's smallest peer
    mine = bisect_left(load._keys[a], (-t, peer_id))
    left, taken, i = surplus, 0, 0
    while True:
        if taken + 2 > len(negs):
            return Decision(move_to=None, gain=gain, reason="last_peer")
        # the next peer with throughput <= left + min(left, slack)
        j = bisect_left(negs, -(left + min(left, slack)), i) if left > 0 else len(negs)
        if j > mine:
            return Decision(move_to=None, gain=gain, reason="not_chosen")
        if j == mine:
            break
        left += negs[j]
        taken += 1
        i = j + 1
    # where my share starts among all surpluses, matched to the deficits, lowest stage first
    at = sum(p - level for p in planned[:a] if p > level) + (surplus - left)
    deficits = sorted((p, s) for s, p in enumerate(planned) if p < level)
    target, seen, k = -1, 0.0, 0
    for k, (p, s) in enumerate(deficits):
        target = s
        seen += level - p
        if at < seen:
            break
    if fits is not None and target not in fits:
        # the next deficit that fits (then the earlier ones), lowest first
        order = [s for _, s in deficits[k + 1:] + deficits[:k]]
        held = [s for s in order if s in fits and _no_overshoot(planned, a, s, t)]
        if not held:
            return Decision(move_to=None, gain=gain, reason="does_not_fit")
        target = held[0]
    if not _no_overshoot(planned, a, target, t):
        return Decision(move_to=None, gain=gain, reason="overshoot")
    return Decision(move_to=target, gain=gain, reason="move")


def _fill_decision(load: SwarmLoad, peer_id: str, fill: dict[str, int],
                   fits: Collection[int] | None) -> Decision:
    """While an empty stage is being filled, only the peers of ``fill`` move; the others
    stay until the movers' announcements (``migrating`` there) show the stage planned."""
    me = load._peers.get(peer_id)
    if me is None or me.state != "online":
        return Decision(move_to=None, gain=math.inf, reason="not_online")
    target = fill.get(peer_id)
    if target is None:
        return Decision(move_to=None, gain=math.inf, reason="not_chosen")
    if fits is not None and target not in fits:
        return Decision(move_to=None, gain=math.inf, reason="does_not_fit")
    return Decision(move_to=target, gain=math.inf, reason="fill")


def _no_overshoot(planned: list[float], source: int, target: int, t: float) -> bool:
    """The move must raise the lower of the two stages by at least half the mover's own
    throughput: min(a - t, target + t) - target >= t / 2. Between two stages one peer apart
    (a = target + t, give or take measurement noise) it never does, so noisy throughputs
    cannot make peers swap back and forth."""
    return planned[source] - planned[target] >= 1.5 * t


class Balancer:
    """One peer's balancing state: the hysteresis around :func:`decide`.

    Call :meth:`check` at the times :meth:`next_check_at` gives (about every 30 s; every 10 s
    while confirming), with a :class:`SwarmLoad` of the current view: every peer with this
    model hash and a stage in range, as (peer_id, stage, announced throughput, state), entries
    that are expired or overdue left out, and this peer itself as it last announced. When it
    returns a stage, move there: announce ``migrating`` with the new stage at once (so that the
    others count it as arriving), load the stage, then announce ``online``.
    """

    def __init__(self, peer_id: str, config: BalancingConfig | None = None) -> None:
        self.peer_id = peer_id
        self.config = config or BalancingConfig()
        #: consecutive checks that said "move"
        self.streak = 0
        self.last: Decision | None = None
        self.last_check_at: float | None = None
        self.moved_at: float | None = None
        self.moves = 0

    def reset(self) -> None:
        """Forget the confirmations gathered so far (as a "stay" would)."""
        self.streak = 0

    def check(self, load: SwarmLoad, now: float,
              fits: Collection[int] | None = None) -> int | None:
        """The stage to move to now (one of ``fits`` when given), or None."""
        decision = decide(load, self.peer_id, self.config, fits)
        self.last, self.last_check_at = decision, now
        if decision.move_to is None:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.config.confirmations:
            return None
        self.streak = 0
        self.moved_at = now
        self.moves += 1
        return decision.move_to

    def next_check_at(self, now: float, rng: random.Random) -> float:
        """When to check next: sooner while a move is being confirmed; randomised."""
        c = self.config
        period = c.confirm_period_s if self.streak else c.check_period_s
        return now + period * rng.uniform(1.0 - c.jitter, 1.0 + c.jitter)
