"""Exact steps: every part of the model steps once per target batch of samples, on exactly
its gradient, clipped by the whole model's norm. Pure: no I/O, no clock.

With the synchronous schedule (``training.schedule = "sync"``) a trainer sends a step's
microbatches, waits for all of them, and steps; each stage peer steps once its stage holds
that step's samples. Several trainers split each step's microbatches between them
(``swarmd.trainer.shares``) and average their parts' gradients before they step
(``swarmd.trainer.trainer_sync``), so a step of the swarm is one target batch however many
trainers there are. Two things keep that exactly what one process would do
(docs/pipeline.md, "Exact steps"):

- **Step reports.** Before a stage applies a step whose samples are exactly one target batch
  made of one step of each trainer (:class:`Sources`, :func:`exact_step`; with mates, the
  round's leader decides from its and their reports), it reports to each of those trainers
  the squared norm of the step's mean
  gradient and the stage step it is at (``messages.StepReport``), and waits for the answer:
  the coefficient every part scales its gradient by, ``clip / (whole norm + 1e-6)`` capped at
  1 (what ``torch.nn.utils.clip_grad_norm_`` does over the whole model). The trainer's
  :class:`StepBoard` collects one report per stage and its own part's, and answers them all
  at once; a step whose reports do not all arrive in time is answered ``None`` (every part
  then clips on its own, as before), so the parts of one step always agree.
- **Expected stage steps.** The trainer learns from the reports the stage step each stage
  applied its step at; the next step's forwards carry the stage steps they must run on
  (``Forward.at``), and a stage peer that has not taken that step yet holds them until it has
  (a forward that overtook the step's answer, or a round still averaging). Without them a
  forward could run on the weights before the step and its gradient count one step late.

A stage step the reports named can vanish: the peer that took it left the stage (a move to
the bottleneck, a crash) before a mate that joined a step earlier caught up. No peer of the
stage can ever run a forward that names it (each refuses with busy), so a trainer whose
forwards keep failing while every peer of a stage announces a lower step
(:func:`stages_behind`) stops naming stage steps until the stages report again.

**Norm notes.** Waiting for the answer costs a stage a round trip to the trainer at every
step boundary, and the stage that finishes last (stage 0, where the embedding is) holds up
the next step's forwards for it. So where one trainer's step is the whole swarm step and the
trainer holds no embedding (its part's gradient is complete once every microbatch's head
backward ran, before the stages finish), the trainer sends its part's squared norm and its
clipping bound to the stage peers (``messages.NormNote``), each stage peer stepping alone
sends its own to the other stages' peers as it reports, and a stage peer holding every
part's norm computes the coefficient itself (:class:`NormNotes`) instead of waiting: the same
number the trainer answers, bitwise, since both sum the parts in one order
(:func:`whole_coefficient`). The report still goes (the trainer needs the stage's norm and
stage step); whichever comes first, the notes or the answer, is used.

After the coefficient scales a part's gradient, its own clipping (``SwarmOptimizer``,
``training.grad_clip``) is a no-op: a part's norm is at most the whole model's.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from swarmd.averaging.trigger import exact_step

__all__ = ["Sources", "exact_step", "clip_coefficient", "whole_coefficient", "StepBoard",
           "Posted", "NormNotes", "MAX_SOURCES", "EPS"]

#: a peer reports at most this many (trainer, step) sources of its samples
MAX_SOURCES = 8
#: as ``torch.nn.utils.clip_grad_norm_``
EPS = 1e-6
#: reports of one stage that differ by more than this (relative) disagree
AGREE = 1e-3


Source = tuple[str, int]


@dataclass(slots=True)
class Sources:
    """The (trainer, trainer step) pairs of the samples a stage peer accumulated since its
    last step (at most ``MAX_SOURCES``; more is as good as many: not exact).

    The worker adds a backward's pair in the compute thread, in the same call that adds its
    samples, and the step takes them with the gradient: the event loop only reads
    (``peek``), under the lock. (Added in the loop after the backward, a pair could miss the
    step whose gradient held it and land in the next: both steps not exact, and the trainer
    waited ``REPORTS_MAX_S`` for a report that never came.)"""

    _seen: set[Source] = field(default_factory=set)
    #: more pairs were seen than kept
    overflowed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, trainer: str, step: int) -> None:
        with self._lock:
            if (trainer, step) in self._seen:
                return
            if len(self._seen) >= MAX_SOURCES:
                self.overflowed = True
                return
            self._seen.add((trainer, step))

    def peek(self) -> list[Source]:
        """The pairs held, sorted; one more than ``MAX_SOURCES`` pairs when it overflowed
        (so that a reader never takes it for exact)."""
        with self._lock:
            return self._pairs()

    def take(self) -> list[Source]:
        """``peek()``, and start over (the peer stepped)."""
        with self._lock:
            out = self._pairs()
            self._seen.clear()
            self.overflowed = False
            return out

    def _pairs(self) -> list[Source]:
        out = sorted(self._seen)
        return out + [("", -1)] if self.overflowed else out


def clip_coefficient(sqnorms: Iterable[float], clip: float) -> float:
    """What every part scales its gradient by: ``clip / (norm + EPS)`` capped at 1, the norm
    over all parts together; 1 without clipping (``clip`` 0)."""
    total = math.sqrt(sum(sqnorms))
    if not clip or not math.isfinite(total):
        return 1.0
    return min(1.0, clip / (total + EPS))


def whole_coefficient(stages: Sequence[float], trainer: float, clip: float) -> float:
    """:func:`clip_coefficient` over the stages' squared norms (stage order) and then the
    trainer's part's: the one order in which the trainer's board and a stage holding every
    part's norm (``NormNotes``) both sum them, so that they get the same number, bitwise."""
    return clip_coefficient([*stages, trainer], clip)


def stages_behind(expected: Sequence[int],
                  announced: Sequence[Mapping[str, int]]) -> list[int]:
    """The stages whose every peer announces a step below the one ``expected`` names for
    it (``announced[stage]``: peer -> its announced step). A stage with no peer in view is
    not among them: that is a missing stage, waited for."""
    return [stage for stage, want in enumerate(expected)
            if stage < len(announced) and announced[stage]
            and max(announced[stage].values()) < want]


class Posted:
    """What :meth:`StepBoard.post` made of a report."""

    TAKEN = "taken"
    #: a second report of a stage at a step, agreeing with the first
    AGAIN = "again"
    #: a second report of a stage at a step, with another norm: the first counts
    DISAGREES = "disagrees"
    #: a step this trainer is not waiting for (not open, or answered already)
    NOT_OPEN = "not_open"
    #: a stage said it takes no step for it: the step is answered None
    FAILED = "failed"


@dataclass(slots=True)
class _Step:
    samples: int
    stages: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    own: float | None = None
    coefficient: float | None = None
    answered: bool = False


@dataclass(slots=True)
class StepBoard:
    """A trainer's side: the reports of each of its steps, and the answer they get.

    ``open(step, samples)`` when a step's microbatches are all back; stages ``post`` their
    reports (before or after: a report may arrive first); ``own(step, sqnorm)`` the trainer's
    part's; once every stage and the trainer posted, ``complete`` is true and ``answer``
    gives the coefficient (``expire`` answers None instead, when the wait is over). The
    stage steps reported for a step are what the next step's forwards expect
    (``expected``). At most ``keep`` steps are remembered."""

    num_stages: int
    clip: float
    keep: int = 64
    _steps: dict[int, _Step] = field(default_factory=dict)
    #: stage -> the stage step at which it applied the last reported step
    _applied_at: dict[int, int] = field(default_factory=dict)
    #: reports of a stage whose samples differ from the trainer's step's
    samples_mismatch: int = 0

    def open(self, step: int, samples: int) -> None:
        entry = self._steps.get(step)
        if entry is None:
            self._steps[step] = _Step(samples)
        else:
            entry.samples = samples
        self._forget(step)

    def _forget(self, newest: int) -> None:
        for old in [s for s in self._steps if s <= newest - self.keep]:
            del self._steps[old]

    def is_open(self, step: int) -> bool:
        entry = self._steps.get(step)
        return entry is not None and not entry.answered

    def post(self, step: int, stage: int, sqnorm: float, stage_step: int,
             samples: int) -> str:
        """A stage's report (checked by the caller: a finite ``sqnorm`` >= 0, a stage of this
        model). A report for a step not opened yet is kept: the stage may be quicker than the
        trainer's last gradient."""
        entry = self._steps.get(step)
        if entry is None:
            if self._steps and step < max(self._steps) - self.keep:
                return Posted.NOT_OPEN
            entry = self._steps[step] = _Step(samples=-1)
        if entry.answered:
            return Posted.NOT_OPEN
        held = entry.stages.get(stage)
        if held is not None:
            if abs(held[0] - sqnorm) <= AGREE * max(held[0], sqnorm, 1e-30):
                return Posted.AGAIN
            return Posted.DISAGREES
        entry.stages[stage] = (sqnorm, stage_step, samples)
        return Posted.TAKEN

    def fail(self, step: int) -> str:
        """A stage takes no step for ``step`` now (its round failed): the step can never be
        complete, so it is answered None at once (``expire``)."""
        entry = self._steps.get(step)
        if entry is not None and entry.answered:
            return Posted.NOT_OPEN
        self.expire(step)
        return Posted.FAILED

    def missing(self, step: int) -> list[int]:
        """The stages whose report of ``step`` has not come (every stage for a step unknown)."""
        entry = self._steps.get(step)
        return [s for s in range(self.num_stages) if entry is None or s not in entry.stages]

    def own(self, step: int, sqnorm: float) -> None:
        """The trainer's part's squared norm of ``step``; the first one given stays (the one
        its norm notes told the stages: ``NormNotes``)."""
        entry = self._steps.setdefault(step, _Step(samples=-1))
        if entry.own is None:
            entry.own = sqnorm

    def complete(self, step: int) -> bool:
        entry = self._steps.get(step)
        return (entry is not None and entry.own is not None and entry.samples >= 0
                and all(s in entry.stages for s in range(self.num_stages)))

    def answer(self, step: int) -> float | None:
        """The step's coefficient once complete (then also the stage steps the next step
        expects); None while not complete or once expired."""
        entry = self._steps.get(step)
        if entry is None:
            return None
        if not entry.answered and self.complete(step):
            assert entry.own is not None
            entry.coefficient = whole_coefficient(
                [entry.stages[s][0] for s in range(self.num_stages)], entry.own, self.clip)
            entry.answered = True
            for stage, (_, stage_step, samples) in entry.stages.items():
                self._applied_at[stage] = stage_step
                if samples and samples != entry.samples:  # 0: not said (a round's member)
                    self.samples_mismatch += 1
        return entry.coefficient

    def norm(self, step: int) -> float | None:
        """The whole model's gradient norm of a complete step (before clipping), else None."""
        entry = self._steps.get(step)
        if entry is None or not self.complete(step):
            return None
        assert entry.own is not None
        return math.sqrt(entry.own + sum(v[0] for v in entry.stages.values()))

    def expire(self, step: int) -> None:
        """The wait for ``step``'s reports is over: it is answered None (each part clips its
        own), and the stages' next steps are not known any more."""
        entry = self._steps.setdefault(step, _Step(samples=-1))
        if not entry.answered:
            entry.answered = True
            entry.coefficient = None
            self._applied_at.clear()

    def answered(self, step: int) -> bool:
        entry = self._steps.get(step)
        return entry is not None and entry.answered

    def expected(self) -> tuple[int, ...] | None:
        """The stage steps the next step's forwards must run on (each stage's last reported
        step + 1), None unless every stage reported the last step."""
        if len(self._applied_at) != self.num_stages:
            return None
        return tuple(self._applied_at[s] + 1 for s in range(self.num_stages))

    def flushed(self, stage: int, stage_step: int) -> None:
        """``stage`` is at ``stage_step`` after a flush: the next step's forwards run on it."""
        self._applied_at[stage] = stage_step - 1

    def reset(self) -> None:
        """Forget the stages' steps (a restart, or a schedule that does not report)."""
        self._applied_at.clear()


@dataclass(slots=True)
class NormNotes:
    """A stage peer's side of the norm notes: the parts' squared norms of the trainer steps it
    was told of (part ``num_stages`` is the trainer's, with its clipping bound), the last
    ``keep`` (trainer, step) told of (not the highest steps: a trainer that starts over at
    step 0 after another ran to step 40 must not have its notes dropped as old).
    ``coefficient`` is the whole model's once every part's norm is here (this peer's own
    included), else None."""

    num_stages: int
    keep: int = 16
    #: (trainer, step) -> part -> squared norm
    _parts: dict[Source, dict[int, float]] = field(default_factory=dict)
    _clip: dict[Source, float] = field(default_factory=dict)

    def add(self, trainer: str, step: int, part: int, sqnorm: float,
            clip: float | None = None) -> None:
        """A part's norm (checked by the caller: a part of this model, finite, >= 0; the
        trainer's part with its ``clip``). A second note of a stage's part keeps the first; a
        second of the trainer's starts the step over (the trainer sends one a step: this is
        a restarted trainer taking that step again, and what was told before is stale)."""
        key = (trainer, step)
        parts = self._parts.get(key)
        if parts is not None and part == self.num_stages and part in parts:
            del self._parts[key]
            self._clip.pop(key, None)
            parts = None
        if parts is None:
            parts = self._parts[key] = {}
            while len(self._parts) > self.keep:  # the first told is forgotten first
                oldest = next(iter(self._parts))
                del self._parts[oldest]
                self._clip.pop(oldest, None)
        parts.setdefault(part, sqnorm)
        if part == self.num_stages and clip is not None:
            self._clip.setdefault(key, clip)

    def has_trainer(self, trainer: str, step: int) -> bool:
        """Whether the trainer told its part's norm of ``step`` (it takes part in notes)."""
        return self.num_stages in self._parts.get((trainer, step), {})

    def coefficient(self, trainer: str, step: int) -> float | None:
        parts = self._parts.get((trainer, step), {})
        clip = self._clip.get((trainer, step))
        if clip is None or any(p not in parts for p in range(self.num_stages + 1)):
            return None
        return whole_coefficient([parts[s] for s in range(self.num_stages)],
                                 parts[self.num_stages], clip)
