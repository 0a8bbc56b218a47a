"""The stage's optimizer steps: progress reports, the leader's call, the all-reduce, the step.

The decisions are :class:`swarmd.averaging.trigger.RoundTrigger`'s; this module moves its messages
over ``/swarmd/<swarm>/1/round`` (request/reply, small meta only) and runs the round:

- ``progress`` {stage, step, samples}: a peer that is not the leader reports after each
  backward (coalesced: one report in flight at a time).
- ``prepare`` {stage, step}: the leader, once the target is reached, asks every mate for its
  step and whether it is free; the mates at the leader's step that are free form the group.
  A mate at another step is out of this round; whoever is behind catches up (``on_behind``);
  once stepped, the leader tells a mate it left out as behind its new step (``nudged_behind``),
  so that the mate replays up to it before the next round, not one step short of it.
- ``start`` {stage, step, round, group}: the leader tells the group; every member (the leader
  too) takes its gradient snapshot and enters ``Averager.all_reduce`` with the same round id and
  group, then applies the same averaged gradient and moves to the next step.

Authority: each request is parsed into a typed message (``swarmd.averaging.messages``) and
taken only from a mate of the stage (a live one, or one listed live within the grace of
``swarmd.averaging.authority.RecentMates``: a lagging view must not refuse the stage's own
leader); a ``start`` only from the stage's leader (the trigger's rule) and with a group of the
stage's peers; reported samples and the weights in the
all-reduce are bounded by ``max_samples_factor`` times the stage's target. Anything else gets a
typed ``bad_round_message`` reply, a counter (``bad_requests.<reason>``), and changes nothing.

Same step, other weights: the leader's ``start`` carries the digest of its weights before the
step (``digest()``); a member at that step whose own digest differs (and whose id is higher,
``same_step_verdict``) counts ``diverged``, runs the round, then calls ``on_diverged(leader,
step)``: its keeper downloads the leader's state even at an equal step.

A mate that does not answer a ``prepare`` (or a leader that does not answer ``progress``) within
the patience its own measured answers earned (``swarmd.averaging.patience``: a frozen mate costs
the stage a fifth of a second, not ``ASK_TIMEOUT_S``) is suspected and left out, counted
``answer_late.<kind>``. A leader whose answer to ``progress`` says it is two or more steps
behind (catching up) is passed over at this step (``RoundTrigger.passed_over``).

Strangers: a mate whose id sorts before this peer's leader but that never answered a round
message of ours leads nobody until it does (``RoundTrigger.heard``). It is probed beside the
stage's work, never on its critical path: sent our progress report (one probe in flight per
mate, ``probes`` / ``probes_answered``); a leader asks a stranger that reported nothing at its
step to ``prepare`` with the others and waits for it no longer than for them: one answering
with them is in the round, a silent one costs nothing (``left_out.unheard``). A start is
taken only from a mate heard from, and its group counts as heard (they answered that leader).
A leader that refused every report for ``REFUSING_S`` is suspected (``mates_refusing``).

A peer alone in its stage steps locally when its own samples reach the target. A round that
fails (``AllReduceFailed`` at its deadline) puts the snapshot back into the accumulated
gradients and does not step: the peers that did step are ahead, and this one catches up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import torch

from swarmd.api.histogram import Histograms
from swarmd.averaging.allreduce import AllReduceFailed, Averager
from swarmd.averaging.authority import ADOPT, MATE_GRACE_S, RecentMates, same_step_verdict
from swarmd.averaging.messages import (Exact, Prepare, PrepareReply, Progress, ProgressReply,
                                       Source, Start, parse_prepare_reply,
                                       parse_progress_reply, parse_round)
from swarmd.averaging.patience import AnswerPatience
from swarmd.errors import BadPeerMessage, BadRoundMessage, SwarmdError
from swarmd.averaging.trigger import RoundTrigger, exact_step
from transport.errors import DeadlineExceeded, RemoteError, TransportError
from transport.frames import Message
from swarmd.protocols import Protocols

log = logging.getLogger("swarmd.sync")

#: how long the leader waits for a mate's answer to ``prepare`` / ``start``
ASK_TIMEOUT_S = 3.0
#: the buckets of ``round_ask_seconds`` (up to the timeout)
ASK_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, ASK_TIMEOUT_S)
#: the messages a mate answers without work, waited for only as long as its answers take
#: (``swarmd.averaging.patience``); a ``start`` may wait on pings first (``ALIVE_TIMEOUT_S``)
PATIENT_KINDS = frozenset({"prepare", "progress"})
#: when our own event loop woke this late from a mate's patience, its answer is looked for
#: ``LATE_GRACE_S`` longer: the loop, not the mate, was late (timers fire before the replies
#: that came meanwhile are read)
LOOP_LATE_S = 0.05
LATE_GRACE_S = 0.1
#: a start from a mate that leads only if smaller mates are gone: at most this many of them
#: are checked (a ping each, concurrently, within ``ALIVE_TIMEOUT_S``) before answering
MAX_ALIVE_CHECKS = 4
ALIVE_TIMEOUT_S = 1.0
#: how often a peer looks whether its stage's leader changed (``StageSync.leader_check``)
LEADER_CHECK_S = 1.0


class RoundRefused(SwarmdError):
    code = "round_refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncSettings:
    compression: str = "fp16"
    aggregator: str = "centered_clip"
    #: the longest a round may take: its deadline follows the links (Averager.round_deadline)
    timeout_s: float = 600.0
    #: a peer's samples (reported, or weighed in a round) are at most this times the target
    max_samples_factor: float = 4.0
    #: a peer last listed as a live mate is still taken as one for rounds this long (s)
    mate_grace_s: float = MATE_GRACE_S


class StageSync:
    """Owned by the stage server. ``mates()`` returns {peer_id: addrs} of the stage's other
    live peers; ``snapshot()`` takes (mean gradient, samples) and clears the accumulation;
    ``apply(vector, exact)`` sets the gradient and steps (``exact``: the trainer steps the
    step's samples are exactly made of, one per trainer, empty when not exact:
    ``trigger.exact_step``; ``sources()`` lists those of this peer's samples, which its
    progress reports carry to the leader; ``failed(exact)`` is told that a round of those
    trainer steps failed, so the stage takes no step for them now); ``give_back(vector,
    samples)`` undoes a snapshot; ``on_behind(peer, step)`` is told of a mate at a later
    step; ``samples_now()`` is what this peer accumulated since its last snapshot. ``digest()`` (optional) is the hex
    digest of the stage's weights now; ``on_diverged(leader, step)`` is told that the leader of
    a round at ``step`` held other weights than ours (take its state); ``round_over()`` is
    called once a round that took a snapshot ended, stepped or not."""

    def __init__(self, host: Any, *, swarm: str, stage: int, trigger: RoundTrigger,
                 averager: Averager | None, mates: Callable[[], dict[str, tuple[str, ...]]],
                 snapshot: Callable[[], Awaitable[tuple[torch.Tensor, int]]],
                 apply: Callable[[torch.Tensor, Exact], Awaitable[None]],
                 give_back: Callable[[torch.Tensor, int], Awaitable[None]],
                 on_behind: Callable[[str, int], None], samples_now: Callable[[], int],
                 on_stepped: Callable[[], None] = lambda: None,
                 step_alone: Callable[[], Awaitable[Iterable[Source]]] | None = None,
                 settings: SyncSettings = SyncSettings(),
                 digest: Callable[[], Awaitable[str]] | None = None,
                 on_diverged: Callable[[str, int], None] = lambda peer, step: None,
                 round_over: Callable[[], None] = lambda: None,
                 sources: Callable[[], list[Source]] = lambda: [],
                 failed: Callable[[Exact], Awaitable[None]] | None = None,
                 histograms: Histograms | None = None,
                 moved: Callable[[], Iterable[str]] = lambda: (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: every time here is read from this clock (seconds, monotonic)
        self._clock = clock
        #: how long mates take to answer round messages (``round_ask_seconds.<kind>``): what a
        #: wait shorter than ``ASK_TIMEOUT_S`` is chosen from
        self.histograms = histograms if histograms is not None else Histograms()
        #: how long each mate's ``prepare`` / ``progress`` answer is waited for
        self.patience = AnswerPatience(ceiling_s=ASK_TIMEOUT_S)
        self.host = host
        self.stage = stage
        self.trigger = trigger
        self.averager = averager
        self.mates = mates
        #: the peers the view lists at another stage now: a mate that moved there is no
        #: mate, grace or not (kept one, a leader that moved away went on leading here)
        self.moved = moved
        self._snapshot, self._apply, self._give_back = snapshot, apply, give_back
        self._on_behind = on_behind
        self._samples_now = samples_now
        self._on_stepped = on_stepped
        self._step_alone = step_alone or self._snapshot_and_apply
        self.settings = settings
        self._digest = digest
        self._on_diverged = on_diverged
        self._round_over = round_over
        self._sources = sources
        self._failed = failed
        #: the trainer steps each mate said its samples came from, at the step it reported
        self._mate_sources: dict[str, tuple[int, tuple[Source, ...]]] = {}
        self._recent = RecentMates(settings.mate_grace_s)
        self.protocol = Protocols(swarm).round
        self.counters: Counter[str] = Counter()
        self._round: asyncio.Task[None] | None = None
        #: bytes per second this peer moved in its last rounds (EMA); sizes its part
        self.bandwidth: float | None = None
        self._reporting: asyncio.Task[None] | None = None
        #: ``held()`` contexts open: no round starts or is joined while any is
        self._holds = 0
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        #: requests given up on at a mate's patience, running on to ``ASK_TIMEOUT_S``
        self._late: set[asyncio.Task[Message]] = set()
        #: the leader as of the last ``_consider`` (this peer's id: it led; None: alone)
        self._leader: str | None = None
        #: strangers' probes in flight, one per mate
        self._probes: dict[str, asyncio.Task[None]] = {}

    @property
    def step(self) -> int:
        return self.trigger.step

    @property
    def max_samples(self) -> int:
        """The most samples one peer may hold at one step (honest peers stay far below)."""
        return max(1, int(self.trigger.target * self.settings.max_samples_factor))

    @property
    def busy(self) -> bool:
        """In a round, or held: no new round now."""
        return self._holds > 0 or self._rounding

    @property
    def _rounding(self) -> bool:
        return self._round is not None and not self._round.done()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """No round runs inside: waits out the one in progress and keeps new ones (led or
        joined) out until the context exits. A state taken over (a catch-up) must not meet a
        round's step half way."""
        self._holds += 1
        try:
            while self._rounding:
                assert self._round is not None
                await asyncio.wait({self._round})
            yield
        finally:
            self._holds -= 1
            if not self._holds:
                self._consider()

    def start(self) -> None:
        self.host.set_request_handler(self.protocol, self._serve)
        self._spawn(self._check_leader())

    async def _check_leader(self) -> None:
        while not self._closed:
            await asyncio.sleep(LEADER_CHECK_S)
            self.leader_check()

    def leader_check(self) -> bool:
        """Consider the stage again when its leader changed since the last time (the leader
        left, moved to another stage, or is suspected): a mate's samples reported to a leader
        that is gone reach the new one, and a peer that now leads or is alone calls the round
        or steps. Else a stage whose leader moved away once all of a step's samples were in
        waited for a backward that the trainer holds back until the step's report, which
        only that round makes (the swarm stood still for the trainer's 60 s). Returns whether
        it considered."""
        if self.busy or self._closed:
            return False
        now = self._clock()
        mates = self._recent.alive(self._listed(), now)
        self._probe(mates, now)
        if (self.trigger.leader(mates, now) if mates else None) == self._leader:
            return False
        self.counters["leader_changed"] += 1
        self._consider()
        return True

    async def close(self) -> None:
        self._closed = True
        self.host.remove_handler(self.protocol)
        tasks = [t for t in (self._round, self._reporting, *self._tasks, *self._late,
                             *self._probes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    # ---- events from the stage server --------------------------------------------------------
    def progressed(self, samples: int) -> None:
        """This peer now holds ``samples`` at the current step (after a backward)."""
        self.trigger.samples = samples
        self._consider()

    def _consider(self) -> None:
        if self.busy or self._closed:
            return
        now = self._clock()
        live = self._listed()
        # the live mates and those a lagging view dropped but that spoke to us just now
        mates = self._recent.alive(live, now)
        # what is held of mates within the grace is kept: their suspicions still count
        known = self._recent.known(live, now)
        self.trigger.forget(known)
        self.patience.forget(known)
        self._mate_sources = {p: v for p, v in self._mate_sources.items() if p in known}
        self._probes = {p: t for p, t in self._probes.items() if p in known or not t.done()}
        if not mates:
            self._leader = None
            if self.trigger.samples >= self.trigger.target:
                self._round = self._spawn(self._local_step())
            return
        self._probe(mates, now)
        leader = self._leader = self.trigger.leader(mates, now)
        if leader == self.trigger.me:
            if self.trigger.ready(mates, now):
                self._round = self._spawn(self._lead(mates))
        elif self._reporting is None or self._reporting.done():
            self._reporting = self._spawn(self._report(leader, mates[leader]))

    def _probe(self, mates: dict[str, tuple[str, ...]], now: float) -> None:
        """Send our progress to each stranger that would lead us once heard from."""
        for peer in self.trigger.strangers(mates, now):
            self._probe_with(peer, lambda: self._probe_one(peer, mates[peer]))

    def _probe_with(self, peer: str, probe: Callable[[], Awaitable[None]]) -> None:
        """Run ``probe()`` unless a probe of ``peer`` is in flight (one at a time a mate)."""
        probing = self._probes.get(peer)
        if probing is None or probing.done():
            self._probes[peer] = self._spawn(probe())

    async def _probe_one(self, peer: str, addrs: tuple[str, ...]) -> None:
        self.counters["probes"] += 1
        report = Progress(stage=self.stage, step=self.trigger.step,
                          samples=min(self.trigger.samples, self.max_samples),
                          sources=tuple(self._sources()))
        reply = await self._ask(peer, addrs, "progress", report.to_meta())
        if reply is None:
            return
        self.counters["probes_answered"] += 1
        self._answered_at(peer, self._progress_reply(peer, reply).step)
        self._consider()  # it may lead us now

    def _answered_at(self, peer: str, step: int | None) -> bool:
        """``peer`` answered our progress at ``step`` (None: not said). Past ours: we catch
        up (``on_behind``): a leader that stepped while we were a stranger to it (its round
        went on without us) asks us nothing at its new step, its answer is how we learn; not
        while a round of ours runs, whose end may be what the answer saw first. True when it
        is far enough behind ours to be passed over at this step (``passed_over``)."""
        if step is None:
            return False
        if step > self.trigger.step and not self.busy:
            self.counters["behind_leader"] += 1
            self._on_behind(peer, step)
        return self.trigger.passed_over(peer, step)

    async def flush(self, trainer: str, before: int) -> int:
        """Step now, short of the target, when the stage holds samples of ``trainer``'s steps
        before ``before`` (as far as this peer knows: its own and what its mates reported):
        the rest of those steps' samples will not come (``swarmd.pipeline.exact``, a flush).
        Only the leader, or a peer alone, calls the round; any peer answers the stage's step
        after it (a round in progress is waited for first)."""
        self.counters["flush_requests"] += 1
        while self._rounding:
            assert self._round is not None
            await asyncio.wait({self._round})
        if self.busy or self._closed or not self._holds_older(trainer, before):
            return self.step
        now = self._clock()
        mates = self._recent.alive(self._listed(), now)
        if not mates:
            if self.trigger.samples > 0:
                self._round = self._spawn(self._local_step())
        elif self.trigger.leader(mates, now) == self.trigger.me:
            self._round = self._spawn(self._lead(mates))
        if self._round is not None and not self._round.done():
            self.counters["flushed"] += 1
            await asyncio.wait({self._round})
        return self.step

    def _holds_older(self, trainer: str, before: int) -> bool:
        pairs = list(self._sources())
        for step, sources in self._mate_sources.values():
            if step == self.trigger.step:
                pairs += sources
        return any((t == trainer and s < before) or (t, s) == ("", -1) for t, s in pairs)

    # ---- rounds ---------------------------------------------------------------------------
    async def _local_step(self) -> None:
        not_exact = tuple(await self._step_alone())
        if not_exact:
            self._tell_not_exact(not_exact)
        self.counters["local_steps"] += 1
        self._stepped()

    async def _snapshot_and_apply(self) -> tuple[Source, ...]:
        """Step alone on what is held; the sources of a step that was not exact (else ())."""
        pairs = self._sources()
        vector, samples = await self._snapshot()
        exact = exact_step(pairs, samples, self.trigger.target) or ()
        await self._apply(vector, exact)
        return () if exact else tuple(pairs)

    def _tell_not_exact(self, pairs: Iterable[tuple[str, int]]) -> None:
        """A step that is not exact is never reported, so the trainers of its samples' steps
        are told now that this stage takes no exact step for them (``failed``, as after a
        failed round; counted ``not_exact_told``): a round that left out a mate holding some
        of the samples (busy, silent, a stranger), and a step alone or a round on samples of
        two steps (a flush that took the first backwards of a trainer's next step with it:
        that step can never be exact here). Else each waited for this stage's report until
        its patience ran out (60 s): the whole swarm stood still. (A member whose
        contribution goes missing during the all-reduce leaves the step as planned:
        docs/pipeline.md, "Exact steps".)"""
        named = tuple(sorted({(t, s) for t, s in pairs if t and s >= 0}))
        if named and self._failed is not None:
            self.counters["not_exact_told"] += 1
            self._spawn(self._failed(named))

    async def _lead(self, mates: dict[str, tuple[str, ...]]) -> None:
        step = self.trigger.step
        now = self._clock()  # a mate that just failed us is not waited for again
        live = len(mates)
        mates = {p: a for p, a in mates.items() if self.trigger.suspects.get(p, 0.0) <= now}
        left_out = Counter(suspected=live - len(mates))
        ask = Prepare(stage=self.stage, step=step)
        # a stranger that reported nothing at this step (never measured: its patience would
        # be the ceiling) is asked with the others and waited for no longer than they are: a
        # new mate answering with them is in the round, a silent one costs nothing (its ask
        # runs on beside, a probe)
        addrs_of = dict(mates)
        strangers = {p: asyncio.ensure_future(self._ask(p, mates.pop(p), "prepare",
                                                        ask.to_meta()))
                     for p in [p for p in mates if p not in self.trigger.heard
                               and self.trigger.reports.get(p, (-1, 0))[0] != step]}
        self._probes.update(strangers)  # owned: cancelled on close
        digest, *answers = await asyncio.gather(
            self._our_digest(), *(self._ask(p, addrs, "prepare", ask.to_meta())
                                  for p, addrs in mates.items()))
        for peer, asking in strangers.items():
            if asking.done():
                mates[peer] = addrs_of[peer]
                answers.append(asking.result())
            else:
                left_out["unheard"] += 1
        group, bandwidths = [self.trigger.me], [self.bandwidth]
        behind: list[str] = []
        for peer, reply in zip(mates, answers):
            their = self._prepared(peer, reply)
            if their is None:
                left_out["silent"] += 1
                continue
            was_behind = self.trigger.behind.get(peer) == step
            if not self.trigger.passed_over(peer, their.step) and was_behind and \
                    their.step <= step and peer < self.trigger.me:
                # a leader we passed over as behind caught up (to within the step it
                # replays): it leads this step, not us
                self.counters["leader_caught_up"] += 1
                asyncio.get_running_loop().call_soon(self._consider)
                return
            if their.step == step and their.free:
                group.append(peer)
                bandwidths.append(their.bandwidth)
            elif their.step > step:
                self._on_behind(peer, their.step)
                return  # we are behind: no round until we caught up
            elif their.step == step:
                left_out["busy"] += 1
            else:
                left_out["behind"] += 1
                behind.append(peer)
        self._count_group(len(group), left_out)
        round_id = f"{self.stage}:{step}:{secrets.token_hex(4)}"
        pairs, samples = self._round_sources(group, step), self.trigger.total(group[1:])
        exact = exact_step(pairs, samples, self.trigger.target) or ()
        if not exact:
            self._tell_not_exact(pairs)
        if len(group) > 1:
            # everyone told must run the very group it was told: a member that refuses now is
            # missing from the round, whose parts are repaired around it (swarmd.averaging.allreduce)
            start = Start(stage=self.stage, step=step, round_id=round_id, group=tuple(group),
                          bandwidths=tuple(bandwidths), digest=digest, sources=exact)
            started = await asyncio.gather(*(self._ask(p, mates[p], "start", start.to_meta())
                                             for p in group[1:]))
            self.counters["start_refused"] += sum(r is None for r in started)
        self.counters["rounds_led"] += 1
        await self._average(round_id, group, bandwidths, exact=exact)
        if behind and self.trigger.step > step:
            self.counters["nudged_behind"] += len(behind)
            self._spawn(self._nudge({p: mates[p] for p in behind}))

    async def _nudge(self, behind: dict[str, tuple[str, ...]]) -> None:
        """Tell the mates this round left out as behind the step it took us to (a
        ``prepare`` at it: a mate that sees a later step catches up, ``on_behind``). Told at
        the next round's prepare instead, a mate replaying to catch up reached the step we
        were stepping from just as we stepped on, and was left out of every round (a
        livelock: it never served again)."""
        ask = Prepare(stage=self.stage, step=self.trigger.step)
        await asyncio.gather(*(self._ask(p, addrs, "prepare", ask.to_meta())
                               for p, addrs in behind.items()))

    def _count_group(self, size: int, left_out: Counter[str]) -> None:
        """A round this peer leads, of ``size`` members (itself included): ``group_members``
        over ``rounds_led`` is the mean group; ``mates_left_out`` the live mates that were
        not in it, and why (``left_out.<why>``: ``suspected`` after failing us, ``silent``
        to the prepare, ``busy`` in a round or a state transfer, ``behind`` at an earlier
        step, ``unheard``: a stranger that had not answered when the others had);
        ``rounds_short`` the rounds that left one out."""
        self.counters["group_members"] += size
        for why, n in left_out.items():
            if n:
                self.counters[f"left_out.{why}"] += n
        total = sum(left_out.values())
        self.counters["mates_left_out"] += total
        self.counters["rounds_short"] += total > 0

    def _round_sources(self, group: list[str], step: int) -> list[tuple[str, int]]:
        """The trainer steps the round's samples come from: ours and those the members
        reported at this step. The round is exact (``exact_step``) when they are one step per
        trainer and the target's samples in all."""
        pairs = list(self._sources())
        for peer in group[1:]:
            reported = self._mate_sources.get(peer)
            if reported is not None and reported[0] == step:
                pairs += reported[1]
        return pairs

    async def _our_digest(self) -> str | None:
        """The digest of our weights now, None when unknown (none given, or it failed)."""
        if self._digest is None:
            return None
        try:
            return await self._digest()
        except Exception as exc:  # a digest only detects drift: the round goes on without
            log.warning("stage %d: could not digest the weights: %r", self.stage, exc)
            self.counters["digest_failed"] += 1
            return None

    async def _joined(self, start: Start, leader: str) -> None:
        """A member's round. Our weights are digested beside the round (in the compute
        thread, before the step is applied) and compared with the leader's; a drifted member
        still averages with the stage, then takes the leader's state."""
        step = self.trigger.step
        digesting = asyncio.ensure_future(self._our_digest()) if start.digest else None
        try:
            await self._average(start.round_id, list(start.group), list(start.bandwidths),
                                before_apply=digesting, exact=start.sources)
        finally:
            if digesting is not None and not digesting.done():  # the round failed early
                digesting.cancel()
        if digesting is None or not digesting.done() or digesting.cancelled():
            return
        ours = digesting.result()
        if same_step_verdict(me=self.trigger.me, our_step=step, our_digest=ours, them=leader,
                             their_step=start.step, their_digest=start.digest) != ADOPT:
            return
        self.counters["diverged"] += 1
        log.warning("stage %d: our weights at step %d differ from those of the round's leader "
                    "%s (%s, ours %s): taking its state", self.stage, step, leader,
                    (start.digest or "")[:12], (ours or "")[:12])
        self._on_diverged(leader, step)

    async def _average(self, round_id: str, group: list[str],
                       bandwidths: list[float | None],
                       before_apply: Awaitable[Any] | None = None,
                       exact: Exact = ()) -> None:
        """One round: every member passes the same group and bandwidths (the leader's lists),
        so they derive the same parts, each sized by its peer's measured bandwidth.
        ``before_apply`` (a digest of the weights) is waited for before they change;
        ``exact``, the leader's, goes with the averaged gradient to ``apply``."""
        vector, samples = await self._snapshot()
        try:
            await self._reduce_and_apply(round_id, group, bandwidths, vector, samples,
                                         before_apply, exact)
        finally:
            self._round_over()

    async def _reduce_and_apply(self, round_id: str, group: list[str],
                                bandwidths: list[float | None], vector: torch.Tensor,
                                samples: int, before_apply: Awaitable[Any] | None,
                                exact: Exact = ()) -> None:
        pending = asyncio.ensure_future(before_apply) if before_apply is not None else None
        if len(group) == 1 or self.averager is None:
            if pending is not None:
                await asyncio.wait({pending})
            await self._apply(vector, exact)
            self.counters["local_steps"] += 1
            self._stepped()
            return
        s = self.settings
        # every member bounds the weights alike: a peer that (after failed rounds) holds
        # more samples than that claims the bound
        weight = float(min(samples, self.max_samples))
        try:
            result = await self.averager.all_reduce(
                round_id, group, vector, weight, codec=s.compression,
                aggregator=s.aggregator, cap_s=s.timeout_s, bandwidths=bandwidths,
                max_weight=float(self.max_samples))
        except AllReduceFailed as exc:
            log.warning("stage %d round %s failed (%s): not stepping; catching up later",
                        self.stage, round_id, exc)
            self.counters["rounds_failed"] += 1
            await self._give_back(vector, samples)
            self.trigger.samples = self._samples_now()
            if exact and self._failed is not None:
                await self._failed(exact)  # its trainers need not wait for this step
            return
        if pending is not None:  # the weights before the step, digested beside the round
            await asyncio.wait({pending})
        await self._apply(result.vector, exact)
        if result.seconds > 0:
            rate = (result.bytes_sent + result.bytes_received) / result.seconds
            self.bandwidth = rate if self.bandwidth is None else 0.7 * self.bandwidth + 0.3 * rate
        self.counters["rounds"] += 1
        self.counters["peers_missing"] += len(result.missing)
        self._stepped()

    def _stepped(self) -> None:
        log.debug("stage %d stepped to %d", self.stage, self.trigger.step + 1)
        self.trigger.stepped(self.trigger.step + 1, carried=self._samples_now())
        self._on_stepped()
        self._consider()  # samples that arrived during the round may already suffice

    def took_state(self, step: int, samples: int) -> None:
        """The stage's state was replaced by one at ``step`` (downloaded or loaded)."""
        self.trigger.stepped(step, carried=samples)

    def known_mates(self) -> dict[str, tuple[str, ...]]:
        """The peers taken as mates in rounds: the live mates now and those listed live within
        ``settings.mate_grace_s`` (``RecentMates``)."""
        return self._recent.known(self._listed(), self._clock())

    def _listed(self) -> dict[str, tuple[str, ...]]:
        """The live mates by the view now; a remembered mate the view lists at another stage
        is forgotten (``RecentMates``' grace is for a lagging view, not a peer that moved)."""
        live = self.mates()
        gone = [p for p in self._recent.remembered() if p not in live]
        if gone:
            elsewhere = set(self.moved())
            for peer in gone:
                if peer in elsewhere:
                    self._recent.forget(peer)
                    self.counters["mates_moved_away"] += 1
        return live

    # ---- messages ----------------------------------------------------------------------------
    async def _report(self, leader: str, addrs: tuple[str, ...]) -> None:
        sent = None
        while sent != (self.trigger.step, min(self.trigger.samples, self.max_samples),
                       tuple(self._sources())):
            sent = (self.trigger.step, min(self.trigger.samples, self.max_samples),
                    tuple(self._sources()))
            report = Progress(stage=self.stage, step=sent[0], samples=sent[1],
                              sources=sent[2])
            reply = await self._ask(leader, addrs, "progress", report.to_meta())
            if reply is None:
                self._consider()  # the leader was suspected: maybe we lead now
                return
            self.counters["reports_sent"] += 1
            if self._answered_at(leader, self._progress_reply(leader, reply).step):
                # the leader is catching up (it froze, or restarted): not ours at this step
                self.counters["leader_behind"] += 1
                self._consider()
                return

    async def _ask(self, peer: str, addrs: tuple[str, ...], kind: str,
                   meta: dict[str, Any]) -> Message | None:
        try:
            await self.host.ensure_connected(peer, addrs)
            t0 = self._clock()
            reply = await self._request(peer, kind, meta)
            took = self._clock() - t0
            self.histograms.observe(f"round_ask_seconds.{kind}", took, ASK_BOUNDS_S)
            if kind in PATIENT_KINDS:
                self.patience.observe(peer, took)
            if kind == "progress":
                self.trigger.took_report(peer)  # heard from, and not refusing
            else:
                self.trigger.heard_from([peer])
            return reply
        except RemoteError as exc:
            # a typed refusal is an answer too: the mate is there (its view may lag ours);
            # one that refuses every report for REFUSING_S leads nobody for a while
            self.trigger.heard_from([peer])
            self.counters[f"refused.{exc.code}"] += 1
            if kind == "progress" and self.trigger.refused_report(peer, self._clock()):
                self.counters["mates_refusing"] += 1
            return None
        except TransportError as exc:
            log.info("stage %d: %s to %s failed (%s)", self.stage, kind, peer, exc)
            self.trigger.suspect(peer, self._clock())
            self.counters["mates_unreachable"] += 1
            return None

    async def _request(self, peer: str, kind: str, meta: dict[str, Any]) -> Message:
        """One round message and its answer, within ``ASK_TIMEOUT_S``; a ``prepare`` or
        ``progress`` within the mate's measured patience (``swarmd.averaging.patience``), and
        when our own event loop woke late from that wait, ``LATE_GRACE_S`` more (the answer
        may have waited behind our stall). Too late: ``DeadlineExceeded``, counted
        ``answer_late.<kind>``; the request runs on to ``ASK_TIMEOUT_S`` (``_late_answer``)."""
        request = self.host.request(peer, self.protocol, Message(kind=kind, meta=meta),
                                    timeout=ASK_TIMEOUT_S)
        wait = self.patience.seconds(peer) if kind in PATIENT_KINDS else ASK_TIMEOUT_S
        if wait >= ASK_TIMEOUT_S:
            return await request
        task = asyncio.ensure_future(request)
        t0 = self._clock()
        try:
            done, _ = await asyncio.wait({task}, timeout=wait)
            if not done and self._clock() - t0 > wait + LOOP_LATE_S:
                done, _ = await asyncio.wait({task}, timeout=LATE_GRACE_S)
        except BaseException:
            task.cancel()
            raise
        if done:
            return task.result()
        self.counters[f"answer_late.{kind}"] += 1
        self._late.add(task)
        task.add_done_callback(lambda t: self._late_answer(peer, kind, t0, t))
        raise DeadlineExceeded(f"{kind} with {peer}: no answer within {wait:.2f} s "
                               f"(its recent answers came faster)")

    def _late_answer(self, peer: str, kind: str, t0: float, task: asyncio.Task[Message]
                     ) -> None:
        """A request given up on at the mate's patience ended. Answered after all: the mate
        was slow, not gone: its answer time counts (more patience next time), and it is no
        longer suspected (``answer_came_late.<kind>``)."""
        self._late.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        took = self._clock() - t0
        self.histograms.observe(f"round_ask_seconds.{kind}", took, ASK_BOUNDS_S)
        self.patience.observe(peer, took)
        self.trigger.answered(peer)
        self.counters[f"answer_came_late.{kind}"] += 1

    def _progress_reply(self, peer: str, reply: Message) -> ProgressReply:
        """The leader's answer to ``progress`` (its step unknown when malformed)."""
        try:
            return parse_progress_reply(reply.kind, reply.meta)
        except BadPeerMessage as exc:
            log.info("stage %d: bad progress reply from %s: %s", self.stage, peer, exc)
            self.counters[f"bad_replies.{exc.reason}"] += 1
            return ProgressReply()

    def _prepared(self, peer: str, reply: Message | None) -> PrepareReply | None:
        """A mate's answer to ``prepare``, or None (no answer, or a malformed one)."""
        if reply is None:
            return None
        try:
            return parse_prepare_reply(reply.kind, reply.meta)
        except BadPeerMessage as exc:
            log.info("stage %d: bad prepare reply from %s: %s", self.stage, peer, exc)
            self.counters[f"bad_replies.{exc.reason}"] += 1
            return None

    async def _serve(self, message: Message, peer: str) -> Message:
        request: Progress | Prepare | Start | None = None
        try:
            request = parse_round(message.kind, message.meta, message.tensors)
            return await self._answer(request, peer)
        except BaseException as exc:
            if isinstance(exc, BadPeerMessage):
                self.counters[f"bad_requests.{exc.reason}"] += 1
                log.info("stage %d: refused a round message from %s: %s", self.stage, peer,
                         exc)
            if isinstance(request, Start) and self.averager is not None:
                # never joined here: its members repair our part at once, not at a deadline
                self.counters["starts_declined"] += 1
                self.averager.decline(request.round_id)
            raise

    async def _answer(self, request: Progress | Prepare | Start, peer: str) -> Message:
        """Who may say what: mates of this stage only (live, or listed live within the grace);
        ``start`` only from its leader."""
        if request.stage != self.stage:
            raise RoundRefused(f"this peer serves stage {self.stage}, not {request.stage}")
        mates = self.known_mates()
        if peer not in mates:
            raise BadRoundMessage("not_a_mate", f"{peer} is not a live peer of stage "
                                                f"{self.stage} here")
        self._recent.heard(peer, self._clock())
        if isinstance(request, Progress) and request.samples > self.max_samples:
            raise BadRoundMessage("bad_samples", f"{request.samples} samples at one step; "
                                                 f"at most {self.max_samples} are possible")
        if request.step > self.trigger.step:  # a mate ahead of us: catch up, whatever else
            self._on_behind(peer, request.step)
        if request.step >= self.trigger.step:  # not behind us (any more): it may lead us
            self.trigger.passed_over(peer, request.step)
        if isinstance(request, Start):
            await self._check_start(request, peer, mates)
        if isinstance(request, Progress):
            self.trigger.report(peer, request.step, request.samples)
            self._mate_sources[peer] = (request.step, request.sources)
            self._consider()
            return Message(kind="ok", meta=ProgressReply(step=self.trigger.step).to_meta())
        if isinstance(request, Prepare):
            reply = PrepareReply(step=self.trigger.step, free=not self.busy,
                                 bandwidth=self.bandwidth)
            return Message(kind="ok", meta=reply.to_meta())
        if request.step != self.trigger.step or self.busy:
            raise RoundRefused(f"this peer is at step {self.trigger.step}"
                               f"{' in another round' if self.busy else ''}")
        self.trigger.heard_from(request.group)  # they answered the leader's prepare
        self._round = self._spawn(self._joined(request, peer))
        return Message(kind="ok")

    async def _check_start(self, start: Start, peer: str,
                           mates: dict[str, tuple[str, ...]]) -> None:
        """A start is taken from the stage's leader only: the smallest live mate heard from.
        When the sender (heard from) would lead but for smaller mates heard from that this
        peer does not suspect yet (one just died: the sender found out first), those are
        pinged before answering."""
        me = self.trigger.me
        if me not in start.group or peer not in start.group:
            raise BadRoundMessage("bad_group", "a start's group holds its leader and this peer")
        strangers = [p for p in start.group if p != me and p not in mates]
        if strangers:
            raise BadRoundMessage("group_not_mates", f"{len(strangers)} of the group are not "
                                                     f"peers of stage {self.stage} here")
        now = self._clock()
        if self.trigger.may_lead(peer, mates, now):
            return
        ahead = [p for p in mates if p < peer and p in self.trigger.heard
                 and self.trigger.suspects.get(p, 0.0) <= now]
        if peer < me and peer in self.trigger.heard and len(ahead) <= MAX_ALIVE_CHECKS:
            alive = await asyncio.gather(*(self._alive(p, mates[p]) for p in ahead))
            if not any(alive):
                return
        raise BadRoundMessage("not_leader", f"{peer} does not lead stage {self.stage} here: "
                                            f"refused its start")

    async def _alive(self, peer: str, addrs: tuple[str, ...]) -> bool:
        """Whether ``peer`` answers a ping within ``ALIVE_TIMEOUT_S``; suspected if not."""
        try:
            async with asyncio.timeout(ALIVE_TIMEOUT_S):
                if await self.host.ensure_connected(peer, addrs, timeout=ALIVE_TIMEOUT_S):
                    await self.host.ping(peer, timeout=ALIVE_TIMEOUT_S)
                    return True
        except (TransportError, TimeoutError):
            pass
        self.trigger.suspect(peer, self._clock())
        self.counters["mates_unreachable"] += 1
        return False

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters["round_errors"] += 1
            log.error("stage %d: round task failed: %r", self.stage, task.exception())
