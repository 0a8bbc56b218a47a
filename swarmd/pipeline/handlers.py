"""A stage peer's pipeline handlers: ``forward``, ``backward`` and ``abandon`` over libp2p.

Each request is built into its typed message once (``swarmd.pipeline.messages``), then judged
by the authority rules (docs/pipeline.md): a forward comes from the trainer it names (stage 0)
or from the peer its path ends with; a backward only from the peer this one sent the forward
to (the trainer, at the last stage), for a microbatch kept here; an abandon only from the
microbatch's trainer. Anything else is refused with a typed error, counted, and changes nothing.

The output goes on through the ``Router`` (stage k+1) or, from the last stage, to the trainer
as a ``result``; the trainer is dialed only at addresses from its signed announcement. What a
trainer's replies tell of its run (``messages.TrainerProgress``) goes into the stage's
``TrainerBook``; a malformed one is counted (``trainer_progress_refused``) and dropped.

Before anything else a request is admitted by the sender's budget (``budgets.PeerBudgets``:
requests and tensor bytes in flight per remote peer; a training forward also by its trainer's
microbatches kept here); the excess is refused with ``busy`` at once, never queued, and
counted (``busy_budget.<reason>``). A backward whose content fails
validation (shape, dtype, NaN/Inf, malformed) or that names another peer as its sender, from
a peer of the next stage, is a protocol violation: ``Router.penalise`` bans that peer from our
routing for longer than a failure. Authority mismatches an honest race can cause (a route
replaced by a retried forward, an expired microbatch) are refused without a penalty.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

from swarmd.errors import (
    BadActivation,
    BadPeerMessage,
    NotOnPath,
    OutputRefused,
    StageBusy,
    TrainerUnreachable,
    UnknownMicrobatch,
)
from swarmd.pipeline.batching import Batcher, Compute, Throughput
from swarmd.pipeline.budgets import PeerBudgets, Ticket, message_bytes
from swarmd.pipeline.penalties import CONTENT_REASONS
from swarmd.pipeline.messages import (
    Expect,
    Grad,
    HopReply,
    Result,
    parse_abandon,
    parse_backward,
    parse_forward,
    parse_progress,
)
from swarmd.pipeline.progress import TrainerBook
from swarmd.links import links_for
from swarmd.pipeline.held import HOP_TIMEOUT_S, HeldTimes
from swarmd.pipeline.router import OUR_OUTPUT_REFUSED, Router
from swarmd.pipeline.slots import Held, SlotShares
from swarmd.pipeline.stepping import Gate
from swarmd.pipeline.worker import StageWorker
from transport.errors import PeerUnavailable, RemoteError, TransportError
from transport.frames import Message
from transport.throttle import Throttle

#: how long the last stage waits for a trainer's announcement it has not seen yet
TRAINER_WAIT_S = 10.0
TRAINER_POLL_S = 0.2


@dataclass(slots=True)
class _Route:
    """Who may send this microbatch's backward, and where its gradient goes next."""

    trainer: str
    #: the peer the forward came from (stage 0: the trainer)
    previous: str
    #: the peers the forward was sent on to (the last stage: the trainer)
    next: set[str] = field(default_factory=set)
    #: the trainer's step the microbatch belongs to (``Forward.step``)
    step: int = 0


class PipelineHandlers:
    """``on_forward`` and ``on_backward`` of one stage peer (set as request handlers)."""

    def __init__(self, host: Any, *, proto: dict[str, str], expect: Expect, codec: Any,
                 worker: StageWorker, compute: Compute, batcher: Batcher, gate: Gate,
                 throughput: Throughput, router: Router | None,
                 addrs_of: Callable[[str], tuple[str, ...]],
                 progressed: Callable[[int], None], counters: Counter[str],
                 optimizer: Any = None, budgets: PeerBudgets | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 reached: Callable[[int, float], Awaitable[bool]] | None = None,
                 trainers: TrainerBook | None = None) -> None:
        """``reached(step, timeout_s)`` waits (at most ``timeout_s``) until the stage has taken
        its optimizer step ``step - 1``: a forward that names the stage step it must run on
        (``Forward.at``) waits for it (``swarmd.pipeline.exact``). ``trainers`` keeps what the
        trainers' replies tell of their runs."""
        self.host = host
        self.me: str = host.peer_id
        self.proto = proto
        self.expect = expect
        self.codec = codec
        self.worker, self.compute, self.batcher, self.gate = worker, compute, batcher, gate
        self.throughput = throughput
        self.router = router
        self.addrs_of = addrs_of
        self.progressed = progressed
        self.counters = counters
        #: the stage's SwarmOptimizer: takes each backward's loss scale (None: not scaled)
        self.optimizer = optimizer
        self._clock = clock
        #: what each remote peer may have in flight here (refused beyond it: busy)
        self.budgets = budgets or PeerBudgets()
        #: which trainer may take a full worker's saved slot (Sybil: ``swarmd.pipeline.slots``)
        self.shares = SlotShares(worker.max_saved)
        self._routes: dict[str, _Route] = {}
        #: how long the previous stage's peers and the trainers held our backwards, results
        #: and gradients: those deadlines follow it (``swarmd.pipeline.held``)
        self.held = HeldTimes()
        self.links = links_for(host)
        self.last = expect.stage == expect.num_stages - 1
        self.reached = reached
        self.trainers = trainers if trainers is not None else TrainerBook()

    # ---- budgets ---------------------------------------------------------------------------
    def _admit(self, message: Message, peer: str) -> Ticket:
        ticket = self.budgets.admit(peer, message_bytes(message))
        if isinstance(ticket, Ticket):
            return ticket
        self.counters[f"busy_budget.{ticket}"] += 1
        requests, nbytes = self.budgets.in_flight(peer)
        raise StageBusy(f"peer {peer} has {requests} request(s) of {nbytes} bytes in flight "
                        f"here, its budget: wait for replies before sending more")

    def _may_save(self, trainer: str) -> None:
        saved = sum(1 for mb, r in self._routes.items()
                    if r.trainer == trainer and self.worker.holds(mb))
        reason = self.budgets.may_save(trainer, saved)
        if reason is not None:
            self.counters[f"busy_budget.{reason}"] += 1
            raise StageBusy(f"trainer {trainer} has {saved} microbatches kept here for their "
                            f"backward, its budget: send backwards before more forwards")
        self._make_room(trainer)

    def _make_room(self, trainer: str) -> None:
        """A full worker: free the slot of an owner that does not answer or holds more than
        its share, if any (``SlotShares.victim``); its backward then gets unknown_microbatch."""
        if self.worker.saved < self.worker.max_saved:
            return
        since = self.worker.forwarded_at()
        held = [Held(mb, r.trainer, since[mb]) for mb, r in self._routes.items() if mb in since]
        victim = self.shares.victim(trainer, held, self._clock())
        if victim is not None:
            self._let_go(victim)
            self.counters["saved_evicted"] += 1

    async def on_forward(self, message: Message, peer: str) -> Message:
        ticket = self._admit(message, peer)
        try:
            return await self._forward(message, peer)
        finally:
            self.budgets.release(ticket)

    async def on_backward(self, message: Message, peer: str) -> Message:
        ticket = self._admit(message, peer)
        try:
            return await self._backward(message, peer)
        finally:
            self.budgets.release(ticket)

    async def on_abandon(self, message: Message, peer: str) -> Message:
        """The trainer of a microbatch kept here gave it up (``messages.Abandon``): drop it,
        so that a step draining for it (``serving.step_drains``) goes on at once. Answers
        ``ok`` with ``held``: whether it was kept here (done, expired or never seen: no)."""
        ticket = self._admit(message, peer)
        try:
            mb = self._refused_unless(lambda: parse_abandon(message)).mb
            route = self._routes.get(mb)
            if route is None or not self.worker.holds(mb):
                return Message(kind="ok", meta={"held": False})
            if peer != route.trainer:
                self._refuse("abandon_sender")
                raise NotOnPath("sender", f"only the trainer of {mb!r} may give it up, not {peer}")
            self._let_go(mb, self.worker.samples_of(mb))
            self.counters["abandoned"] += 1
            return Message(kind="ok", meta={"held": True})
        finally:
            self.budgets.release(ticket)

    # ---- forward ---------------------------------------------------------------------------
    def _unless_catching_up(self, fwd: Any) -> None:
        """A training forward is refused with busy while this peer catches up with its stage
        (``Gate.catching_up``): its backward would wait behind the download and replay."""
        if self.gate.catching_up and not fwd.eval:
            self.counters["busy_catching_up"] += 1
            raise StageBusy(f"this peer is catching up with stage {self.expect.stage}'s step: "
                            f"route elsewhere")

    async def _forward(self, message: Message, peer: str) -> Message:
        fwd = self._refused_unless(lambda: parse_forward(message, self.expect))
        expected = fwd.trainer if fwd.stage == 0 else fwd.path[-1]
        if peer != expected:
            self._refuse("forward_sender")
            raise NotOnPath("sender", f"a forward for stage {fwd.stage} comes from {expected}, not "
                            f"{peer}")
        if not fwd.eval:
            self.worker.expire(self._clock())
            self._may_save(fwd.trainer)  # at once, not after a wait at the gate
            if not await self.gate.wait_open():  # not while a step changes the weights
                self.counters["busy_stepping"] += 1
                raise StageBusy(f"stage {self.expect.stage} is taking an optimizer step: "
                                f"another peer, or this one again shortly")
            self.worker.expire(self._clock())
        if fwd.at is not None:
            self._unless_catching_up(fwd)  # no wait for a step the catch-up may jump past
            await self._wait_for_step(fwd.at[self.expect.stage])
        if self.gate.retiring:  # checked after the gate too: retiring may begin meanwhile
            raise StageBusy(f"this peer is leaving stage {self.expect.stage}: route elsewhere")
        self._unless_catching_up(fwd)
        t0 = self._clock()
        compute_s: float | None = None
        if fwd.eval:
            y = await self.compute.run(self.worker.infer, fwd.x, admit=True)
        else:
            with self.gate.admitted(int(fwd.x.shape[0])):
                y, compute_s = await self.batcher.forward(fwd.mb, fwd.x)
            self.throughput.measured(int(fwd.x.shape[0]), compute_s)  # compute alone
            self._remember(fwd.mb, _Route(trainer=fwd.trainer, previous=peer, step=fwd.step))
        service_s = self._clock() - t0
        self.counters["forward"] += 1
        if not fwd.eval:  # however long the hop takes, it is not lost while it is tried
            self.gate.passing_on.add(fwd.mb)
        try:
            await self._pass_on(fwd, y)
        except BaseException:
            # the chain failed below us: nobody will come back
            self._let_go(fwd.mb, 0 if fwd.eval else int(fwd.x.shape[0]))
            raise
        finally:
            self.gate.passing_on.discard(fwd.mb)
        # the sender's wiring judges this peer by its own queue and compute, not by the rest
        # of the chain the ok waited for, nor by the wait of the ok in our upload cap
        return Message(**HopReply(service_s=service_s, held_s=self._clock() - t0,
                                  compute_s=compute_s,
                                  upload_wait_s=_upload_wait(self.host)).wire())

    async def _pass_on(self, fwd: Any, y: Any) -> None:
        route = self._routes.get(fwd.mb) if not fwd.eval else None
        if self.last:
            if route is not None:
                route.next.add(fwd.trainer)
            result = Result(mb=fwd.mb, path=(*fwd.path, self.me), y=y)
            await self.to_trainer(fwd.trainer, "result", Message(**result.wire()))
            return
        assert self.router is not None
        await self.router.send(Message(**fwd.next_hop(self.me, y).wire()),
                               timeout=HOP_TIMEOUT_S,
                               on_attempt=route.next.add if route is not None else None)

    async def _wait_for_step(self, step: int) -> None:
        """A forward that must run on the weights of stage step ``step``: wait until this
        stage took the step before it (its round may still be averaging, or the trainer's
        answer to its report overtook by the forward), as long as a closed gate is waited for;
        then ``busy`` (a peer left behind: the trainer tries another). A peer already past
        that step runs it (counted: ``ahead_of_forward``)."""
        if self.reached is None:
            return
        if not await self.reached(step, self.gate.wait_s()):
            self.counters["busy_behind_step"] += 1
            raise StageBusy(f"stage {self.expect.stage} has not reached step {step} yet: "
                            f"another peer, or this one again shortly")

    # ---- backward --------------------------------------------------------------------------
    async def _backward(self, message: Message, peer: str) -> Message:
        try:
            bwd = self._refused_unless(lambda: parse_backward(message, self.expect))
        except BadPeerMessage as exc:
            if exc.reason in CONTENT_REASONS:
                self._penalise(peer, f"backward_{exc.reason}")
            raise
        stage = bwd.stage
        if bwd.path[stage] != self.me:
            self._refuse("path")
            raise BadActivation("path", "the backward path does not lead through this peer")
        route = self._routes.get(bwd.mb)
        if route is None or not self.worker.holds(bwd.mb):
            raise UnknownMicrobatch(f"no forward of microbatch {bwd.mb!r} is kept here (never "
                                    f"seen, already done, or expired): restart it")
        if not self.last and peer != bwd.path[stage + 1]:
            self._refuse("backward_sender")
            self._penalise(peer, "backward_forged_sender")
            raise NotOnPath("sender", f"a backward names {bwd.path[stage + 1]} as its sender, "
                            f"not {peer}")
        expected = route.trainer if self.last else bwd.path[stage + 1]
        if peer != expected or peer not in route.next or (
                stage > 0 and bwd.path[stage - 1] != route.previous):
            self._refuse("backward_sender")
            raise NotOnPath("sender", f"the backward of {bwd.mb!r} comes from the peer its forward went "
                            f"to, not {peer}")
        if self.optimizer is not None:
            self.optimizer.scale = bwd.scale  # gradients accumulate scaled; the step unscales
        gx = await self.batcher.backward(bwd.mb, bwd.grad, (route.trainer, route.step))
        overflow = bwd.overflow or not bool(torch.isfinite(gx).all())
        if overflow:  # float16: poison this step (so the stage skips it) and pass on zeros
            self.counters["grad_overflow"] += 1
            gx = torch.zeros_like(gx)
            await self.compute.run(_poison, self.worker.module)
        self._routes.pop(bwd.mb, None)
        self.shares.answered(route.trainer, self._clock())
        self.counters["backward"] += 1
        self.progressed(self.worker.samples_accumulated)
        if stage == 0:
            await self.to_trainer(route.trainer, "grad", Message(
                **Grad(mb=bwd.mb, grad=gx, overflow=overflow).wire()))
        else:
            await self._held_request(route.previous, "backward",
                                     Message(**bwd.previous_hop(gx, overflow=overflow).wire()),
                                     gx.numel() * gx.element_size())
        return Message(kind="ok")

    async def _held_request(self, peer: str, kind: str, message: Message, nbytes: int) -> Any:
        """A request whose reply waits on ``peer``'s work (and the chain after it): its
        deadline follows how long that peer held the last ones (60 s until measured)."""
        t0 = self._clock()
        reply = await self.host.request(peer, self.proto[kind], message, codec=self.codec,
                                        timeout=self.held.deadline(self.links, peer, nbytes))
        self.held.observe(peer, self._clock() - t0)
        return reply

    # ---- the trainer -----------------------------------------------------------------------
    async def _trainer_addrs(self, trainer: str) -> tuple[str, ...]:
        """The addresses of ``trainer``'s signed announcement (none needed while connected);
        one not announced yet is waited for briefly."""
        deadline = self._clock() + TRAINER_WAIT_S
        addrs = self.addrs_of(trainer)
        while not addrs and trainer not in await self.host.connected_peers():
            if self._clock() >= deadline:
                self.counters["trainer_unannounced"] += 1
                raise TrainerUnreachable(f"trainer {trainer} has not announced itself here "
                                         f"within {TRAINER_WAIT_S:.0f} s")
            await asyncio.sleep(TRAINER_POLL_S)
            addrs = self.addrs_of(trainer)
        return addrs

    async def ask_trainer(self, trainer: str, kind: str, message: Message,
                          timeout_s: float) -> Message:
        """A request to ``trainer`` (dialed as ``to_trainer`` does) within ``timeout_s``."""
        addrs = await self._trainer_addrs(trainer)
        await self.host.connect(trainer, addrs)
        reply = await self.host.request(trainer, self.proto[kind], message, codec=self.codec,
                                        timeout=timeout_s)
        self.heard_from(trainer, reply)
        return reply

    async def to_trainer(self, trainer: str, kind: str, message: Message) -> None:
        """Send to ``trainer``, dialed only at the addresses of its signed announcement (an
        existing connection does too); one not announced yet is waited for briefly."""
        addrs = await self._trainer_addrs(trainer)
        try:
            await self.host.connect(trainer, addrs)
            reply = await self._held_request(trainer, kind, message, message_bytes(message))
        except RemoteError as exc:
            if exc.code in OUR_OUTPUT_REFUSED or exc.code == "not_on_path":
                raise OutputRefused(f"trainer {trainer} refused our {kind} ({exc.code}): "
                                    f"{exc.remote_message}") from exc
            raise TrainerUnreachable(f"trainer {trainer} failed our {kind}: {exc}") from exc
        except (PeerUnavailable, TransportError) as exc:
            self.counters["trainer_unreachable"] += 1
            raise TrainerUnreachable(f"trainer {trainer}: {exc}") from exc
        self.heard_from(trainer, reply)

    def heard_from(self, trainer: str, reply: Any) -> None:
        """What ``trainer``'s reply tells of its run, into ``trainers``: a malformed one is
        counted and dropped, and the reply still counts."""
        try:
            progress = parse_progress(reply)
        except BadActivation:
            self.counters["trainer_progress_refused"] += 1
            return
        if progress is not None:
            self.trainers.heard(trainer, progress, self._clock())

    # ---- helpers ---------------------------------------------------------------------------
    def _refused_unless(self, build: Callable[[], Any]) -> Any:
        try:
            return build()
        except Exception as exc:
            self._refuse(getattr(exc, "reason", None) or getattr(exc, "code", "malformed"))
            raise

    def _refuse(self, reason: str) -> None:
        self.counters[f"refused.{reason}"] += 1

    def _penalise(self, peer: str, reason: str) -> None:
        """A violation by ``peer``: charged when our router routes to it (the next stage)."""
        if self.router is not None and self.router.penalise(peer, reason):
            self.counters[f"penalised.{reason}"] += 1

    def _remember(self, mb: str, route: _Route) -> None:
        if len(self._routes) >= 4 * self.worker.max_saved:  # drop what the worker let go
            for old in [m for m in self._routes if not self.worker.holds(m)]:
                del self._routes[old]
        self._routes[mb] = route

    def _let_go(self, mb: str, samples: int = 0) -> None:
        """Drop what is kept here for ``mb`` (its backward will never come); its ``samples``
        counted toward a capped step (``Gate.uncount``) are counted no more, so a step does
        not wait for them."""
        self.worker.forget(mb)
        self._routes.pop(mb, None)
        if samples:
            self.gate.uncount(samples)


def _poison(module: torch.nn.Module) -> None:
    """Make the accumulated gradient non-finite, so the step (alone, or averaged with the
    stage's other peers, who then see it too) is skipped: a float16 gradient overflowed."""
    for p in module.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.view(-1)[0] = float("inf")
            return


#: the bytes of a forward's ``ok`` on the wire, about (its metadata and the frame's head)
OK_REPLY_BYTES = 256


def _upload_wait(host: Any) -> float | None:
    """How long an ``ok`` built now waits in this host's upload cap (None: uncapped, or a host
    without a throttle): ``transport.throttle.Throttle.upload_wait``."""
    throttle = getattr(host, "throttle", None)
    if not isinstance(throttle, Throttle):
        return None
    seconds = throttle.upload_wait(OK_REPLY_BYTES)
    return None if seconds is None else round(seconds, 6)
