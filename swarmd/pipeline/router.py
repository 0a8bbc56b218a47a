"""The one hop router: choose a peer of a stage, dial it, send, judge the outcome.

Used by the stage server (a forward to the next stage) and by the trainer (a forward to stage
0). The judgement (``judge``) is one table, docs/pipeline.md "Faults":

=======================================  ====================================================
what happened                            what the router does
=======================================  ====================================================
reply ``ok``                             ``Wiring.success`` with the peer's own hop time
refusal of our own output                another peer of the stage is tried; when it refuses
(``bad_activation``, codec, frame,       too (or none is in service) raise ``OutputRefused``,
size limit)                              nobody banned; when it takes it, the refuser is
                                         banned as failed (it would get us banned upstream)
``busy``                                 backpressure: ``Wiring.busy`` (a short pause, no
                                         ban), another peer now
our deadline for the hop passed          slow: ``Wiring.timeout``, another peer
dial or transport failure, any error     ``Wiring.error``: banned with backoff, another peer
reply not listed here
a reply that fails validation (not an    protocol violation: ``Wiring.violation``, banned
``ok``, a ``BadPeerMessage``)            longer (60 s doubling to 1 h), with its reason
``stage_unavailable``,                   raised as is: a later stage or the trainer is the
``trainer_unreachable``                  problem, another peer of this stage would not help
=======================================  ====================================================

Every attempt is bounded: at most ``MAX_ATTEMPTS`` tries within the caller's deadline, waits
(every peer paused or banned) never past it. One try's deadline follows the link
(``swarmd.links``): the bytes sent over the measured bandwidth, two round trips, plus what the
peer held the last requests (its compute and the chain after it, ``HopReply.held_s``) with
slack, plus 10 s (a later stage may time out on one peer and retry another first), at least
the policy's floor and at most 60 s (all of it while that peer's hop time is unknown):
``swarmd.pipeline.held``, which the trainer's backwards and a stage's results use too. Each ``ok`` feeds the shared estimates: the round trip less the time
held is the transfer. Only addresses from the peer's signed membership
announcement (``peers_of``) are dialed.

A peer's announced throughput is also the ceiling of what the wiring believes of it
(``Wiring.update_peers`` ``ceilings``, in hop terms through the ``compute_s`` each ``ok``
says): a capped peer announces what its upload cap carries (``swarmd.node.caps``), which no
hop time shows; the time its ``ok`` says it waited in that cap (``upload_wait_s``) is left
out of the hop's cost, not of the link estimates (docs/limits.md "Routing").

A forward that runs past its stage's usual hop time is *hedged* (``swarmd.pipeline.hedging``,
pure; docs/pipeline.md "Hedged hops"): after 2 x the p90 of the stage's recent hop times (at
least 0.2 s; 10 s until 4 were measured) the same message goes to another peer of the stage
in service, one that answered before if any (``hedged``; none: ``hedge_no_peer``; hedges
that lost to the first try spent the budget: ``hedge_over_budget``), the first ``ok`` wins
and the other try is cancelled (``hedge_lost``; a peer that loses 2 in a row, or any while
it never answered, is judged ``Wiring.timeout``, slow: ``hedge_slow``). A backward is never
hedged: only one peer holds its activations.

A losing try of a peer never measured yet is not cancelled: it runs on to its own deadline
as the peer's *probe* (``hedge_probe``; one a peer, ``MAX_PROBES`` in all, cancelled by
``close``). Marked slow for its loss all the same (a silent claim is the liar it may be), it
is measured when it answers, which ends the slow mark: an honest peer whose first answer is
slower than its stage's usual hop (a cold relayed path, a loaded machine) would otherwise
lose every race it is given, each try cancelled, and never be measured at all. Its answer
goes the way of any second answer: the trainer ignores a second result of a microbatch.

A violation seen outside a send (a wrong-shaped backward from a peer of this router's stage)
is charged with ``Router.penalise``: only to the peer that sent it (the authenticated libp2p
sender, never one a message names) and only when membership lists it for this stage.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections import Counter
from typing import Any, Awaitable, Callable

from swarmd.api.histogram import HOP_BOUNDS_S, Histograms
from swarmd.errors import BadPeerMessage, OutputRefused, StageUnavailable, TrainerUnreachable
from swarmd.links import LinkEstimates, links_for
from swarmd.pipeline.hedging import Hedging
from swarmd.pipeline.held import HeldTimes
from swarmd.pipeline.messages import HopReply, parse_hop_reply
from swarmd.pipeline.wiring import Kind, Wiring
from transport.errors import (
    DeadlineExceeded,
    LocalUsageError,
    RemoteError,
    TransportClosed,
    TransportError,
)
from transport.frames import Message

log = logging.getLogger("swarmd.pipeline.router")

#: tries of one send, over all peers
MAX_ATTEMPTS = 16
#: without ``wait``, how long a send may wait for a paused (busy) peer to come back
BUSY_WAIT_S = 2.0
#: with ``wait`` and nobody to wait for (no peer listed): how often to look again
POLL_S = 0.5
#: a dial to the next hop's peer, at most (another peer of the stage is tried next)
HOP_DIAL_TIMEOUT_S = 5.0
#: a try past its hedge delay whose stage has no other peer in service now (paused busy,
#: banned) looks for one again this often at most (seconds)
HEDGE_POLL_S = 1.0
#: hedges of one try at most (one more every hedge delay while no try answered)
MAX_HEDGES = 3
#: losing tries of unmeasured peers kept running as their probes, at most (one a peer)
MAX_PROBES = 16
#: a peer announced only at relayed addresses (``/p2p-circuit``) counts with this share of its
#: announced throughput: its traffic crosses a relay's links too, so peers reached directly
#: are preferred while they have room (measured hop times then take over)
RELAYED_SHARE = 0.25

PeersOf = Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]]
#: one try's outcome: (peer, its reply or None, the verdict recorded, its refusal of our output)
_Outcome = tuple[str, "HopReply | None", "Verdict | None", "OutputRefused | None"]


class Verdict(enum.Enum):
    OURS = "ours"          # our output or our call is wrong: raise, ban nobody
    BUSY = "busy"          # backpressure: pause that peer briefly, try another
    SLOW = "slow"          # it did not answer in time: lower its share, try another
    BROKEN = "broken"      # unreachable or failing: ban with backoff, try another
    VIOLATION = "violation"  # broke the protocol (a reply that fails validation): ban longer
    PASS_UP = "pass_up"    # not this peer's fault, nor fixable by another peer of its stage


#: error replies that say the peer refused what we sent as malformed
OUR_OUTPUT_REFUSED = frozenset({"bad_activation", "malformed_frame", "codec_error",
                                "limit_exceeded", "unknown_codec", "unknown_kind",
                                "protocol_violation"})
PASSED_UP = {"stage_unavailable": StageUnavailable, "trainer_unreachable": TrainerUnreachable}


def judge(exc: BaseException) -> Verdict:
    """Who is at fault for a failed hop, from the exception the send raised."""
    if isinstance(exc, RemoteError):
        if exc.code in OUR_OUTPUT_REFUSED:
            return Verdict.OURS
        if exc.code == "busy":
            return Verdict.BUSY
        if exc.code in PASSED_UP:
            return Verdict.PASS_UP
        return Verdict.BROKEN  # output_refused, wrong_stage, internal_error, anything else
    if isinstance(exc, (LocalUsageError, TransportClosed)):
        return Verdict.OURS
    if isinstance(exc, (DeadlineExceeded, TimeoutError)):
        return Verdict.SLOW
    if isinstance(exc, TransportError):  # dial failures, resets, garbage frames
        return Verdict.BROKEN
    if isinstance(exc, BadPeerMessage):  # its reply, read here, fails validation
        return Verdict.VIOLATION
    return Verdict.OURS


class Router:
    """Sends to peers of one ``stage`` with its own ``Wiring``; see the module docstring."""

    def __init__(self, host: Any, *, stage: int, protocol: str, peers_of: PeersOf,
                 codec: Any, rng: random.Random | None = None, wiring: Wiring | None = None,
                 counters: Counter[str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 links: LinkEstimates | None = None,
                 hedging: Hedging | None | bool = True,
                 histograms: Histograms | None = None) -> None:
        """``hedging``: the stage's hedging book (True: a default one; False or None: forwards
        are never hedged). ``histograms`` gets each answered try's seconds
        (``hop_seconds.<kind>``)."""
        self.host = host
        self.stage = stage
        self.protocol = protocol
        self.peers_of = peers_of
        self.codec = codec
        self.wiring = wiring or Wiring()
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self._rng = rng or random.Random()
        self._clock, self._sleep = clock, sleep
        #: the daemon's shared link estimates (swarmd.links); hop deadlines follow them
        self.links = links if links is not None else links_for(host)
        #: how long each peer held our requests (its compute and the chain after it)
        self.held = HeldTimes()
        self.histograms = histograms if histograms is not None else Histograms()
        #: the stage's recent hop times and race losers (None: no hedging)
        self.hedging: Hedging | None = (Hedging() if hedging is True else hedging or None)
        #: losing tries of unmeasured peers left running to be measured: task -> peer
        self._probes: dict[asyncio.Future[_Outcome], str] = {}

    def close(self) -> list[asyncio.Future[_Outcome]]:
        """Cancel the probes still running (the owner stops); returns them to await."""
        probes = list(self._probes)
        for task in probes:
            task.cancel()
        return probes

    async def aclose(self) -> None:
        """``close``, and wait until the probes have ended."""
        await asyncio.gather(*self.close(), return_exceptions=True)

    def hop_timeout(self, target: str, nbytes: int) -> float:
        """The deadline of one try of ``nbytes`` to ``target``: see the module docstring."""
        return self.held.deadline(self.links, target, nbytes)

    def _observed(self, target: str, nbytes: int, round_trip: float, reply: HopReply) -> None:
        now, held = self._clock(), reply.held_s
        if held is None or not 0 <= held <= round_trip:
            self.links.observe_rtt(target, round_trip, now)
            return
        self.held.observe(target, held)
        self.links.observe_transfer(target, nbytes, max(1e-4, round_trip - held), now)

    async def send(self, message: Message, *, timeout: float, kind: Kind = "forward",
                   wait: bool = False,
                   on_attempt: Callable[[str], None] | None = None) -> tuple[str, HopReply]:
        """Send ``message`` to a peer of the stage; returns that peer and its reply.

        ``wait``: when no peer is in service, wait for one (until ``timeout``) instead of
        raising ``StageUnavailable`` at once (a paused busy peer is waited for either way, at
        most ``BUSY_WAIT_S``). ``on_attempt(peer)`` is told each peer before it is sent to."""
        deadline = self._clock() + timeout
        rows = int(message.tensors[0].shape[0])
        tried: list[str] = []
        slow: set[str] = set()  # timed out on (or refused) this message: not tried again
        refused: OutputRefused | None = None  # a peer refused it: is another peer willing?
        refuser = ""
        for _ in range(MAX_ATTEMPTS):
            target = await self._choose(kind, rows, deadline, wait and refused is None, slow)
            if target is None:
                break
            if tried:
                self.counters["rerouted"] += 1
            tried.append(target)
            if on_attempt is not None:
                on_attempt(target)
            for peer, reply, verdict, exc in await self._try(
                    target, kind, message, rows, deadline, set(tried) | slow, on_attempt):
                if exc is not None:
                    if refused is not None:
                        raise exc  # two peers refused it: our output is bad
                    refused, refuser, verdict = exc, peer, Verdict.OURS
                if reply is not None:
                    if refused is not None and refuser != peer:  # a mate took what it refused
                        self._false_refusal(refuser, kind)
                    return peer, reply
                if verdict in (Verdict.SLOW, Verdict.OURS):
                    slow.add(peer)
        if refused is not None:
            raise refused
        raise StageUnavailable(f"no peer of stage {self.stage} took the {kind} (tried "
                               f"{len(set(tried))} peer(s) {len(tried)} time(s))")

    async def _choose(self, kind: Kind, rows: int, deadline: float, wait: bool,
                      slow: set[str]) -> str | None:
        """A peer in service, waiting for one within the deadline when allowed; None: give up."""
        while True:
            now = self._clock()
            if now >= deadline:
                return None
            peers = self.peers_of(self.stage)
            # every peer, every time: a peer left out of update_peers would lose its ban;
            # what a peer announces is also the most it is trusted with (its upload cap)
            self.wiring.update_peers({p: (announced_throughput(v[0], v[2]), v[1])
                                      for p, v in peers.items()}, now,
                                     ceilings={p: v[0] for p, v in peers.items()})
            if not peers:
                target = None
            elif slow:
                target = self.wiring.choose(kind, rows, now, self._rng, exclude=slow)
            else:  # (the plain call: tests may stand in for choose)
                target = self.wiring.choose(kind, rows, now, self._rng)
            if target is None and slow and not (peers.keys() - slow):
                return None  # every peer listed timed out on this message
            if target is not None:
                return target if target in peers else None  # (a stand-in choose may err)
            at = self.wiring.available_at(now)
            limit = deadline if wait else min(deadline, now + BUSY_WAIT_S)
            if at is None:  # nobody listed
                if not wait:
                    return None
                at = now + POLL_S
            if at > limit and not wait:
                return None
            self.counters["waited"] += 1
            await self._sleep(max(0.001, min(at, limit, now + POLL_S) - now))

    async def _try(self, target: str, kind: Kind, message: Message, rows: int, deadline: float,
                   tried: set[str], on_attempt: Callable[[str], None] | None) -> list[_Outcome]:
        """One try of ``target``, hedged when it is a forward that runs past the stage's
        usual hop time (``swarmd.pipeline.hedging``): then another peer of the stage, not in
        ``tried``, gets the same message and the first ``ok`` wins; the other try is
        cancelled (``hedge_lost``, ``_lost_race``). Every ``delay`` with no answer, another
        hedge, up to ``MAX_HEDGES``; with no other peer in service at that moment (paused
        busy, banned), looked for again every ``HEDGE_POLL_S`` at most. Returns every try's
        outcome, a winner last: (peer, reply, verdict, refusal)."""
        if kind != "forward" or self.hedging is None:
            return [await self._outcome(target, kind, message, rows, deadline, None)]
        hedging = self.hedging
        hedging.sent()
        race: set[str] = set()  # the tries cancelled because another won
        first = asyncio.ensure_future(
            self._outcome(target, kind, message, rows, deadline, race))
        tasks = {first: target}
        outcomes: list[_Outcome] = []
        winner: _Outcome | None = None
        delay = hedging.delay()
        hedge_at: float | None = self._clock() + delay  # None: no more hedges for this try
        told = False
        try:
            pending: set[asyncio.Future[_Outcome]] = {first}
            while pending and winner is None:
                now = self._clock()
                timeout = None if hedge_at is None else max(0.0, min(hedge_at, deadline) - now)
                done, pending = await asyncio.wait(pending, timeout=timeout,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    outcome = task.result()  # (our own output or a stage after: raised)
                    if outcome[1] is None:
                        outcomes.append(outcome)
                    elif winner is None:
                        winner = outcome
                    else:  # both answered in the same turn: the other's ok comes late
                        self.counters["hedge_late_ok"] += 1
                if winner is not None or not pending or hedge_at is None:
                    continue
                now = self._clock()
                if now >= deadline:
                    hedge_at = None  # too late to help: the tries run on to their deadline
                elif now >= hedge_at:  # no try answered within the delay since the last
                    if not hedging.may_hedge():
                        self.counters["hedge_over_budget"] += 1
                        hedge_at = None
                        continue
                    # not a peer trying it now, nor one that timed out on it or refused it;
                    # one that answered busy may take it once its pause is over
                    busy_only = {o[0] for o in outcomes if o[2] is Verdict.BUSY}
                    exclude = tried | (set(tasks.values()) - busy_only) | {
                        tasks[t] for t in pending}
                    other = self._hedge_target(kind, rows, exclude)
                    if other is not None:
                        hedging.hedged()
                        self.counters["hedged"] += 1
                        log.info("stage %d peer %s: a %s ran past %.2f s: hedged to %s",
                                 self.stage, tasks[next(iter(pending))], kind, delay, other)
                        if on_attempt is not None:
                            on_attempt(other)
                        hedge = asyncio.ensure_future(self._outcome(
                            other, kind, message, rows, deadline, race))
                        tasks[hedge] = other
                        pending.add(hedge)
                        hedges = len(tasks) - 1
                        hedge_at = now + delay if hedges < MAX_HEDGES else None
                        continue
                    if not told:
                        self.counters["hedge_no_peer"] += 1
                        told = True
                    if not self.peers_of(self.stage).keys() - exclude:
                        hedge_at = None  # nobody else listed: the try runs on to its deadline
                    else:  # others are listed but paused (busy) or banned now: look again
                        hedge_at = now + max(hedging.config.floor_s, min(delay, HEDGE_POLL_S))
            if winner is not None:
                if len(tasks) > 1:
                    won_hedge = winner[0] != target
                    self.counters["hedge_won" if won_hedge else "hedge_first_won"] += 1
                    if won_hedge:
                        hedging.hedge_won()
                for task in pending:
                    if not self._kept_as_probe(task, tasks[task]):
                        race.add(tasks[task])
                        task.cancel()
                outcomes.append(winner)
            return outcomes
        finally:
            ours = [task for task in tasks if task not in self._probes]
            for task in ours:
                task.cancel()  # (done ones: nothing; a caller that gave up: no word on them)
            await asyncio.gather(*ours, return_exceptions=True)

    def _kept_as_probe(self, task: asyncio.Future[_Outcome], peer: str) -> bool:
        """``peer`` lost a race while never measured: its try runs on as its probe (see the
        module docstring) unless it has one running already or ``MAX_PROBES`` run. Judged as a
        lost race now (slow); its answer, if it comes, measures it and ends that."""
        if (peer not in self.wiring.unmeasured() or peer in self._probes.values()
                or len(self._probes) >= MAX_PROBES):
            return False
        self._probes[task] = peer
        task.add_done_callback(self._probe_ended)
        self.counters["hedge_probe"] += 1
        self._lost_race(peer, released=False)  # its task goes on: freed when it ends
        return True

    def _probe_ended(self, task: asyncio.Future[_Outcome]) -> None:
        peer = self._probes.pop(task, "")
        if task.cancelled():
            return
        exc = task.exception()  # (a stage after ours failed: nobody waits for this answer)
        if exc is None and task.result()[1] is not None:
            self.counters["hedge_probe_answered"] += 1
            log.info("stage %d peer %s answered the race it lost: measured", self.stage, peer)

    def _hedge_target(self, kind: Kind, rows: int, exclude: set[str]) -> str | None:
        """Another peer of the stage in service now for a hedge, or None (no waiting): one
        that answered before when there is one (a hedge exists because a peer did not
        answer; another claim, from another identity of the same liar, could do the same)."""
        now = self._clock()
        peers = self.peers_of(self.stage)
        if not peers.keys() - exclude:
            return None
        unmeasured = self.wiring.unmeasured()
        if peers.keys() - exclude - unmeasured:  # (paused or banned now: None, look again)
            target = self.wiring.choose(kind, rows, now, self._rng,
                                        exclude=exclude | unmeasured)
        else:  # claims are all there is
            target = self.wiring.choose(kind, rows, now, self._rng, exclude=exclude)
        if target is not None and target not in peers:
            self.wiring.released(target)
            return None
        return target

    async def _outcome(self, target: str, kind: Kind, message: Message, rows: int,
                       deadline: float, race: set[str] | None) -> _Outcome:
        try:
            reply, verdict = await self._attempt(target, kind, message, rows, deadline, race)
        except OutputRefused as exc:
            return target, None, Verdict.OURS, exc
        return target, reply, verdict, None

    def _lost_race(self, peer: str, *, released: bool = True) -> None:
        """Another peer of the stage answered the hedge first: ``peer``'s try was cancelled
        (``released``: its task is over) or runs on as its probe."""
        self.counters["hedge_lost"] += 1
        assert self.hedging is not None
        # lost again and again, or never answered at all (a claim, which its first answer
        # would clear): slow, its share shrinks
        if self.hedging.lost(peer) or peer in self.wiring.unmeasured():
            self.counters["hedge_slow"] += 1
            self.wiring.timeout(peer, self._clock(), task_ended=released)
            log.info("stage %d peer %s lost hedged races: marked slow", self.stage, peer)
        elif released:
            self.wiring.released(peer)

    async def _attempt(self, target: str, kind: Kind, message: Message, rows: int,
                       deadline: float, race: set[str] | None = None
                       ) -> tuple[HopReply | None, Verdict | None]:
        """One try: the reply, or None and the verdict once it was recorded (try another).
        ``race``: the peers whose try was cancelled because a hedge won (``_lost_race``)."""
        t0 = self._clock()
        nbytes = _message_bytes(message)
        try:
            addrs = self.peers_of(self.stage).get(target, (0.0, 0, ()))[2]
            await self.host.connect(target, addrs, timeout=min(HOP_DIAL_TIMEOUT_S,
                                                                max(0.001, deadline - t0)))
            t1 = self._clock()
            raw = await self.host.request(target, self.protocol, message, codec=self.codec,
                                          timeout=min(self.hop_timeout(target, nbytes),
                                                      deadline - t1))
            reply = parse_hop_reply(raw)
        except asyncio.CancelledError:
            if race is not None and target in race:
                self._lost_race(target)
            else:
                self.wiring.released(target)  # the sender gave up: no word on the peer
            raise
        except Exception as exc:
            return None, self._judged(target, kind, exc)
        self._observed(target, nbytes, self._clock() - t1, reply)
        self.histograms.observe(f"hop_seconds.{kind}", self._clock() - t0, HOP_BOUNDS_S)
        if self.hedging is not None and kind == "forward":
            self.hedging.observe(self._clock() - t0)
            self.hedging.won(target)
        self.wiring.success(target, rows, reply.seconds(self._clock() - t0), kind,
                            self._clock(), compute_s=reply.compute_s)
        return reply, None

    def _false_refusal(self, peer: str, kind: Kind) -> None:
        """``peer`` refused as malformed what a peer of its stage then took: its fault, not
        ours (a liar, or built with other limits). Banned as failed, so that one such peer
        cannot make us raise ``OutputRefused``, which gets us banned by our senders."""
        self.counters["false_refusals"] += 1
        self.wiring.error(peer, self._clock(), f"refused_{kind}_others_took",
                          task_ended=False)  # (its refusal ended that task: _judged)
        log.info("stage %d peer %s refused a %s its stage mate took: banned", self.stage,
                 peer, kind)

    def penalise(self, peer: str, reason: str) -> bool:
        """``peer`` broke the protocol outside a send (e.g. sent a wrong-shaped backward):
        banned as a violator when membership lists it for this stage; returns whether it was."""
        if peer not in self.peers_of(self.stage):
            return False
        self.wiring.violation(peer, reason, self._clock())
        self.counters["violations"] += 1
        log.warning("stage %d peer %s broke the protocol (%s): banned for %.0f s", self.stage,
                    peer, reason, (self.wiring.book.banned_until(peer, self._clock()) or 0.0)
                    - self._clock())
        return True

    def _judged(self, target: str, kind: Kind, exc: Exception) -> Verdict:
        verdict = judge(exc)
        now = self._clock()
        self.counters[f"hop_{verdict.value}"] += 1
        if verdict in (Verdict.OURS, Verdict.PASS_UP, Verdict.VIOLATION):
            self.wiring.released(target)  # the task is over (the others free it themselves)
        if verdict is Verdict.OURS:
            if isinstance(exc, RemoteError):
                raise OutputRefused(f"peer {target} of stage {self.stage} refused our {kind} "
                                    f"({exc.code}): {exc.remote_message}") from exc
            raise exc
        if verdict is Verdict.PASS_UP:
            assert isinstance(exc, RemoteError)
            raise PASSED_UP[exc.code](exc.remote_message) from exc
        if verdict is Verdict.BUSY:
            self.wiring.busy(target, now)
        elif verdict is Verdict.SLOW:
            self.wiring.timeout(target, now)
        elif verdict is Verdict.VIOLATION:
            assert isinstance(exc, BadPeerMessage)
            self.wiring.violation(target, f"{kind}_{exc.reason}", now)
        else:
            self.wiring.error(target, now, _error_reason(exc))
        log.info("stage %d peer %s: %s %s (%s); trying another", self.stage, target, kind,
                 verdict.value, exc)
        return verdict


def announced_throughput(throughput: float, addrs: tuple[str, ...]) -> float:
    """What routing counts of a peer's announced throughput: all of it for a peer with a
    direct address, ``RELAYED_SHARE`` of it for one reached only through a relay."""
    if addrs and all("/p2p-circuit" in a for a in addrs):
        return throughput * RELAYED_SHARE
    return throughput


def _message_bytes(message: Message) -> int:
    """The tensor bytes a message carries (what dominates its size on the wire)."""
    total = 0
    for t in message.tensors:
        try:
            total += int(t.numel()) * int(t.element_size())
        except (AttributeError, TypeError):
            pass
    return total


def _error_reason(exc: Exception) -> str:
    """The reason a ban for a failure shows: the peer's error code, or the transport's."""
    if isinstance(exc, RemoteError):
        return f"remote_{exc.code}"
    return str(getattr(exc, "code", None) or type(exc).__name__)
