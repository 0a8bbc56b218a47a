"""The decisions of one all-reduce round, without I/O: who owns which slice, who repairs a
unit whose owner is gone, which value of a unit a peer may accept, what a valid reply is.

A round is ``(round_id, group, parts)``: ``group`` is the sorted tuple of peer ids, and
``parts[j]`` elements of the flat vector, one contiguous slice, are owned by ``group[j]``. Each
part is cut into chunks, the *units* (:attr:`RoundPlan.units`). Every peer sends its slice of
each unit to the unit's owner; the owner aggregates what it got and sends the result back
(reduce-scatter, then all-gather), unit by unit, so that the two phases overlap.

Repair. A unit's value carries an *epoch*: 0 when its owner aggregated it, ``e`` when the
``e``-th peer of :meth:`RoundPlan.chain` produced it because the owner was unreachable. The
repairer of epoch ``e`` first *probes* every other peer: a peer holding a value of the unit
hands it over (the repairer relays it); a peer without one hands over its contribution and
from then on refuses values of lower epochs (:meth:`PartState.raise_floor`). If nobody held a
value, the repairer aggregates the contributions. So once a repairer decides, no peer it
reached can still take the owner's (or an earlier repairer's) value, and survivors agree; only
a peer the repairer could not reach but others could may disagree (a network partition).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from swarmd.errors import BadPeerMessage
from swarmd.links import Transfer

__all__ = ["DEFAULT_CHUNK", "DEFAULT_MIN_PART", "BadAllReduceMessage", "PartState", "PartValue",
           "RoundPlan", "Unit", "fits", "parse_part", "pick_relayed", "plan_parts"]

#: a part gets at least this many elements (unless the vector is too short for everyone)
DEFAULT_MIN_PART = 1024
#: elements per unit (16 MB of float32). Smaller units overlap the phases better but cost
#: CPU per message (streams, threads, bridge crossings): on 2 shared cores, 1 Mi elements
#: took 40% more CPU per round than one unit per part, 4 Mi about 10% (tools/bench_averaging)
DEFAULT_CHUNK = 1 << 22
MAX_CHUNKS_PER_PART = 16
#: the longest round id accepted (they travel in every message)
MAX_ROUND_ID_CHARS = 128


def plan_parts(total_len: int, bandwidths: Sequence[float | None], *,
               min_part: int = DEFAULT_MIN_PART) -> list[int]:
    """Part lengths proportional to ``bandwidths``, each at least ``min_part`` (or an equal
    share when the vector is too short for that), summing to exactly ``total_len``.

    An unknown (None), non-finite or non-positive bandwidth counts as the mean of the known
    ones; with none known the parts are equal. Rounding: largest remainder, ties to the
    earlier peer, so the result is deterministic.
    """
    n = len(bandwidths)
    if n == 0:
        raise ValueError("plan_parts needs at least one peer")
    if total_len < 0 or min_part < 0:
        raise ValueError(f"total_len and min_part must be non-negative, got {total_len}, "
                         f"{min_part}")
    known = [float(b) for b in bandwidths
             if b is not None and math.isfinite(float(b)) and float(b) > 0]
    fill = sum(known) / len(known) if known else 1.0
    bw = [float(b) if b is not None and math.isfinite(float(b)) and float(b) > 0 else fill
          for b in bandwidths]
    floor = min(min_part, total_len // n)
    # water-filling: peers whose share falls below the floor get the floor, the rest share
    # what is left in proportion to their bandwidth
    fixed: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in fixed]
        left = total_len - floor * len(fixed)
        weight = sum(bw[i] for i in free)
        ideal = {i: left * bw[i] / weight for i in free}
        low = {i for i in free if ideal[i] < floor}
        if not low:
            break
        fixed |= low
    shares = [float(floor) if i in fixed else ideal[i] for i in range(n)]
    parts = [int(math.floor(s)) for s in shares]
    short = total_len - sum(parts)
    by_remainder = sorted(range(n), key=lambda i: (-(shares[i] - parts[i]), i))
    for i in by_remainder[:short]:
        parts[i] += 1
    assert sum(parts) == total_len and min(parts) >= floor  # internal invariant
    return parts


class Unit(NamedTuple):
    """A contiguous slice of the vector, reduced on its own: one chunk of one peer's part."""

    owner: int
    start: int
    length: int

    @property
    def span(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan:
    """What every peer of a round must agree on; validated when built.

    Each peer's part is cut into chunks of about ``chunk`` elements (at most
    ``MAX_CHUNKS_PER_PART``), the *units*, listed round-robin over the owners: sent one after
    another to each owner, they let an owner aggregate and answer one chunk while the next is
    still arriving (a pipeline), instead of waiting for the whole part.
    """

    round_id: str
    #: peer ids, sorted, unique
    group: tuple[str, ...]
    #: elements owned by each peer of ``group``, in the same order
    parts: tuple[int, ...]
    #: elements per unit (about)
    chunk: int = DEFAULT_CHUNK
    units: tuple[Unit, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, str) or not 0 < len(self.round_id) <= MAX_ROUND_ID_CHARS:
            raise ValueError(f"round_id must be a 1..{MAX_ROUND_ID_CHARS} char string, "
                             f"got {self.round_id!r}")
        group, parts = tuple(self.group), tuple(int(p) for p in self.parts)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "parts", parts)
        if not group or list(group) != sorted(set(group)):
            raise ValueError("group must be a non-empty tuple of unique, sorted peer ids")
        if len(parts) != len(group) or min(parts) < 0:
            raise ValueError(f"parts must give a non-negative length per peer of the group "
                             f"({len(group)}), got {parts}")
        if not (isinstance(self.chunk, int) and self.chunk > 0):
            raise ValueError(f"chunk must be a positive number of elements, got {self.chunk!r}")
        object.__setattr__(self, "units", self._cut())

    def _cut(self) -> tuple[Unit, ...]:
        per_owner, start = [], 0
        for j, length in enumerate(self.parts):
            k = min(MAX_CHUNKS_PER_PART, max(1, -(-length // self.chunk))) if length else 0
            sizes = [length // k + (1 if c < length % k else 0) for c in range(k)]
            units = []
            for size in sizes:
                units.append(Unit(j, start, size))
                start += size
            per_owner.append(units)
        depth = max((len(u) for u in per_owner), default=0)
        return tuple(u[c] for c in range(depth) for u in per_owner if c < len(u))

    @classmethod
    def build(cls, round_id: str, group: Sequence[str], total_len: int, *,
              parts: Sequence[int] | None = None,
              bandwidths: Sequence[float | None] | None = None,
              min_part: int = DEFAULT_MIN_PART, chunk: int = DEFAULT_CHUNK) -> RoundPlan:
        """Sort ``group``; take ``parts`` as given (in sorted-group order) or plan them from
        ``bandwidths`` (given in the caller's ``group`` order; equal parts when None)."""
        order = sorted(range(len(group)), key=lambda i: group[i])
        ordered = tuple(group[i] for i in order)
        if parts is None:
            bw = [None] * len(group) if bandwidths is None else [bandwidths[i] for i in order]
            parts = plan_parts(total_len, bw, min_part=min_part)
        plan = cls(round_id=round_id, group=ordered, parts=tuple(parts), chunk=chunk)
        if plan.total != total_len:
            raise ValueError(f"parts sum to {plan.total}, the vector has {total_len} elements")
        return plan

    @property
    def n(self) -> int:
        return len(self.group)

    @property
    def total(self) -> int:
        return sum(self.parts)

    def index(self, peer_id: str) -> int:
        try:
            return self.group.index(peer_id)
        except ValueError:
            raise ValueError(f"peer {peer_id} is not in the group of round "
                             f"{self.round_id}") from None

    @property
    def digest(self) -> str:
        """Names the plan in every message: peers with different plans never mix parts."""
        h = hashlib.sha256()
        for item in (self.round_id, *self.group, *map(str, self.parts), str(self.chunk)):
            h.update(item.encode())
            h.update(b"\0")
        return h.hexdigest()[:16]

    def transfers(self, me: int, bytes_per_value: float) -> list[Transfer]:
        """What peer ``me`` moves with each other peer in a round without repairs, each way:
        its contribution to their part and their answer back (their part's length), their
        contributions to its part and its answers (its part's length); one round trip per
        unit exchanged, plus one for the dial. The round's deadline derives from these
        (``LinkEstimates.deadline_all``)."""
        units_of = [0] * self.n
        for unit in self.units:
            units_of[unit.owner] += 1
        return [Transfer(self.group[j],
                         int(math.ceil((self.parts[j] + self.parts[me]) * bytes_per_value)),
                         units_of[j] + units_of[me] + 1)
                for j in range(self.n) if j != me]

    def chain(self, u: int) -> list[tuple[int, int]]:
        """``(epoch, peer index)`` of the peers that repair unit ``u``, in order: the peers
        after its owner in group order, wrapping around (epochs 1, 2, ...)."""
        owner = self.units[u].owner
        return [(e, (owner + e) % self.n) for e in range(1, self.n)]


@dataclass(frozen=True, slots=True)
class PartValue:
    """The decided value of a part: what every peer of the round ends up holding."""

    tensor: torch.Tensor
    epoch: int
    #: total weight of the contributions aggregated into it
    weight: float
    #: group indices of the peers whose contributions it holds
    contributors: tuple[int, ...]

    def meta(self) -> dict[str, Any]:
        return {"e": self.epoch, "W": self.weight, "c": list(self.contributors)}


@dataclass(slots=True)
class PartState:
    """What one peer knows of one part during a round."""

    value: PartValue | None = None
    #: values of lower epochs are refused: this peer answered a repairer of this epoch
    floor: int = 0
    #: the values this peer got that it refused (counters, debugging)
    refused: list[int] = field(default_factory=list)

    def offer(self, value: PartValue) -> bool:
        """Take ``value`` unless a value is held already or its epoch is below the floor."""
        if self.value is not None:
            return False
        if value.epoch < self.floor:
            self.refused.append(value.epoch)
            return False
        self.value = value
        return True

    def raise_floor(self, epoch: int) -> None:
        """A repairer of ``epoch`` asked: from now on refuse values of earlier epochs."""
        self.floor = max(self.floor, epoch)


def pick_relayed(found: Sequence[PartValue]) -> PartValue | None:
    """Of the values probed peers already held, the one a repairer relays: the latest epoch
    (several differ only after a partition); None when nobody held one."""
    return max(found, key=lambda v: v.epoch) if found else None


class BadAllReduceMessage(BadPeerMessage):
    """An all-reduce message that breaks the protocol (meta, sizes, indices)."""

    code = "bad_allreduce_message"


def fits(plan: RoundPlan, u: int, tensor: object) -> bool:
    """Whether ``tensor`` can be unit ``u``'s slice: flat float32 of the unit's length."""
    return (0 <= u < len(plan.units) and isinstance(tensor, torch.Tensor)
            and tensor.dtype == torch.float32 and tensor.dim() == 1
            and tensor.numel() == plan.units[u].length)


def parse_part(plan: RoundPlan, u: int, kind: str, meta: Mapping[str, Any],
               tensors: Sequence[Any], *, max_weight: float = math.inf) -> PartValue:
    """A ``part`` reply (a unit's decided value) from an untrusted peer, validated; its total
    weight is at most ``max_weight`` (a peer's bound) per member of the group."""
    if not isinstance(meta, Mapping):
        raise BadAllReduceMessage("bad_part", f"{kind[:40]} without a meta map")
    e, weight, who = meta.get("e"), meta.get("W"), meta.get("c")
    ok = (kind == "part" and len(tensors) == 1 and fits(plan, u, tensors[0])
          and isinstance(e, int) and not isinstance(e, bool) and 0 <= e < plan.n
          and isinstance(weight, (int, float)) and not isinstance(weight, bool)
          and math.isfinite(weight) and 0 <= weight <= max_weight * plan.n
          and isinstance(who, list) and len(set(who)) == len(who)
          and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < plan.n
                  for i in who))
    if not ok:
        raise BadAllReduceMessage("bad_part", f"{kind} {dict(meta)!r}"[:200])
    return PartValue(tensors[0], e, float(weight), tuple(sorted(who)))
