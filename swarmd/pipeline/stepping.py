"""A stage peer's optimizer step: the gradient math (in the compute thread) and the gate.

A step does not wait for the microbatches in flight here (docs/pipeline.md, "Latency hiding"):
it runs in the compute thread between two forwards or backwards (``Gate.between``), and the
microbatches forwarded before it finish their backward on the weights they were forwarded with
(``StageWorker``'s weight stashing); their gradients count toward the next step. Only
replacing the weights wholesale (a state download) and leaving the stage still drain
(``Gate.when_drained``, ``Gate.retire``).

Gradients are sums over samples everywhere (docs/pipeline.md, "Stepping"). A peer alone in its
stage divides by its samples and steps (``step_alone``); otherwise its mean gradient is taken
(``take_gradient``), averaged with its stage by ``swarmd.averaging.stage_sync`` and applied
(``apply_gradient``), or given back when the round failed (``give_back``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, deque
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterable, Iterator

import torch

from swarmd.api.histogram import STEP_BOUNDS_S, Histograms
from swarmd.pipeline.batching import Compute
from swarmd.pipeline.worker import StageWorker
from swarmd.state.replay import ReplayLog
from swarmd.state.round_digest import (DIGEST_PIECE_BYTES, DIGEST_PIECES,  # noqa: F401
                                       round_digest_of)
from swarmd.models.gpt import tensor_bytes, to_device

log = logging.getLogger("swarmd.stage")

#: a step waits at most this long for the microbatches in flight here
DRAIN_S = 20.0
DRAIN_POLL_S = 0.002
#: how long a new forward waits at a closed gate before it is refused with busy (its sender
#: tries another peer or comes back): a step that waits out a lost microbatch (up to
#: ``DRAIN_S``) must not hold new forwards past their senders' deadlines, which would lose
#: them too and make the next step wait again
GATE_WAIT_S = 2.0
#: with ``serving.step_drains`` the gate closes for every step (``Gate``): a forward waits up to
#: this many times the longest of the last ``CLOSED_KEEP`` such closes (at least
#: ``GATE_WAIT_S``, at most ``GATE_WAIT_MAX_S``: well within the 10 s a sender's hop deadline
#: leaves beyond what it measured, ``held.DOWNSTREAM_RETRY_S``), so a drain as long as the
#: usual ones refuses nobody
CLOSED_FACTOR = 2.0
CLOSED_KEEP = 8
GATE_WAIT_MAX_S = 5.0
#: a retiring peer waits for a microbatch it holds until it is this many times older than the
#: slowest recent forward-to-backward wait here (at least ``LIVE_MIN_S``): an older one was
#: most likely given up by its trainer, and waiting for it would spend the grace for nothing
LIVE_FACTOR = 3.0
LIVE_MIN_S = 5.0
#: a microbatch saved here longer than ``LIVE_FACTOR`` x the slowest recent forward-to-backward
#: wait (at least this) is taken for lost by a drain and by the step cap (``Gate``): its chain
#: died after its result reached the trainer (which restarted it), so its backward never
#: comes, and waiting for it would hold the step its ``DRAIN_S`` and a capped gate closed
#: until it expires (``StageWorker.ttl_s``, 2 minutes)
LOST_MIN_S = 10.0


Handler = Callable[[Any, str], Awaitable[Any]]


class Stepper:
    """The optimizer math of one stage; every method runs in the compute thread."""

    def __init__(self, module: torch.nn.Module, worker: StageWorker, optimizer: Any,
                 counters: Counter[str], *, replay: ReplayLog | None = None,
                 step: Callable[[], int] | None = None, histograms: Histograms | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``replay`` (with ``step()``, the stage's step before a step is applied) logs the
        gradient of every step taken here, so that a mate can replay it
        (``swarmd.state.replay``). ``histograms`` gets the seconds between consecutive steps
        (``step_seconds``), timed with ``clock``."""
        self.module = module
        self.worker = worker
        self.optimizer = optimizer
        self.counters = counters
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.replay = replay if replay is not None else ReplayLog(max_steps=0, max_bytes=0)
        self._step = step if step is not None else (lambda: 0)
        #: the step the weights are at, as the compute thread sees it: the stage's step
        #: (``step()``) moves on the event loop only after a step returned, so a capture or
        #: digest queued right behind a step must read this, never ``step()``
        self.weights_step = 0
        self.histograms = histograms if histograms is not None else Histograms()
        self._clock = clock
        self._last_step_at: float | None = None

    @property
    def numel(self) -> int:
        """The length of a flat gradient of this stage (its trainable parameters)."""
        return sum(p.numel() for p in self._params)

    def forget(self, step: int) -> None:
        """The weights were replaced by a state at ``step`` (a download): the gradients
        logged no longer lead here."""
        self.replay.clear()
        self.weights_step = step

    def _count_lateness(self) -> None:
        """Counters ``late_samples`` / ``stepped_samples``: their ratio is the mean lateness
        (in optimizer steps, from the weights a forward ran on here to those its gradient is
        applied to) of the gradients taken so far
        (``tools/bench_schedules.py`` reports it; docs/pipeline.md, "Latency hiding")."""
        self.counters["late_samples"] += int(self.worker.late_samples)
        self.counters["stepped_samples"] += self.worker.samples_accumulated

    def take_gradient(self) -> tuple[torch.Tensor, int]:
        """This peer's mean gradient (flat float32) and its samples; the accumulation restarts."""
        samples = self.worker.samples_accumulated
        self._count_lateness()
        vector = self._flat_grads()
        if samples:
            vector /= samples
        self.worker.zero_grad()
        return vector, samples

    def apply_gradient(self, vector: torch.Tensor, at: int | None = None) -> None:
        """Step with ``vector`` as the gradient; what accumulated meanwhile is kept aside.
        The step is logged for replay as applied at ``at`` (default: the stage's step)."""
        at = self._step() if at is None else at
        if self.replay.keeps(vector.numel() * 4):  # the optimizer may clip it in place: a copy
            self.replay.record(at, vector.detach().to("cpu", torch.float32, copy=True))
        else:
            self.replay.clear()
        kept = [p.grad for p in self._params]
        for p, g in self._unflatten(vector):
            p.grad = g
        self.worker.before_step()
        self.optimizer.step()
        for p, g in zip(self._params, kept):
            p.grad = g
        self._stepped(at)

    def mean_sqnorm(self) -> tuple[float, int]:
        """The squared norm of this peer's mean gradient (loss scale removed: what the
        optimizer would clip), and its samples; nothing changes."""
        samples = self.worker.samples_accumulated
        total = sum(float(p.grad.detach().float().pow(2).sum()) for p in self._params
                    if p.grad is not None)
        scale = getattr(self.optimizer, "scale", 1.0) * max(1, samples)
        return total / (scale * scale), samples

    def step_alone(self, coefficient: float | None = None) -> None:
        """A peer alone in its stage: its own mean gradient, without flattening it, scaled by
        the whole model's clipping ``coefficient`` when given (``swarmd.pipeline.exact``)."""
        samples, at = self.worker.samples_accumulated, self._step()
        self._count_lateness()
        factor = (coefficient if coefficient is not None else 1.0) / max(1, samples)
        for p in self._params:
            if p.grad is not None and factor != 1.0:
                p.grad *= factor
        if self.replay.enabled:
            self._log_alone(at)
        self.worker.before_step()
        self.optimizer.step()
        self.worker.zero_grad()
        self._stepped(at)

    def _log_alone(self, at: int) -> None:
        """Log the mean gradient ``step_alone`` steps with (before the optimizer clips it in
        place). A parameter without a gradient is skipped by the optimizer, which a replayed
        zero gradient would not be: such a step cannot be replayed (the log is cleared)."""
        if not self.replay.keeps(self.numel * 4) or any(p.grad is None for p in self._params):
            self.replay.clear()
            return
        self.replay.record(at, self._flat_grads())

    def _flat_grads(self) -> torch.Tensor:
        """The parameters' gradients as one flat float32 vector on the host (zeros where a
        parameter has none), flattened where they are: one device-to-host copy."""
        return torch.cat([(p.grad.detach() if p.grad is not None else torch.zeros_like(p))
                          .reshape(-1).to(torch.float32) for p in self._params]).to("cpu")

    def _stepped(self, at: int) -> None:
        self.weights_step = at + 1
        self.counters["optimizer_steps"] += 1
        now = self._clock()
        if self._last_step_at is not None:
            self.histograms.observe("step_seconds", now - self._last_step_at, STEP_BOUNDS_S)
        self._last_step_at = now
        dropped = self.worker.stepped()
        if dropped:  # their backward gets unknown_microbatch; the trainer restarts them
            self.counters["dropped_stale"] += len(dropped)
            log.warning("%d microbatch(es) more than %d steps old dropped", len(dropped),
                        self.worker.max_staleness)

    def give_back(self, vector: torch.Tensor, samples: int) -> None:
        """Undo ``take_gradient`` (a round failed): add the snapshot back."""
        for p, g in self._unflatten(vector):
            p.grad = g * samples if p.grad is None else p.grad + g * samples
        self.worker.samples_accumulated += samples
        # their lateness was counted when taken (``_count_lateness``): none again
        self.worker.forward_steps += samples * self.worker.steps

    def fingerprint(self) -> tuple[str, float]:
        """(blake2b-128 of the parameters' bytes, their L2 norm): equal weights, equal digest."""
        h = hashlib.blake2b(digest_size=16)
        total = 0.0
        with torch.no_grad():
            for p in self.module.parameters():
                h.update(tensor_bytes(p))
                total += float(p.detach().float().pow(2).sum())
        return h.hexdigest(), total ** 0.5

    def round_digest(self) -> str:
        """What a round's leader sends in its ``start``: ``swarmd.state.round_digest``."""
        return round_digest_of(self.module.parameters())

    def _unflatten(self, vector: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its slice of the flat ``vector`` shaped like it), in ``take_gradient``
        order."""
        offset = 0
        if self._params:  # one host-to-device copy for the whole stage
            vector = to_device(vector, self._params[0].device)
        for p in self._params:
            n = p.numel()
            yield p, vector[offset:offset + n].view_as(p).to(p.device, p.dtype)
            offset += n


class Gate:
    """Runs what changes the weights, and knows when no microbatch is in flight here (none
    saved for its backward, none between gate and forward).

    An optimizer step goes ``between`` two compute calls: the worker stashes the weights each
    forward used, so nothing waits. Replacing the weights wholesale (``when_drained``) closes
    the gate to new forwards, waits (at most ``DRAIN_S``) for those in flight, drops the rest
    (their backward gets ``unknown_microbatch``; the trainer restarts them), runs ``fn``, and
    opens the gate again.

    With ``drain_steps`` (``serving.step_drains``) steps drain too, and the gate closes once
    ``step_samples`` samples were forwarded since the last step: the step then applies exactly
    those, none late (without the cap a drained step would wait for everything in flight and
    take it all, so the stage would step a few times less often). A gate closed by the cap
    with nothing left in flight here (those microbatches were lost) opens again. Such a gate
    closes once a step, for about a pipeline round trip: a forward waits for it as long as
    the recent closes lasted (``gate_wait_s``), so the trainer is not told ``busy`` (and does
    not shrink what it keeps in flight) for a wait that is part of every step.

    Neither a drain nor the cap waits for a microbatch saved longer than ``LOST_MIN_S`` (or
    ``LIVE_FACTOR`` x the slowest recent forward-to-backward wait here): it is dropped
    (``dropped_lost``; its backward, should it come, gets ``unknown_microbatch``), unless its
    output is still being passed on from here (``passing_on``: a hop to a stalled peer
    that will be rerouted at its deadline)."""

    def __init__(self, worker: StageWorker, compute: Compute, counters: Counter[str],
                 stage: int, clock: Callable[[], float] = time.monotonic, *,
                 drain_steps: bool = False, step_samples: int = 0) -> None:
        self.worker = worker
        #: steps drain too (``serving.step_drains``): no gradient reaches a step late here
        self.drain_steps = drain_steps
        #: with ``drain_steps``: samples forwarded per step, at most (0: no cap)
        self.step_samples = step_samples if drain_steps else 0
        self._forwarded = 0
        self._capped = False
        self._draining = False
        #: closed by a round's snapshot (``hold_for_round``) until its step or its end
        self._round = False
        #: when the gate closed for the current step (cap or drain), and how long the last
        #: such closes lasted (seconds)
        self._closed_at: float | None = None
        self.closes: deque[float] = deque(maxlen=CLOSED_KEEP)
        self.compute = compute
        self.counters = counters
        self.stage = stage
        self._clock = clock
        self._open = asyncio.Event()
        self._open.set()
        self._admitted = 0
        #: forward and backward requests being handled here (``passing``)
        self._passing = 0
        #: set once the peer leaves the stage: new forwards are refused with busy
        self.retiring = False
        #: set while the peer takes a newer state of its stage (download, restore, replay of
        #: the steps since): new forwards are refused with busy, so that none waits seconds
        #: behind the catch-up here while the stage's other peers could take it
        self.catching_up = False
        #: microbatches forwarded here whose output is still being passed on (the next hop,
        #: the chain after it, or its reroute): never taken for lost, whatever their age
        self.passing_on: set[str] = set()

    def wait_s(self) -> float:
        """How long a new forward waits at the closed gate before it is refused with busy."""
        return gate_wait_s(self.closes)

    async def wait_open(self, timeout_s: float | None = None) -> bool:
        """Whether the gate opened within ``timeout_s`` (default ``wait_s()``)."""
        if self._open.is_set():
            return True
        if timeout_s is None:
            timeout_s = self.wait_s()
        try:
            async with asyncio.timeout(timeout_s):
                while not self._open.is_set():
                    if self._stuck():  # what the cap waited for will never come back
                        self._drop_lost()
                        # the samples in hand count toward the step: the gate closes again
                        # once the rest of a step's worth was forwarded
                        self._uncap(forwarded=self.worker.samples_accumulated)
                        break
                    try:
                        async with asyncio.timeout(DRAIN_POLL_S * 25):
                            await self._open.wait()
                    except TimeoutError:
                        pass
            return True
        except TimeoutError:
            return False

    def _stuck(self) -> bool:
        """Capped, with nothing left here to come back (none saved but the lost) and too few
        samples for the step: the microbatches the cap waited for were lost, so no step would
        open the gate."""
        return self._capped and not (
            self._draining or self._admitted or self.compute.queued or self._holds_live()
            # (a backward in the compute thread has left ``saved`` but not yet counted)
            or self.worker.samples_accumulated >= self.step_samples)

    def _alive_for_s(self, floor_s: float) -> float:
        """How long a microbatch saved here may still expect its backward: ``LIVE_FACTOR`` x
        the slowest recent forward-to-backward wait, at least ``floor_s``."""
        return max(floor_s, LIVE_FACTOR * self.worker.slowest_backward_s)

    def _holds_live(self) -> bool:
        """Whether a microbatch saved here may still come back (not taken for lost)."""
        return self.worker.saved_within(self._clock(), self._alive_for_s(LOST_MIN_S)) > 0 or any(
            self.worker.holds(mb) for mb in self.passing_on)

    def _drop_lost(self) -> None:
        lost = self.worker.drop_forwarded_before(self._clock() - self._alive_for_s(LOST_MIN_S),
                                                 keep=self.passing_on)
        if lost:
            self.counters["dropped_lost"] += len(lost)
            log.info("stage %d: %d microbatch(es) saved too long taken for lost (their chain "
                     "failed further on; their trainer restarts them)", self.stage, len(lost))

    def _uncap(self, forwarded: int = 0) -> None:
        self._forwarded, self._capped = forwarded, False
        if self._closed_at is not None:  # what draining cost: ``stage.step_gate_closed_ms``
            closed = max(0.0, self._clock() - self._closed_at)
            self.closes.append(closed)
            self.counters["step_gate_closed_ms"] += int(1000 * closed)
            self._closed_at = None
        self._open.set()

    def _close_for_step(self) -> None:
        if self._closed_at is None:
            self._closed_at = self._clock()
        self._open.clear()

    @contextmanager
    def admitted(self, samples: int = 0) -> Iterator[None]:
        """A forward (of ``samples``) past the gate, not saved yet: a step waits for it too."""
        if self.step_samples:
            self._forwarded += samples
            if self._forwarded >= self.step_samples:  # the rest wait for this step
                self._capped = True
                self._close_for_step()
        self._admitted += 1
        try:
            yield
        except BaseException:
            self.uncount(samples)  # refused (busy) or failed: it will not come back here
            raise
        finally:
            self._admitted -= 1

    def uncount(self, samples: int) -> None:
        """A forward counted toward the cap will not come back (refused after the gate, or
        its chain failed): the step must not wait for it, so the cap counts it no more, and a
        gate it closed opens again (unless a step is draining: that step opens it)."""
        if not self.step_samples:
            return
        self._forwarded = max(0, self._forwarded - samples)
        if self._capped and self._forwarded < self.step_samples and not self._draining:
            self._capped = False
            self._closed_at = None  # a cap that did not hold is no close for a step
            self._open.set()

    def passing(self, handler: Handler) -> Handler:
        """``handler`` (a forward or backward request handler), counted while it runs: a peer
        that retires waits for these too (a backward computed here may still be on its way
        to the previous stage)."""
        async def counted(message: Any, peer: str) -> Any:
            self._passing += 1
            try:
                return await handler(message, peer)
            finally:
                self._passing -= 1
        return counted

    @property
    def in_flight(self) -> int:
        """Microbatches held here, at most: saved for their backward, admitted to a forward,
        or being handled (a request in progress)."""
        return self.worker.saved + self._admitted + self._passing

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no microbatch that may still come back is here,
        then drop those taken for lost."""
        deadline = self._clock() + timeout_s
        while (self._admitted or self._holds_live()) and self._clock() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self._drop_lost()

    def _live(self) -> bool:
        """Whether a microbatch that may still finish is here: a request being handled, a
        forward admitted, or one saved recently enough for its backward to come."""
        if self._passing or self._admitted:
            return True
        return self.worker.saved_within(self._clock(), self._alive_for_s(LIVE_MIN_S)) > 0

    async def retire(self, timeout_s: float = DRAIN_S, *,
                     hurry: asyncio.Event | None = None) -> int:
        """Stop taking new microbatches (forwards are refused with busy) and let those in
        flight finish their backward (at most ``timeout_s``, not once ``hurry`` is set; not
        those too old to be alive: ``_live``). The ones that did not are handed back: dropped
        here, so that their backward is refused with ``unknown_microbatch`` and their senders
        restart them. Returns how many."""
        self.retiring = True
        deadline = self._clock() + timeout_s
        while self._live() and self._clock() < deadline and not (
                hurry is not None and hurry.is_set()):
            await asyncio.sleep(DRAIN_POLL_S)
        dropped = self.worker.expire(float("inf"))
        self.counters["handed_back"] += len(dropped)
        if dropped:
            log.warning("stage %d: %d microbatch(es) did not come back in time; handed back "
                        "to their senders", self.stage, len(dropped))
        return len(dropped)

    async def between(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` (an optimizer step) in the compute thread, without draining (unless
        ``drain_steps``: then as ``when_drained``)."""
        if self.drain_steps:
            self._close_for_step()
            return await self.when_drained(fn, *args)
        return await self.compute.run(fn, *args)

    async def hold_for_round(self, fn: Callable[..., Any], *args: Any) -> Any:
        """With ``drain_steps``, a round's snapshot: close the gate, wait for the microbatches
        in flight here, run ``fn`` (take the gradient) and keep the gate closed until the
        round applies its step (``between``) or ends without one (``round_over``). A
        backward that landed between the snapshot and the step would count toward the step
        after it: one step late, what draining is for."""
        self._close_for_step()
        self._draining = self._round = True
        try:
            return await self._drained_then(fn, *args)
        except BaseException:
            self.round_over()
            raise

    def round_over(self) -> None:
        """A round ended: open the gate its snapshot held closed, unless its step did."""
        if self._round:
            self._draining = self._round = False
            self._uncap()

    async def when_drained(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._open.clear()
        self._draining = True
        try:
            return await self._drained_then(fn, *args)
        finally:
            self._draining = self._round = False
            self._uncap()

    async def _drained_then(self, fn: Callable[..., Any], *args: Any) -> Any:
        await self.drain(DRAIN_S)
        if self.worker.saved:
            dropped = self.worker.expire(float("inf"))
            self.counters["dropped_for_step"] += len(dropped)
            log.warning("stage %d: %d microbatch(es) did not come back within %.0f s; "
                        "dropped before the step", self.stage, len(dropped), DRAIN_S)
        return await self.compute.run(fn, *args)


def gate_wait_s(closes: Iterable[float], *, floor_s: float = GATE_WAIT_S,
                cap_s: float = GATE_WAIT_MAX_S, factor: float = CLOSED_FACTOR) -> float:
    """How long a forward waits at a gate closed for a step: ``factor`` x the longest recent
    close (``closes``, seconds), within [``floor_s``, ``cap_s``]; ``floor_s`` with none yet."""
    longest = max(closes, default=0.0)
    return min(cap_s, max(floor_s, factor * longest))
