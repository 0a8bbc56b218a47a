"""Gather a whole model from a live swarm: every stage's weights and the trainers' parts.

The adapter around :mod:`swarmd.export.cut`: it asks every peer of every stage for the step
and round digest of its weights (``state_digest``), lets :func:`~swarmd.export.cut.decide`
pick a cut, downloads each stage at the cut's step over the state protocol
(:func:`swarmd.state.fetch.fetch_state`: chunk checksums, the whole snapshot's digest, sizes,
no NaN/Inf, resumed from another peer of the same snapshot), and checks what arrived fits the
model and has the round digest the stage's peers report for that step
(:mod:`swarmd.export.parts`). A stage that stepped on during its download breaks the cut: it
is taken again. A peer whose weights fail a check is left out from then on (the message of
the error at the end names it and why); one whose transfer failed is left out after
``MAX_TRANSFER_FAILURES``. Then the trainers' parts come from a :class:`PartsSource`.

Every network call has a deadline: a digest question ``DIGEST_TIMEOUT_S``, a transfer
``transfer_timeout_s``; the cut waits at most ``deadline_s`` in all, asking again every
``poll_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarmd.errors import InconsistentCut, PartUnverified, StageUnavailable
from swarmd.export.cut import Cut, Heard, Wait, decide
from swarmd.export.parts import NamedPart, PartMismatch, stage_part
from swarmd.models.seam import ModelSeam
from swarmd.protocols import Protocols
from swarmd.state.encoding import MAX_STATE_BYTES, StageState
from swarmd.state.fetch import ask_digest, fetch_state
from swarmd.state.transfer import StateTransferFailed

__all__ = ["CollectSettings", "Collected", "PartReport", "PartsSource", "SwarmView",
           "collect", "Progress"]

log = logging.getLogger("swarmd.export")

DIGEST_TIMEOUT_S = 10.0
#: peers of a stage asked for their digest at most
MAX_ASKED = 8
MAX_TRANSFER_FAILURES = 2

#: ``progress(part, done_bytes, total_bytes)``
Progress = Callable[[str, int, int], None]


class SwarmView(Protocol):
    """What the collector needs of membership (``MembershipService`` has it)."""

    def state_sources(self, stage: int) -> list[tuple[str, tuple[str, ...]]]: ...

    def trainers(self) -> dict[str, tuple[str, ...]]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectSettings:
    #: how long the cut may take to be consistent (and a missing stage to appear), seconds
    deadline_s: float = 120.0
    #: a cut at this step or later is waited for during ``prefer_s`` (the periodic export
    #: asks for its own step); None: any step
    min_step: int | None = None
    prefer_s: float = 30.0
    #: after ``deadline_s``, take each stage at its own step rather than fail
    mixed: bool = False
    transfer_timeout_s: float = 600.0
    poll_s: float = 0.25
    max_bytes: int = MAX_STATE_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class PartReport:
    """Where one part came from: ``part`` ("stage 0", "trainers"), the ``step`` its weights are
    at (the trainers': their round; ``trainer_step`` the trainer's own step when said),
    ``source`` (a peer id, "this trainer", or a file), whether its round digest matched what
    its peers report (``verified``), and the bytes downloaded for it."""

    part: str
    step: int
    source: str
    verified: bool
    bytes: int = 0
    trainer_step: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Collected:
    stages: Mapping[int, NamedPart]
    trainer: NamedPart
    reports: tuple[PartReport, ...]
    #: the one step of every stage (None: a mixed cut, see the reports)
    step: int | None


@dataclass(slots=True)
class Context:
    """What a :class:`PartsSource` may use: the host, the view, the model and settings."""

    host: Any
    view: SwarmView
    seam: ModelSeam
    swarm: str
    model_hash: str
    dtype: torch.dtype
    settings: CollectSettings
    progress: Progress | None = None
    protocol: str = field(init=False)

    def __post_init__(self) -> None:
        self.protocol = Protocols(self.swarm).state


class PartsSource(Protocol):
    """Where the trainers' embedding and head come from (``swarmd.export.trainer_parts``)."""

    async def take(self, ctx: Context, cut_step: int | None) -> tuple[NamedPart, PartReport]:
        ...


async def collect(host: Any, view: SwarmView, seam: ModelSeam, *, swarm: str, num_stages: int,
                  model_hash: str, dtype: torch.dtype, parts: PartsSource,
                  settings: CollectSettings = CollectSettings(),
                  progress: Progress | None = None,
                  say: Callable[[str], None] = lambda line: None) -> Collected:
    """Every stage at one step (or the error saying why not) and the trainers' parts."""
    ctx = Context(host=host, view=view, seam=seam, swarm=swarm, model_hash=model_hash,
                  dtype=dtype, settings=settings, progress=progress)
    stages, reports, step = await _Stages(ctx, num_stages, say).run()
    trainer, report = await parts.take(ctx, step)
    return Collected(stages=stages, trainer=trainer, reports=(*reports, report), step=step)


class _Stages:
    def __init__(self, ctx: Context, num_stages: int, say: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.n = num_stages
        self.say = say
        #: stage -> peer -> why its weights are not taken (left out from then on)
        self.faults: dict[int, dict[str, str]] = {s: {} for s in range(num_stages)}
        self.transfer_failures: dict[str, int] = {}
        self.last_failure: dict[int, str] = {}

    async def run(self) -> tuple[dict[int, NamedPart], list[PartReport], int | None]:
        s = self.ctx.settings
        loop = asyncio.get_running_loop()
        start = loop.time()
        said: str | None = None
        while True:
            elapsed = loop.time() - start
            past = elapsed >= s.deadline_s
            heard = await self._hear()
            self._check_shut_out(heard)
            decision = decide(heard, self.n, min_step=s.min_step if elapsed < s.prefer_s
                              else None, mixed=s.mixed and past)
            if isinstance(decision, Cut):
                taken = await self._take(decision)
                if taken is not None:
                    return (*taken, decision.step)
                decision = Wait()  # a stage stepped on during its download: again
            if past:
                raise self._failure(decision)
            if isinstance(decision, Wait) and decision.explain() != said and (
                    decision.unserved or decision.lagging):
                said = decision.explain()
                self.say(f"waiting: {said}")
            await asyncio.sleep(s.poll_s)

    def _failure(self, wait: Wait) -> Exception:
        where = "; ".join(f"stage {k}: {why}" for k, why in sorted(self.last_failure.items()))
        extra = f" (last failures: {where})" if where else ""
        s = self.ctx.settings
        if wait.unserved:
            return StageUnavailable(f"cannot export after {s.deadline_s:.0f} s: "
                                    f"{wait.explain()}{extra}")
        if wait.lagging:
            return InconsistentCut(f"cannot export after {s.deadline_s:.0f} s: "
                                   f"{wait.explain()}{extra}")
        return InconsistentCut(f"cannot export after {s.deadline_s:.0f} s: the stages kept "
                               f"stepping during their downloads{extra}; export again once "
                               f"training paused, or accept parts from different steps "
                               f"(--any-step)")

    def _check_shut_out(self, heard: Mapping[int, Sequence[Heard]]) -> None:
        """A stage whose every answering peer failed a check: nothing to wait for."""
        for stage, faults in self.faults.items():
            if faults and not heard.get(stage) and self._answering.get(stage):
                reasons = "; ".join(f"peer {p}: {why}" for p, why in sorted(faults.items()))
                raise PartUnverified(f"stage {stage}: no peer gave weights that pass the "
                                     f"checks ({reasons}); those peers are at fault: ask "
                                     f"their operators, or export once an honest peer "
                                     f"serves the stage")

    async def _hear(self) -> dict[int, list[Heard]]:
        """Each stage's peers' (step, round digest), the peers left out excepted."""
        self._answering: dict[int, int] = {}

        async def stage(k: int) -> list[Heard]:
            peers = self.ctx.view.state_sources(k)[:MAX_ASKED]
            replies = await asyncio.gather(*(self._ask(k, p, a) for p, a in peers))
            found = [Heard(peer=r.peer, step=r.step, digest=r.digest)
                     for r in replies if r is not None]
            self._answering[k] = len(found)
            return [h for h in found if h.peer not in self.faults[k]]

        lists = await asyncio.gather(*(stage(k) for k in range(self.n)))
        return dict(enumerate(lists))

    async def _ask(self, stage: int, peer: str, addrs: Sequence[str]) -> Any:
        return await ask_digest(self.ctx.host, self.ctx.protocol, peer, addrs, stage=stage,
                                model_hash=self.ctx.model_hash, timeout_s=DIGEST_TIMEOUT_S,
                                counters={})

    async def _take(self, cut: Cut) -> tuple[dict[int, NamedPart], list[PartReport]] | None:
        """Every stage at the cut; None when one moved on (or lost its sources) meanwhile."""
        parts: dict[int, NamedPart] = {}
        reports: list[PartReport] = []
        for stage in range(self.n):
            got = await self._take_stage(stage, cut)
            if got is None:
                return None
            parts[stage], report = got
            reports.append(report)
        return parts, reports

    async def _take_stage(self, stage: int, cut: Cut) -> tuple[NamedPart, PartReport] | None:
        step, expected = cut.steps[stage], cut.expected[stage]
        sources = [h for h in cut.sources[stage] if h.digest == expected] or \
            list(cut.sources[stage])
        addrs = dict(self.ctx.view.state_sources(stage))
        for heard in sources:
            peer = heard.peer
            if peer in self.faults[stage]:
                continue
            state, nbytes = await self._download(stage, peer, addrs.get(peer, ()), step)
            if state is None:
                continue
            if state.step != step:
                if cut.step is not None:
                    log.info("stage %d stepped on to %d during its download (cut at %d)",
                             stage, state.step, step)
                    return None
            try:
                named = await asyncio.to_thread(stage_part, self.ctx.seam, stage, self.n,
                                                state.params, dtype=self.ctx.dtype)
            except PartMismatch as exc:
                self._fault(stage, peer, str(exc))
                continue
            at = state.step
            del state  # its optimizer state is not exported: free it now
            verified = named.digest == expected and at == step
            if named.digest != expected and at == step:
                self._fault(stage, peer, f"sent weights of step {step} whose round digest "
                                         f"{named.digest} is not {expected}, the one "
                                         f"{'it' if heard.digest == expected else 'its mates'}"
                                         f" reported for that step")
                continue
            return named, PartReport(part=f"stage {stage}", step=at, source=peer,
                                     verified=verified, bytes=nbytes)
        return None

    async def _download(self, stage: int, peer: str, addrs: Sequence[str],
                        step: int) -> tuple[StageState | None, int]:
        s, ctx = self.ctx.settings, self.ctx
        part = f"stage {stage}"
        total = [0]

        def progress(done: int, whole: int) -> None:
            total[0] = whole
            if ctx.progress is not None:
                ctx.progress(part, done, whole)

        try:
            state = await fetch_state(
                ctx.host, ctx.protocol, [(peer, tuple(addrs))], stage=stage,
                model_hash=ctx.model_hash, timeout_s=s.transfer_timeout_s,
                max_bytes=s.max_bytes, on_progress=progress, newer_than=step - 1)
        except StateTransferFailed as exc:
            failures = self.transfer_failures[peer] = self.transfer_failures.get(peer, 0) + 1
            self.last_failure[stage] = str(exc)
            if failures >= MAX_TRANSFER_FAILURES:
                self._fault(stage, peer, f"its transfers failed {failures} times ({exc})")
            return None, 0
        return state, total[0]

    def _fault(self, stage: int, peer: str, why: str) -> None:
        log.warning("export: stage %d: leaving peer %s out: %s", stage, peer, why)
        self.faults[stage][peer] = why
        self.last_failure[stage] = f"peer {peer}: {why}"
