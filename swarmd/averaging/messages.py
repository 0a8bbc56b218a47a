"""The messages of a stage's optimizer steps, as values. Pure: no I/O.

Two protocols, each parsed in one place from what came off the wire (``kind``, ``meta``,
``tensors``):

- the round protocol (``/round``, :mod:`swarmd.averaging.stage_sync`): :class:`Progress`,
  :class:`Prepare`, :class:`Start` requests (:func:`parse_round`) and the leader's view of a
  ``prepare`` reply (:func:`parse_prepare_reply`);
- the all-reduce protocol (``/allreduce``, :mod:`swarmd.averaging.allreduce`):
  :class:`Contribute`, :class:`Probe`, :class:`Repair` requests (:func:`parse_request`) and a
  probed peer's :class:`ContributionReply` (:func:`parse_contribution`); a unit's decided value
  is :func:`swarmd.averaging.plan.parse_part`.

Every message is a frozen, slotted, keyword-only dataclass checked when built (types, sizes,
ranges); unknown keys are dropped. Anything invalid raises :class:`BadRoundMessage` or
:class:`~swarmd.averaging.plan.BadAllReduceMessage` (both ``BadPeerMessage``: the sender is at
fault) with a short ``reason``, and nothing else. Who may send what (the leader's ``start``,
a group member's contribution) needs the receiver's state and is checked where that is known;
this module only says what a well-formed message is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from swarmd.averaging.plan import MAX_ROUND_ID_CHARS, BadAllReduceMessage
from swarmd.errors import BadRoundMessage

__all__ = ["MAX_GROUP", "MAX_PEER_ID_CHARS", "Contribute", "ContributionReply", "Prepare",
           "PrepareReply", "Probe", "Progress", "ProgressReply", "Repair", "Start",
           "parse_contribution", "parse_prepare_reply", "parse_progress_reply", "parse_request",
           "parse_round", "sane_weight"]

#: the largest averaging group a ``start`` may announce
MAX_GROUP = 1024
MAX_PEER_ID_CHARS = 128
#: the largest step number accepted (far beyond any run; keeps arithmetic in range)
MAX_STEP = 1 << 53
#: the largest bandwidth a peer may report (bytes per second)
MAX_BANDWIDTH = 1e15
_DIGEST_CHARS = 16
#: the longest weights digest a ``start`` may carry (hex; blake2b-128 is 32)
MAX_PARAMS_DIGEST_CHARS = 64
_HEX = frozenset("0123456789abcdef")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sane_weight(value: object, max_weight: float) -> bool:
    """Whether ``value`` is a usable sample weight: a finite number in [0, ``max_weight``]."""
    return _is_number(value) and math.isfinite(value) and 0 <= value <= max_weight  # type: ignore[operator]


def _bandwidth(value: object) -> float | None:
    """A reported bandwidth, or None when it is not a usable number (never an error: it
    only sizes the parts)."""
    if _is_number(value) and 0 < value < MAX_BANDWIDTH:  # type: ignore[operator]
        return float(value)  # type: ignore[arg-type]
    return None


# ---- the round protocol ---------------------------------------------------------------------

#: a (trainer, trainer step) pair that samples came from (``swarmd.pipeline.exact``)
Source = tuple[str, int]
#: the trainer steps a stage step is exactly made of, one per trainer; empty: not exact
Exact = tuple[Source, ...]
#: most sources a progress report lists (one more than a peer keeps: "several")
MAX_SOURCES = 9


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """A mate's report to the leader: it holds ``samples`` at ``step``, from the trainer
    steps ``sources`` (``swarmd.pipeline.exact``)."""

    stage: int
    step: int
    samples: int
    sources: tuple[Source, ...] = ()

    def __post_init__(self) -> None:
        _check_stage_step(self.stage, self.step)
        if not _is_int(self.samples) or not 0 <= self.samples <= MAX_STEP:
            raise BadRoundMessage("bad_samples", f"samples {self.samples!r}")
        if not isinstance(self.sources, tuple) or len(self.sources) > MAX_SOURCES or not all(
                _is_source(s) for s in self.sources):
            raise BadRoundMessage("bad_sources", f"at most {MAX_SOURCES} [trainer, step] pairs")

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"stage": self.stage, "step": self.step, "samples": self.samples}
        if self.sources:
            meta["sources"] = [list(s) for s in self.sources]
        return meta


def _is_source(value: object) -> bool:
    """A (trainer peer id, trainer step) pair; ("", -1) stands for "more than were kept"."""
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)
            and len(value[0]) <= MAX_PEER_ID_CHARS and _is_int(value[1])
            and -1 <= value[1] <= MAX_STEP)


def _sources(raw: object, reason: str) -> tuple[Source, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_SOURCES:
        raise BadRoundMessage(reason, f"at most {MAX_SOURCES} [trainer, step] pairs")
    return tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in raw)  # type: ignore[misc]


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare:
    """The leader asks a mate for its step and whether it is free for a round."""

    stage: int
    step: int

    def __post_init__(self) -> None:
        _check_stage_step(self.stage, self.step)

    def to_meta(self) -> dict[str, Any]:
        return {"stage": self.stage, "step": self.step}


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareReply:
    """A mate's answer to ``prepare``."""

    step: int
    free: bool
    bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.step) or not 0 <= self.step <= MAX_STEP:
            raise BadRoundMessage("bad_step", f"step {self.step!r}")
        if not isinstance(self.free, bool):
            raise BadRoundMessage("bad_prepare_reply", f"free {self.free!r}")

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step, "free": self.free, "bandwidth": self.bandwidth}


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgressReply:
    """The leader's answer to ``progress``: its step (None from a peer that does not say).
    A leader at an earlier step than the report is catching up: the reporter passes it over
    for that step (``RoundTrigger.passed_over``)."""

    step: int | None = None

    def __post_init__(self) -> None:
        if self.step is not None and (not _is_int(self.step) or not 0 <= self.step <= MAX_STEP):
            raise BadRoundMessage("bad_step", f"step {self.step!r}")

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step}


@dataclass(frozen=True, slots=True, kw_only=True)
class Start:
    """The leader tells the group to average now: every member runs ``round_id`` with
    ``group`` and ``bandwidths`` (one per member, in ``group``'s order, None if unknown).
    ``digest`` is the hex digest of the leader's weights before this step (None: not sent, an
    older peer); a member at the same step with other weights has drifted
    (:func:`swarmd.averaging.authority.same_step_verdict`)."""

    stage: int
    step: int
    round_id: str
    group: tuple[str, ...]
    bandwidths: tuple[float | None, ...]
    digest: str | None = None
    #: the trainer steps the round's samples are exactly made of, one per trainer (empty when
    #: not exact): the members report their step to each of those trainers
    #: (``swarmd.pipeline.exact``)
    sources: tuple[Source, ...] = ()

    def __post_init__(self) -> None:
        _check_stage_step(self.stage, self.step)
        if not isinstance(self.sources, tuple) or len(self.sources) > MAX_SOURCES or not all(
                _is_source(s) and s[0] and s[1] >= 0 for s in self.sources) or len(
                {s[0] for s in self.sources}) != len(self.sources):
            raise BadRoundMessage("bad_sources", "a start's sources are [trainer, step] pairs, "
                                                 "one per trainer")
        if not isinstance(self.round_id, str) or not 0 < len(self.round_id) <= MAX_ROUND_ID_CHARS:
            raise BadRoundMessage("bad_round_id", repr(self.round_id)[:80])
        group = self.group
        if not isinstance(group, tuple) or not 2 <= len(group) <= MAX_GROUP or not all(
                isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID_CHARS for p in group) or (
                len(set(group)) != len(group)):
            raise BadRoundMessage("bad_group", "a start needs 2..1024 distinct peer ids")
        if not isinstance(self.bandwidths, tuple) or len(self.bandwidths) != len(group):
            raise BadRoundMessage("bad_bandwidths", "one bandwidth (or null) per member")
        if self.digest is not None and not (
                isinstance(self.digest, str) and 0 < len(self.digest) <= MAX_PARAMS_DIGEST_CHARS
                and _HEX.issuperset(self.digest)):
            raise BadRoundMessage("bad_digest", "a weights digest is 1..64 lowercase hex "
                                                "characters")

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"stage": self.stage, "step": self.step, "round": self.round_id,
                                "group": list(self.group),
                                "bandwidths": list(self.bandwidths)}
        if self.digest is not None:
            meta["digest"] = self.digest
        if self.sources:
            meta["sources"] = [list(s) for s in self.sources]
        return meta


RoundMessage = Progress | Prepare | Start


def _check_stage_step(stage: object, step: object) -> None:
    if not _is_int(stage) or not 0 <= stage < 1 << 16:  # type: ignore[operator]
        raise BadRoundMessage("bad_stage", f"stage {stage!r}"[:80])
    if not _is_int(step) or not 0 <= step <= MAX_STEP:  # type: ignore[operator]
        raise BadRoundMessage("bad_step", f"step {step!r}"[:80])


def _list(value: object, reason: str) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_GROUP:
        raise BadRoundMessage(reason, "expected a list of at most 1024 items")
    return tuple(value)


def parse_round(kind: str, meta: Mapping[str, Any], tensors: Sequence[Any] = ()
                ) -> RoundMessage:
    """A round request from the wire; unknown keys are dropped. Raises BadRoundMessage."""
    if tensors:
        raise BadRoundMessage("unexpected_tensors", f"{kind[:40]} carries no tensors")
    if not isinstance(meta, Mapping):
        raise BadRoundMessage("bad_meta", "meta must be a map")
    stage, step = meta.get("stage"), meta.get("step")
    if kind == "progress":
        return Progress(stage=stage, step=step, samples=meta.get("samples"),  # type: ignore[arg-type]
                        sources=_sources(meta.get("sources"), "bad_sources"))
    if kind == "prepare":
        return Prepare(stage=stage, step=step)  # type: ignore[arg-type]
    if kind == "start":
        group = _list(meta.get("group"), "bad_group")
        bandwidths = tuple(_bandwidth(b) for b in _list(meta.get("bandwidths"),
                                                       "bad_bandwidths"))
        return Start(stage=stage, step=step, round_id=meta.get("round"),  # type: ignore[arg-type]
                     group=group, bandwidths=bandwidths, digest=meta.get("digest"),
                     sources=_sources(meta.get("sources"), "bad_sources"))
    raise BadRoundMessage("unknown_kind", repr(kind)[:64])


def parse_prepare_reply(kind: str, meta: Mapping[str, Any]) -> PrepareReply:
    """A mate's reply to ``prepare``; raises BadRoundMessage if it is not one."""
    if kind != "ok" or not isinstance(meta, Mapping):
        raise BadRoundMessage("bad_prepare_reply", f"kind {kind[:40]!r}")
    return PrepareReply(step=meta.get("step"), free=meta.get("free"),  # type: ignore[arg-type]
                        bandwidth=_bandwidth(meta.get("bandwidth")))


def parse_progress_reply(kind: str, meta: Mapping[str, Any]) -> ProgressReply:
    """The leader's reply to ``progress``; raises BadRoundMessage if it is not one."""
    if kind != "ok" or not isinstance(meta, Mapping):
        raise BadRoundMessage("bad_progress_reply", f"kind {kind[:40]!r}")
    return ProgressReply(step=meta.get("step"))


# ---- the all-reduce protocol ---------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class _Addressed:
    """What every all-reduce request carries: round, plan digest, unit, and how long the
    sender will wait for the answer (seconds, capped by the receiver)."""

    round_id: str
    digest: str
    unit: int
    wait: float

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, str) or not 0 < len(self.round_id) <= MAX_ROUND_ID_CHARS:
            raise BadAllReduceMessage("bad_meta", f"round {self.round_id!r}"[:80])
        if not isinstance(self.digest, str) or len(self.digest) != _DIGEST_CHARS:
            raise BadAllReduceMessage("bad_meta", f"digest {self.digest!r}"[:80])
        if not _is_int(self.unit) or not 0 <= self.unit < 1 << 24:
            raise BadAllReduceMessage("bad_meta", f"unit {self.unit!r}"[:80])
        if not _is_number(self.wait) or not 0 <= self.wait < math.inf:
            raise BadAllReduceMessage("bad_meta", f"wait {self.wait!r}"[:80])


@dataclass(frozen=True, slots=True, kw_only=True)
class Contribute(_Addressed):
    """A peer's slice of one unit for its owner, with the samples behind it."""

    weight: float
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        _Addressed.__post_init__(self)
        if not (_is_number(self.weight) and math.isfinite(self.weight) and self.weight >= 0):
            raise BadAllReduceMessage("bad_contribution", f"weight {self.weight!r}"[:80])
        if not (isinstance(self.tensor, torch.Tensor) and self.tensor.dtype == torch.float32
                and self.tensor.dim() == 1):
            raise BadAllReduceMessage("bad_contribution", "needs one flat float32 tensor")


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe(_Addressed):
    """A repairer of ``epoch`` asks for the unit's value or the receiver's contribution,
    holding the request up to ``hold`` seconds for a receiver that has not joined yet."""

    epoch: int
    hold: float = 0.0

    def __post_init__(self) -> None:
        _Addressed.__post_init__(self)
        if not _is_int(self.epoch) or not 1 <= self.epoch <= MAX_GROUP:
            raise BadAllReduceMessage("bad_epoch", f"epoch {self.epoch!r}"[:80])
        if not _is_number(self.hold) or not 0 <= self.hold < math.inf:
            raise BadAllReduceMessage("bad_epoch", f"hold {self.hold!r}"[:80])


@dataclass(frozen=True, slots=True, kw_only=True)
class Repair(_Addressed):
    """A peer asks the ``epoch``-th repairer of the unit for its value."""

    epoch: int

    def __post_init__(self) -> None:
        _Addressed.__post_init__(self)
        if not _is_int(self.epoch) or not 1 <= self.epoch <= MAX_GROUP:
            raise BadAllReduceMessage("bad_epoch", f"epoch {self.epoch!r}"[:80])


AllReduceRequest = Contribute | Probe | Repair


def parse_request(kind: str, meta: Mapping[str, Any], tensors: Sequence[Any], *,
                  max_wait: float) -> AllReduceRequest:
    """An all-reduce request from the wire, ``wait`` and ``hold`` capped at ``max_wait``;
    unknown keys are dropped. Raises BadAllReduceMessage."""
    if not isinstance(meta, Mapping):
        raise BadAllReduceMessage("bad_meta", "meta must be a map")
    wait = meta.get("t")
    if _is_number(wait) and wait >= 0:
        wait = min(float(wait), max_wait)
    base = {"round_id": meta.get("r"), "digest": meta.get("d"), "unit": meta.get("u"),
            "wait": wait}
    if kind == "contribute":
        if len(tensors) != 1:
            raise BadAllReduceMessage("bad_contribution", "needs exactly one tensor")
        return Contribute(**base, weight=meta.get("w"), tensor=tensors[0])
    if tensors:
        raise BadAllReduceMessage("unexpected_tensors", f"{kind[:40]} carries no tensors")
    if kind == "probe":
        hold = meta.get("g", 0.0)
        if _is_number(hold) and hold >= 0 and _is_number(wait):
            hold = min(float(hold), wait)
        return Probe(**base, epoch=meta.get("e"), hold=hold)
    if kind == "repair":
        return Repair(**base, epoch=meta.get("e"))
    raise BadAllReduceMessage("unknown_kind", repr(kind)[:64])


@dataclass(frozen=True, slots=True, kw_only=True)
class ContributionReply:
    """A probed peer hands over its contribution to a unit (it holds no value of it)."""

    weight: float
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if not (_is_number(self.weight) and math.isfinite(self.weight) and self.weight >= 0):
            raise BadAllReduceMessage("bad_contribution", f"weight {self.weight!r}"[:80])
        if not (isinstance(self.tensor, torch.Tensor) and self.tensor.dtype == torch.float32
                and self.tensor.dim() == 1):
            raise BadAllReduceMessage("bad_contribution", "needs one flat float32 tensor")


def parse_contribution(kind: str, meta: Mapping[str, Any], tensors: Sequence[Any], *,
                       length: int, max_weight: float) -> ContributionReply:
    """A ``contribution`` reply to a probe, of ``length`` elements and a sane weight."""
    if kind != "contribution" or len(tensors) != 1 or not isinstance(meta, Mapping):
        raise BadAllReduceMessage("bad_contribution", f"kind {kind[:40]!r}")
    reply = ContributionReply(weight=meta.get("w"), tensor=tensors[0])  # type: ignore[arg-type]
    if reply.tensor.numel() != length:
        raise BadAllReduceMessage("bad_contribution", f"{reply.tensor.numel()} elements, "
                                                      f"the unit has {length}")
    if reply.weight > max_weight:
        raise BadAllReduceMessage("bad_weight", f"weight {reply.weight} > {max_weight}")
    return ContributionReply(weight=float(reply.weight), tensor=reply.tensor)
