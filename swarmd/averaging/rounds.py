"""The rounds an :class:`~swarmd.averaging.allreduce.Averager` knows: their state, and the table that
holds them with bounded memory.

A round exists here from the first message about it (buffered: the local peer has not joined
yet) or from the local call, until ``retain_s`` after its deadline, so that slower peers
still get answers. At most ``max_pending_rounds`` rounds nobody joined locally, holding at
most ``max_pending_bytes`` of buffered contributions, and ``max_retained_rounds`` finished ones
are kept; messages beyond that get a typed refusal (``busy``). No I/O here: times come in as
``now``; only the events that wake waiting handlers are asyncio objects.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from swarmd.averaging.aggregation import AggregateFn, BadGradient, check_finite
from swarmd.averaging.plan import PartState, PartValue, RoundPlan, fits
from swarmd.errors import SwarmdError
from transport.codecs import CodecSpec
from transport.counters import Counters
from transport.frames import OutgoingFrame

__all__ = ["AllReduceFailed", "AllReduceResult", "AveragerOptions", "Refusal", "RoundState",
           "RoundTable", "UnitState", "aggregate_unit"]

log = logging.getLogger("swarmd.averaging.allreduce")

RAW = CodecSpec(name="none")


class AllReduceFailed(SwarmdError):
    """The round ended at its deadline without every unit: skip this step's update."""

    code = "allreduce_failed"


class Refusal(Exception):
    """A request this peer will not serve now; sent back as an error reply with ``code``."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code = code


@dataclass(frozen=True, slots=True, kw_only=True)
class AveragerOptions:
    #: an owner aggregates at this fraction of the deadline at the latest
    gather_fraction: float = 0.5
    #: a contributor waits for the owner's answer until this fraction, then asks for repair
    reply_fraction: float = 0.7
    probe_timeout_s: float = 5.0
    repair_timeout_s: float = 20.0
    dial_timeout_s: float = 3.0
    #: rounds not joined yet whose messages are buffered, and their buffered bytes in all
    max_pending_rounds: int = 4
    max_pending_bytes: int = 1 << 30
    #: a finished round still answers probes and late peers for this long after its deadline
    retain_s: float = 10.0
    max_retained_rounds: int = 4
    #: the longest any handler waits (for the local peer to join, or to decide)
    max_wait_s: float = 120.0
    #: a pooled stream with no request for this long is closed by the serving side
    idle_stream_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.gather_fraction < self.reply_fraction < 1:
            raise ValueError("need 0 < gather_fraction < reply_fraction < 1")
        for name in ("probe_timeout_s", "repair_timeout_s", "dial_timeout_s", "retain_s",
                     "max_wait_s", "idle_stream_s", "max_pending_rounds", "max_pending_bytes",
                     "max_retained_rounds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AveragerOptions.{name} must be positive")


@dataclass(frozen=True, slots=True)
class AllReduceResult:
    vector: torch.Tensor
    #: the smallest total weight of any unit (each coordinate averages at least this much)
    weight: float
    #: peers whose contribution is in every unit; ``missing``: the others
    contributors: tuple[str, ...]
    missing: tuple[str, ...]
    #: per unit of ``plan.units``: total weight; the units that came from a repairer
    part_weights: tuple[float, ...]
    repaired_parts: tuple[int, ...]
    seconds: float
    bytes_sent: int
    bytes_received: int


@dataclass(eq=False)
class UnitState:
    state: PartState = field(default_factory=PartState)
    #: owner side: contributions by sender peer id; ``done`` once decided (or given up),
    #: ``frame`` the answer every contributor gets
    contributions: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    frame: OutgoingFrame | None = None
    repair: asyncio.Task[PartValue] | None = None
    #: copied into the result already
    placed: bool = False


@dataclass(eq=False)
class RoundState:
    round_id: str
    digest: str
    created: float
    plan: RoundPlan | None = None  # None until the local peer joins
    me: int = -1
    vector: torch.Tensor | None = None
    weight: float = 0.0
    #: the most samples any one contribution may claim
    max_weight: float = math.inf
    codec: CodecSpec = RAW
    aggregate: AggregateFn | None = None
    addrs_of: Callable[[str], Sequence[str]] | None = None
    start: float = math.inf
    deadline: float = math.inf
    gather_at: float = math.inf
    reply_at: float = math.inf
    units: list[UnitState] = field(default_factory=list)
    out: torch.Tensor | None = None
    unreachable: set[int] = field(default_factory=set)
    #: one contribution at a time on the wire to each owner
    send_slots: dict[int, asyncio.Semaphore] = field(default_factory=dict)
    #: before joining: contributions and probes' floors by (unit, sender)
    pending: dict[tuple[int, str], tuple[torch.Tensor, float]] = field(default_factory=dict)
    pending_floors: dict[tuple[int, str], int] = field(default_factory=dict)
    pending_bytes: int = 0
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    mismatch: bool = False
    #: the local peer refused the round's start: it never joins (``RoundTable.decline``)
    declined: bool = False
    finished: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0

    def mark_unreachable(self, k: int) -> None:
        """Peer ``k`` failed to connect: owners stop waiting for its contributions."""
        self.unreachable.add(k)
        for unit in self.units:
            unit.changed.set()


class RoundTable:
    """The rounds by id, with the buffering bounds of :class:`AveragerOptions`."""

    def __init__(self, options: AveragerOptions, counters: Counters) -> None:
        self.options = options
        self.counters = counters
        self._rounds: dict[str, RoundState] = {}
        #: ids of rounds forgotten lately: a late message for one is refused at once instead
        #: of being buffered as if for a round still to come
        self._gone: deque[str] = deque(maxlen=256)
        #: ids of rounds whose start the local peer refused: it never joins them
        self._declined: deque[str] = deque(maxlen=256)

    def clear(self) -> None:
        self._rounds.clear()

    def join(self, plan: RoundPlan, me: int, now: float, deadline_s: float, *,
             max_weight: float = math.inf) -> RoundState:
        """The local peer starts ``plan``: take over what was buffered for it, from the
        group's members only (a probe's floor only from the unit's repairer of that epoch,
        a contribution only of the right size and a sane weight)."""
        self.expire(now)
        rnd = self._rounds.get(plan.round_id)
        if (rnd is not None and rnd.plan is not None) or plan.round_id in self._gone:
            raise ValueError(f"round {plan.round_id} was already run here: use a new round id")
        if rnd is None or rnd.digest != plan.digest:
            if rnd is not None:  # buffered under another plan: the peers disagree
                self.counters.add("plan_mismatch")
                rnd.mismatch = True
                rnd.joined.set()
            rnd = self._rounds[plan.round_id] = RoundState(plan.round_id, plan.digest, now)
        o = self.options
        rnd.plan, rnd.me, rnd.max_weight = plan, me, max_weight
        rnd.start, rnd.deadline = now, now + deadline_s
        rnd.gather_at = now + o.gather_fraction * deadline_s
        rnd.reply_at = now + o.reply_fraction * deadline_s
        rnd.units = [UnitState() for _ in plan.units]
        rnd.send_slots = {j: asyncio.Semaphore(1) for j in range(plan.n)}
        for (u, sender), floor in rnd.pending_floors.items():
            if 0 <= u < len(plan.units) and sender in plan.group and (
                    (floor, plan.group.index(sender)) in plan.chain(u)):
                rnd.units[u].state.raise_floor(floor)
            else:
                self.counters.add("bad_requests.not_repairer")
        for (u, sender), (tensor, w) in rnd.pending.items():
            if not (fits(plan, u, tensor) and plan.units[u].owner == me
                    and sender in plan.group and sender != plan.group[me]):
                self.counters.add("bad_requests.wrong_part")
            elif not w <= max_weight:
                self.counters.add("bad_requests.bad_weight")
            else:
                rnd.units[u].contributions[sender] = (tensor, w)
        rnd.pending.clear()
        rnd.pending_floors.clear()
        rnd.pending_bytes = 0
        return rnd

    @staticmethod
    def finish(rnd: RoundState) -> None:
        rnd.finished = True
        rnd.vector = rnd.out = None  # the caller's memory: never touched after the round
        for unit in rnd.units:
            unit.contributions.clear()
            unit.done.set()

    def expire(self, now: float) -> None:
        """Forget finished rounds past their retention and pending rounds nobody joined."""
        o = self.options
        for r in list(self._rounds.values()):
            if (r.finished and now > r.deadline + o.retain_s) or (
                    r.plan is None and now > r.created + o.max_wait_s):
                self._forget(r)
        done = [r for r in self._rounds.values() if r.finished]  # oldest first
        for r in done[:max(0, len(done) - o.max_retained_rounds)]:
            self._forget(r)

    def _forget(self, rnd: RoundState) -> None:
        del self._rounds[rnd.round_id]
        if rnd.plan is not None:
            self._gone.append(rnd.round_id)

    def decline(self, r: str) -> None:
        """The local peer refused round ``r``'s start and never joins it: what its members
        send for it is refused at once (``not_joined``), what was buffered for it too, so
        that they repair its units now instead of waiting for them until ``reply_fraction``
        of their deadline (a round whose leader this peer's view did not take for the
        leader waited out the averaging timeout, and its trainer with it)."""
        self._declined.append(r)
        rnd = self._rounds.get(r)
        if rnd is not None and rnd.plan is None:
            rnd.declined = True
            rnd.joined.set()

    def lookup(self, r: str, d: str, kind: str, nbytes: int, now: float) -> RoundState:
        """The round a message is for; a round not joined yet is created to buffer it."""
        self.expire(now)
        rnd = self._rounds.get(r)
        if rnd is None and r in self._gone:
            raise Refusal("round_finished", f"round {r} is over here and forgotten")
        if (rnd is None or rnd.plan is None) and r in self._declined:
            raise Refusal("not_joined", f"round {r}'s start was refused here: it never joins")
        if rnd is None or rnd.plan is None:
            if kind == "repair":
                raise Refusal("not_joined", f"round {r} has not started here")
            pending = [x for x in self._rounds.values() if x.plan is None]
            held = sum(x.pending_bytes for x in pending)
            if (rnd is None and len(pending) >= self.options.max_pending_rounds) or (
                    kind == "contribute" and held + nbytes > self.options.max_pending_bytes):
                self.counters.add("buffer_full")
                raise Refusal("busy", f"too much buffered here for rounds not started; {r} "
                                      f"refused")
            if rnd is None:
                rnd = self._rounds[r] = RoundState(r, d, now)
        if rnd.digest != d:
            self.counters.add("plan_mismatch")
            raise Refusal("plan_mismatch", f"round {r} has another group or parts here")
        return rnd

    @staticmethod
    async def wait_joined(rnd: RoundState, wait: float) -> RoundPlan:
        try:
            async with asyncio.timeout(wait):
                await rnd.joined.wait()
        except TimeoutError:
            raise Refusal("not_joined", f"round {rnd.round_id} did not start here in time")
        if rnd.declined:
            raise Refusal("not_joined", f"round {rnd.round_id}'s start was refused here")
        if rnd.mismatch or rnd.plan is None:
            raise Refusal("plan_mismatch", f"round {rnd.round_id} has another plan here")
        return rnd.plan


def summarize(rnd: RoundState, out: torch.Tensor, seconds: float) -> AllReduceResult:
    """The result of a round whose every unit has a value; copies the units not yet placed."""
    plan = rnd.plan
    assert plan is not None
    values = []
    both = set(range(plan.n))
    for u, unit in enumerate(rnd.units):
        value = unit.state.value
        assert value is not None
        if not unit.placed:
            out[plan.units[u].span] = value.tensor
        both &= set(value.contributors)
        values.append(value)
    weights = tuple(v.weight for v in values)
    return AllReduceResult(
        vector=out, weight=min(weights, default=0.0),
        contributors=tuple(plan.group[i] for i in sorted(both)),
        missing=tuple(plan.group[i] for i in range(plan.n) if i not in both),
        part_weights=weights, repaired_parts=tuple(u for u, v in enumerate(values) if v.epoch),
        seconds=seconds, bytes_sent=rnd.bytes_sent, bytes_received=rnd.bytes_received)


def aggregate_unit(rnd: RoundState, inputs: list[tuple[int, torch.Tensor, float]],
                   counters: Counters) -> tuple[torch.Tensor, float, list[int]]:
    """Refuse non-finite contributions, aggregate the rest (run in a thread: it touches
    megabytes). ``inputs`` are (group index, tensor, weight); returns the value, its total
    weight and the indices of the contributions kept."""
    plan = rnd.plan
    assert plan is not None and rnd.aggregate is not None
    kept = []
    for i, tensor, w in sorted(inputs, key=lambda x: x[0]):
        try:
            check_finite(tensor, who=plan.group[i])
        except BadGradient as exc:
            counters.add("contributions_refused")
            log.info("round %s: refused %s", rnd.round_id, exc)
            continue
        if w > 0:
            kept.append((i, tensor, w))
    if not kept:
        return torch.zeros(inputs[0][1].numel()), 0.0, []
    out = rnd.aggregate([t for _, t, _ in kept], [w for _, _, w in kept])
    return out, float(sum(w for _, _, w in kept)), [i for i, _, _ in kept]
