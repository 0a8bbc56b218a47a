"""The trainer's side of exact steps (``swarmd.pipeline.exact``): the stages' step reports,
the coefficient they are answered with, and what the trainer does when they cannot all come.

After a step's microbatches are back, :meth:`StepReports._reported` waits (bounded) for every
stage's report of the step and answers them all with one coefficient; a stage reports through
:meth:`StepReports._on_step_report`. A step whose reports cannot all come (a stage peer that
served it left, another trainer appeared, the wait ran out) is answered ``None``: every part
clips its own gradient, the next forwards name no stage step, and the stages are flushed
(:meth:`StepReports._flush_stages`). A stage step the reports named that no peer of the stage
can reach any more is given up (:meth:`StepReports._forget_gone_step`). docs/pipeline.md,
"Exact steps", says what each wait is for.

A part of :class:`swarmd.trainer.trainer.Trainer` (whose state it uses: its board, counters,
clock, view and host); kept apart so that the trainer's module holds the microbatches.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from swarmd.errors import NotOnPath, SwarmdError
from swarmd.pipeline.exact import Posted, StepBoard, stages_behind
from swarmd.pipeline.messages import (Flush, StepAnswer, parse_flushed, parse_step_report)
from transport.frames import Message

log = logging.getLogger("swarmd.trainer.step_reports")

#: how long a step waits for every stage's report (``swarmd.pipeline.exact``): at most
#: ``REPORTS_MAX_S``; after a step whose reports did not all come (a stage that does not
#: report must not stall every step), ``REPORTS_AFTER_MISS_S`` or ``REPORTS_LAG_FACTOR`` times
#: the lag reports had (the slowest of the last ones, decaying; a report that came after the
#: trainer stopped waiting counts too), whichever is longer: on a loaded machine reports
#: come seconds after the trainer's own part, and a fixed second would leave every step
#: after one miss clipped part by part. A report comes after the stage's own round, so it
#: follows the stage's averaging, not only the link
REPORTS_MAX_S = 60.0
#: how long the stages' answers to a flush are waited for (``_flush_stages``, their rounds
#: included): ``REPORTS_LAG_FACTOR`` times the reports' lag, within these bounds
FLUSH_MIN_S = 2.0
FLUSH_TIMEOUT_S = 30.0
REPORTS_AFTER_MISS_S = 1.0
REPORTS_LAG_FACTOR = 3.0
#: while a step's reports are waited for, how often to look whether they can still all come:
#: another trainer appeared (its samples mix into the stages' steps, and a stage that did
#: report waits for the answer with its step held, absorbing every sample that comes
#: meanwhile into that one step), or a peer that served the step's microbatches left the
#: stage it served them at (moved, left or dropped from the view: that stage's report will
#: not come, a leader's is refused, and its mates never reach the step's samples without it)
REPORTS_POLL_S = 0.5
#: a peer that served the step must have been missing from its stage this long, over
#: consecutive polls, before its stage's report is given up: a view on a loaded machine can
#: lose a live peer for a moment (an announcement late), and ending the wait then would take
#: the step part by part for nothing
LEFT_GRACE_S = 2.0
#: after this long waiting for a step's reports, the trainer says (once a step, at info)
#: which stages it waits for and which of their peers served the step
REPORTS_SAY_S = 10.0
#: how long microbatches may keep failing while every peer of a stage announces a step
#: below the one the forwards name, before the trainer takes that step for gone
#: (``_forget_gone_step``): announcements of a step just taken come up to a period late
STEP_GONE_S = 15.0


class StepReports:
    """The exact steps' reports, answers and flushes of a :class:`Trainer`."""

    # (the trainer's, set in its ``__init__``)
    board: StepBoard
    counters: Any
    stats: Any
    host: Any
    proto: dict[str, str]
    codec: Any
    num_stages: int
    exact: bool
    step: int
    progress: Any
    peers_of: Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]]
    steps_of: Callable[[int], Mapping[str, int]]
    other_trainers: Callable[[], Iterable[str]]
    _clock: Callable[[], float]
    _answers: dict[int, asyncio.Future[float | None]]
    _report_came: asyncio.Event
    _reports_missed: bool
    _report_lag_s: float
    _missed_at: dict[int, float]
    _step_peers: dict[int, set[str]]
    _missing_since: dict[str, float]
    _behind_since: float | None

    def _trainers_changed(self) -> bool:
        raise NotImplementedError  # the trainer's

    async def _reported(self, step: int, samples: int, sqnorm: float) -> float | None:
        """Wait (bounded) for every stage's report of ``step``; the coefficient every part
        scales its gradient by, answered to the stages too; None when a report did not come
        in time (each part clips its own; ``reports_missed``)."""
        self.board.open(step, samples)
        self.board.own(step, sqnorm if math.isfinite(sqnorm) else 0.0)
        wait_s = REPORTS_MAX_S
        if self._reports_missed:
            wait_s = min(REPORTS_MAX_S, max(REPORTS_AFTER_MISS_S,
                                            REPORTS_LAG_FACTOR * self._report_lag_s))
        t0 = self._clock()
        others = said = False
        try:
            async with asyncio.timeout(wait_s):
                while not self.board.complete(step) and not self.board.answered(step):
                    if self._trainers_changed():  # not exact any more: answer at once
                        others = True
                        break
                    if self._left_its_stage(step):
                        break
                    if not said and self._clock() - t0 >= REPORTS_SAY_S:
                        said = True
                        self._say_waiting(step, self._clock() - t0, wait_s)
                    try:
                        async with asyncio.timeout(REPORTS_POLL_S):
                            await self._report_came.wait()
                    except TimeoutError:
                        continue
                    self._report_came.clear()
        except TimeoutError:
            pass
        if others:
            self.counters["reports_others_appeared"] += 1
            self._not_exact(step)
            return None
        if self.board.complete(step):
            self._report_lag_s = max(self._clock() - t0, 0.9 * self._report_lag_s)
        else:  # a report that comes later still tells the lag (``_on_step_report``)
            self._missed_at[step] = t0
            while len(self._missed_at) > self.board.keep:
                del self._missed_at[min(self._missed_at)]
        coefficient = self.board.answer(step)
        if not self.board.answered(step) or coefficient is None:
            self.board.expire(step)
            self.counters["reports_missed"] += 1
            if not self._reports_missed:
                log.warning("not every stage reported step %d (waited %.1f s of %.0f): each "
                            "part of the model clips its own gradient until they do", step,
                            self._clock() - t0, wait_s)
        else:
            self.counters["steps_exact"] += 1
            if coefficient is not None and coefficient < 1.0:
                self.counters["steps_clipped"] += 1
        self._reports_missed = not self.board.answered(step) or coefficient is None
        self.stats.clip_coefficient = coefficient
        self.stats.grad_norm = self.board.norm(step)
        answer = self._answers.pop(step, None)
        if answer is not None and not answer.done():
            answer.set_result(coefficient)
        return coefficient

    async def _flush_stages(self, before: int) -> None:
        """After a step that was not exact: every stage steps now on what it still holds of
        this trainer's steps before ``before`` (``messages.Flush``: the rest of a step
        whose other trainers' shares never came, or that a stage split), so that the next
        step starts on stages that hold nothing of the last; its forwards run on the stage
        steps the flushes reached. Without it such leftovers would make every later stage
        step take part of two swarm steps. Answers are waited for at most 3 times the
        reports' lag (``FLUSH_MIN_S`` to ``FLUSH_TIMEOUT_S``): a silent peer costs that."""
        async def one(stage: int, peer: str, addrs: tuple[str, ...]) -> tuple[int, int | None]:
            message = Message(**Flush(stage=stage, step=before).wire())
            try:
                await self.host.connect(peer, addrs)
                reply = await self.host.request(peer, self.proto["flush"], message,
                                                codec=self.codec, timeout=FLUSH_TIMEOUT_S)
                return stage, parse_flushed(reply)
            except Exception as exc:  # that stage's step is not known: no ``at`` for it
                self.counters["flush_failed"] += 1
                log.debug("flush of stage %d at %s failed: %s", stage, peer, exc)
                return stage, None

        # every peer of each stage: whichever leads its rounds now (a leader that died is
        # still listed a while, and its mates pass it over) calls the round
        asks = [asyncio.ensure_future(one(stage, peer, tuple(row[2])))
                for stage in range(self.num_stages)
                for peer, row in self.peers_of(stage).items()]
        if not asks:
            return
        self.counters["flushes"] += 1
        wait_s = min(FLUSH_TIMEOUT_S, max(FLUSH_MIN_S, REPORTS_LAG_FACTOR * self._report_lag_s))
        done, pending = await asyncio.wait(asks, timeout=wait_s)
        for task in pending:
            task.cancel()
        reached: dict[int, int] = {}
        for stage, stage_step in (t.result() for t in done):
            if stage_step is not None:
                reached[stage] = max(stage_step, reached.get(stage, 0))
        if len(reached) == self.num_stages:
            for stage, stage_step in reached.items():
                self.board.flushed(stage, stage_step)

    def _not_exact(self, step: int) -> None:
        """``step`` is not answered with a coefficient (another trainer's samples mix into the
        stages' steps): a stage that reported it, or reports it later, is answered None at
        once (it holds its step while it waits), and the next forwards name no stage step."""
        if self.exact:
            self.board.expire(step)
        self.board.reset()
        self.stats.clip_coefficient = None
        for waiting in [s for s in self._answers if s <= step]:
            answer = self._answers.pop(waiting)
            if not answer.done():
                answer.set_result(None)

    def _say_waiting(self, step: int, waited_s: float, wait_s: float) -> None:
        """Say which stages' reports of ``step`` are still awaited, and who served it there
        (counted ``reports_slow``)."""
        self.counters["reports_slow"] += 1
        missing = self.board.missing(step)
        log.info("step %d: waited %.0f s (of %.0f) for the step reports of stage(s) %s; "
                 "served there by %s", step, waited_s, wait_s, missing,
                 {s: sorted(self._step_peers.get(s, ())) for s in missing})

    def _left_its_stage(self, step: int) -> bool:
        """Whether a peer that served ``step``'s microbatches at a stage that has not reported
        it is no longer listed at that stage (see ``REPORTS_POLL_S``); counted and said."""
        now = self._clock()
        missing: dict[str, float] = {}
        for stage in self.board.missing(step):
            for peer in self._step_peers.get(stage, set()) - self.peers_of(stage).keys():
                missing[peer] = self._missing_since.get(peer, now)
        self._missing_since = missing  # a peer listed again starts over
        for stage in self.board.missing(step):
            gone = {p for p in self._step_peers.get(stage, set()) & missing.keys()
                    if now - missing[p] >= LEFT_GRACE_S}
            if gone:
                self.counters["reports_left"] += 1
                log.info("step %d: stage %d's report will not come (%s served it there and "
                         "left the stage): not waiting for it", step, stage, ", ".join(gone))
                return True
        return False

    async def _on_step_report(self, message: Message, peer: str) -> Message:
        """A stage peer's report of the step it is about to apply (``StepReport``), from a
        peer membership lists at that stage, for this trainer's current step or one of the
        last it remembers; answered once the step is decided (``_reported``)."""
        try:
            report = parse_step_report(message, num_stages=self.num_stages)
        except SwarmdError as exc:
            self.counters[f"refused.{getattr(exc, 'reason', exc.code)}"] += 1
            raise
        # a peer listed at the stage, or one that served this step's microbatches there (the
        # view may have lost it a moment: its report, refused, would never come again)
        if (peer not in self.peers_of(report.stage)
                and peer not in self._step_peers.get(report.stage, ())):
            self.counters["refused.report_sender"] += 1
            raise NotOnPath("sender", f"{peer} is not a peer of stage {report.stage} here")
        # (a change of the trainers in view is for ``_reported`` to judge: a view that loses
        # a trainer for a moment must not turn a whole step's report away, which the stage
        # never sends again: the step would wait ``REPORTS_MAX_S`` for it)
        if not self.exact or not (self.step - self.board.keep < report.step <= self.step):
            self.counters["reports_not_exact"] += 1
            return Message(**StepAnswer(coefficient=None, progress=self.progress).wire())
        posted = (self.board.fail(report.step) if report.failed else self.board.post(
            report.step, report.stage, report.sqnorm, report.stage_step, report.samples))
        self.counters[f"reports_{posted}"] += 1
        self._report_came.set()
        began = self._missed_at.get(report.step)
        if began is not None:  # a report the trainer stopped waiting for: how late it was
            self._report_lag_s = max(self._report_lag_s, self._clock() - began)
        if posted == Posted.NOT_OPEN or self.board.answered(report.step):
            return Message(**StepAnswer(coefficient=self.board.answer(report.step),
                                        progress=self.progress).wire())
        answer = self._answers.get(report.step)
        if answer is None:
            answer = self._answers[report.step] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(REPORTS_MAX_S + 5.0):
                coefficient = await asyncio.shield(answer)
        except TimeoutError:
            coefficient = None
        return Message(**StepAnswer(coefficient=coefficient, progress=self.progress).wire())

    def _forget_gone_step(self) -> None:
        """After a microbatch failed: when every peer of a stage has announced a step below
        the one the forwards name (``stages_behind``) for ``STEP_GONE_S``, that stage step
        left with the peer that took it, and no peer can ever run them: forwards name no
        stage step until the stages report again (``steps_gone``)."""
        expected = self.board.expected() if self.exact else None
        behind = [] if expected is None else stages_behind(
            expected, [self.steps_of(stage) for stage in range(self.num_stages)])
        now = self._clock()
        if not behind:
            self._behind_since = None
            return
        if self._behind_since is None:
            self._behind_since = now
        if now - self._behind_since < STEP_GONE_S:
            return
        assert expected is not None
        self._behind_since = None
        self.counters["steps_gone"] += 1
        self.board.reset()
        for stage in behind:
            log.warning("stage %d: its forwards name stage step %d, but its peers announce "
                        "at most %d (the peer that took that step left the stage): forwards "
                        "name no stage step until the stages report again", stage,
                        expected[stage], max(self.steps_of(stage).values()))
