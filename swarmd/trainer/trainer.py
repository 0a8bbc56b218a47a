"""The trainer: embeddings, head and loss, and the microbatches it sends through the swarm.

For each microbatch: embed (B, T) tokens, send the activations (or the token ids, when stage 0
holds the embedding: ``ModelSeam.stage0_embeds``) to a stage-0 peer chosen by ``Wiring``
(another one if it fails: ``rerouted``); the chain ends with the last stage's ``result``
arriving here; compute the loss and its gradient, send it back along the recorded path; stage
0's ``grad`` finishes the embedding's backward (empty for token ids: it says the chain is
done). A microbatch whose chain breaks in
a way no hop could route around (a peer holding its activations died) is run again from the
start (``restarted``). A microbatch's head gradients are added once, at its first head
backward (a restart's would be the same: the weights do not change within a step), its
embedding's once it fully succeeded, so a restart never counts twice. ``lost`` counts
microbatches given up; while some stage has no peer the trainer waits and says which.

Two schedules. ``train`` (``swarmd train``) keeps the pipeline full across step boundaries
(docs/pipeline.md, "Latency hiding"): up to ``InFlight.target`` microbatches in flight at any
time, the next step's starting while the last ones of the previous step are still on their way
back; a step is taken once ``microbatches`` more have come back whole, so a microbatch's
gradient may count toward the step after the one it was sent in (staleness bounded by what is
in flight). ``train_step`` is the synchronous schedule: a step's microbatches, then the step,
nothing in flight across it (the exactness test and anything that needs quiet step boundaries).

Gradients are sums over samples everywhere (each microbatch's mean loss is scaled by its
sample count): a stage peer divides by the samples it accumulated and its stage averages those
means weighted by samples (``swarmd.averaging.stage_sync``); the trainer divides by its step's samples.
Either way the step applies the mean gradient over the samples, as one process would.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

from swarmd.errors import InternalError, NotOnPath, StageUnavailable, SwarmdError
from swarmd.pipeline.exact import StepBoard
from swarmd.pipeline.held import HeldTimes
from swarmd.pipeline.inflight import InFlight
from swarmd.pipeline.messages import (Abandon, Backward, Forward, NormNote, TrainerProgress,
                                      parse_grad, parse_result, progress_meta)
from swarmd.pipeline.penalties import CONTENT_REASONS
from swarmd.pipeline.router import Router
from swarmd.pipeline.server import note_peers, protocols, send_note
from swarmd.trainer.shares import share_of
from swarmd.trainer.step_reports import StepReports
from swarmd.trainer.trainer_compute import TrainerCompute
from swarmd.pipeline.wiring import Wiring
from swarmd.models.seam import ModelSeam, TrainerParts
from swarmd.models.gpt import wire_tensor
from swarmd.training.precision import LossScaler
from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer
from transport.errors import RemoteError, TransportError
from transport.frames import Message

log = logging.getLogger("swarmd.trainer.trainer")

MAX_RESTARTS = 8
#: validation batches in flight at once (``Trainer.evaluate``)
EVAL_IN_FLIGHT = 8
#: how long telling a peer that a microbatch was given up may take (``Trainer._abandon``)
ABANDON_TIMEOUT_S = 5.0
#: how long to wait for a missing stage before a microbatch counts as lost
MISSING_STAGE_PATIENCE_S = 300.0
#: once a send's ok came back, how long its answer (already delivered) may take to show up
ARRIVAL_GRACE_S = 5.0
MISSING_POLL_S = 1.0
#: what a failed microbatch may raise; anything else is a bug and ends the run
RESTARTABLE = (TransportError, SwarmdError, TimeoutError)


@dataclass(slots=True, eq=False)
class _Expected:
    """An answer the trainer waits for: its future, its shape, and who may send it."""

    future: asyncio.Future[torch.Tensor]
    shape: tuple[int, ...]
    #: result: the stage-0 peers the forward was sent to; grad: the path's stage-0 peer
    first: set[str] = field(default_factory=set)
    path: tuple[str, ...] = ()


@dataclass
class TrainStats:
    rerouted: int = 0
    restarted: int = 0
    lost: int = 0
    microbatches: int = 0
    tokens: int = 0
    missing_stage: int | None = None
    #: microbatches in flight now, and the number the trainer aims for (``InFlight``)
    in_flight: int = 0
    in_flight_target: int = 0
    round_trip_ms: float | None = None
    #: the whole model's clipping coefficient of the last step (exact steps; None: each part
    #: clipped its own, or not exact)
    clip_coefficient: float | None = None
    #: the whole model's gradient norm of the last step, before clipping (exact steps)
    grad_norm: float | None = None
    #: where the last step's time went (seconds): from its start to its first and to its last
    #: microbatch back (``first_back``, ``last_back``), then the trainer's own gradient
    #: (``own_gradient``), the wait for the stages' reports (``reports``, exact steps) and
    #: the optimizer step (``apply``)
    step_phases: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    #: per stage, how many microbatches each peer served (route statistics)
    routes: list[Counter[str]] = field(default_factory=list)

    def peers_used(self) -> list[int]:
        """Distinct peers each stage's microbatches went through so far."""
        return [len(r) for r in self.routes]


class Trainer(TrainerCompute, StepReports):
    """``peers_of(stage)`` returns {peer_id: (throughput, queue, addrs)} from membership."""

    def __init__(self, host: Any, *, swarm: str, num_stages: int,
                 model_hash: str, codec: Any, lr: float, seed: int,
                 peers_of: Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]],
                 model_config: Any = None, seam: ModelSeam | None = None,
                 weights: Any = None, parts: TrainerParts | None = None,
                 optim: OptimSettings | None = None,
                 rng: random.Random | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, optimizer: str = "adamw",
                 clip_whole_model: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``seam`` is the model (default: the built-in GPT of ``model_config``); ``parts`` the
        trainer's parts of it when already built, else built here from ``weights`` (its
        checkpoint; None: random initialisation); ``optim`` the ``[training]`` optimizer
        keys (default: ``optimizer`` at ``lr``). With float16, a dynamic loss scale.
        ``clip_whole_model``: in exact steps (``exact``), clip by the norm of the whole
        model's gradient (``training.grad_clip_scope = "model"``), else each part its own."""
        #: every time here is read from this clock (seconds, monotonic)
        self._clock = clock
        #: when the step under way started and reached each phase (``TrainStats.step_phases``)
        self._phases: dict[str, float] = {}
        from swarmd.models.builtin import BuiltinGPT, BuiltinTrainer

        self.host = host
        self.num_stages = num_stages
        self.model_hash = model_hash
        self.codec = codec
        self.proto = protocols(swarm)
        self.peers_of = peers_of
        self.device, self.dtype = torch.device(device), dtype
        self.seam = seam if seam is not None else BuiltinGPT(model_config)
        #: the trainer's parts of the model: embed, head and loss
        self.parts: TrainerParts = parts if parts is not None else self.seam.build_trainer(
            seed=seed, device=device, dtype=dtype, weights=weights)
        if isinstance(self.parts, BuiltinTrainer):  # the built-in model's names, as before
            self.embedding, self.head = self.parts.embedding, self.parts.head_module
        self.params = list(self.parts.parameters())  # tied weights once
        self.optimizer = SwarmOptimizer(self.params, optim or OptimSettings(name=optimizer,
                                                                            lr=lr), dtype=dtype)
        #: exact steps (the synchronous schedule): the stages report each step here and the
        #: next step's forwards name the stage steps they run on (``swarmd.pipeline.exact``)
        self.exact = False
        #: the other trainers that train now (peer ids): exact steps split each step's
        #: microbatches with them (``swarmd.trainer.shares``) and average the parts'
        #: gradients with them (``average_gradient``) before stepping
        self.other_trainers: Callable[[], Iterable[str]] = lambda: ()
        #: the step each routable peer of a stage announces (``MembershipService.steps_of``)
        self.steps_of: Callable[[int], Mapping[str, int]] = lambda stage: {}
        #: since when failing microbatches found a stage behind the step forwards name
        self._behind_since: float | None = None
        #: ``await average_gradient(samples)`` replaces the parts' mean gradient of a step
        #: with the average over every trainer's share of it; the step's samples in all, or
        #: None when that failed (``swarmd.trainer.trainer_sync``)
        self.average_gradient: Callable[[int], Awaitable[int | None]] | None = None
        #: called once the run's steps are done (``swarmd train`` announces it leaving)
        self.steps_done: Callable[[], None] = lambda: None
        #: the other trainers the step under way was split with (``share``)
        self._step_trainers: frozenset[str] = frozenset()
        self.board = StepBoard(num_stages, clip=self.optimizer.settings.grad_clip
                               if clip_whole_model else 0.0)
        #: each step's answer, for the stages' reports waiting on it
        self._answers: dict[int, asyncio.Future[float | None]] = {}
        self._report_came = asyncio.Event()
        self._reports_missed = False
        #: how long whole steps' reports came after the trainer's own part (seconds; the
        #: slowest lately: each step's lag, or 0.9 of the last, whichever is larger)
        self._report_lag_s = 0.0
        #: step -> when the trainer began waiting for its reports, for the last missed steps
        self._missed_at: dict[int, float] = {}
        #: stage -> the peers that served this step's microbatches there
        self._step_peers: dict[int, set[str]] = {}
        #: peers of ``_step_peers`` not listed at their stage, since when (``LEFT_GRACE_S``)
        self._missing_since: dict[str, float] = {}
        self.scaler = LossScaler() if dtype == torch.float16 else None
        #: a gradient overflowed during this step (float16): the step is skipped
        self._overflow = False
        self.step = 0
        self.stats = TrainStats()
        #: how the run goes, told to the stage peers in every reply (``swarmd train`` sets it)
        self.progress: TrainerProgress | None = None
        #: refused arrivals and other events, by reason
        self.counters: Counter[str] = Counter()
        self.router = Router(host, stage=0, protocol=self.proto["forward"], peers_of=peers_of,
                             codec=codec, rng=rng, counters=self.counters, clock=clock)
        #: how long the last stages' peers held our backwards (their deadlines follow it)
        self.held = HeldTimes()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trainer-compute")
        self._waiting: dict[tuple[str, str], _Expected] = {}
        self._counter = 0
        #: samples whose gradients were added since the last step
        self._samples = 0
        #: told the samples of every step once it is taken (``TrainerSync.stepped``)
        self.after_step: Callable[[int], None] | None = None
        #: the pipelined schedule's microbatches in flight
        self._running: set[asyncio.Task[tuple[float, list[torch.Tensor], float, int]]] = set()
        #: sends whose answer already arrived, finishing in the background
        self._late: set[asyncio.Future[Any]] = set()
        #: set (and replaced) whenever ``step`` moves: a microbatch of a later step waits on
        #: it before it meets the head (``_step_reached``)
        self._step_moved = asyncio.Event()
        #: step -> its microbatches whose head gradients were added
        self._heads: Counter[int] = Counter()
        #: (step, microbatches): once that many of ``step``'s passed the head, its part's norm
        #: goes to the stages (``swarmd.pipeline.exact``, "Norm notes"); None: no notes
        self._note_plan: tuple[int, int] | None = None
        #: ``train`` starts the next step's opening burst with ``_early(step)`` once the
        #: notes went; its forwards name ``_early_at``, the stage steps each stage will be at
        self._early: Callable[[int], None] | None = None
        self._early_at: tuple[int, ...] | None = None
        #: forwards sent to stage 0 whose ``ok`` (the rest of the chain took it) has not come:
        #: each counts against that peer's budget of requests in flight (``budgets``)
        self._stage0_sends = 0
        #: batches ``train`` drew for a step it has not taken (its opening burst, started
        #: early): a state saved now resumes from the first of them (``TrainData.state``)
        self.drawn_ahead = 0

    @property
    def wiring(self) -> Wiring:
        """Stage 0's wiring (the router's)."""
        return self.router.wiring

    def start(self) -> None:
        self.host.set_request_handler(self.proto["result"], self._on_arrival)
        self.host.set_request_handler(self.proto["grad"], self._on_arrival)
        self.host.set_request_handler(self.proto["step_report"], self._on_step_report)

    def close(self) -> None:
        for sender in self._late:
            sender.cancel()
        self.router.close()
        for answer in self._answers.values():
            if not answer.done():
                answer.set_result(None)
        self._compute.shutdown(wait=True, cancel_futures=True)

    # ---- arrivals from the swarm -----------------------------------------------------------
    async def _on_arrival(self, message: Message, peer: str) -> Message:
        """A ``result`` (from the last stage) or ``grad`` (from stage 0). Accepted only for a
        microbatch waited for, from the peer it went to last along its path, with the shape
        expected; anything else is refused with a typed error and changes nothing."""
        mb = message.meta.get("mb") if isinstance(message.meta, dict) else None
        expected = self._waiting.get((message.kind, mb)) if isinstance(mb, str) else None
        if expected is None:
            self.counters["late_arrivals"] += 1
            return Message(kind="ok", meta={"late": True})  # a restarted microbatch's leftover
        if expected.future.done():  # a hedged forward's other copy: the first one counts
            self.counters[f"duplicate_{message.kind}s"] += 1
            return Message(kind="ok", meta={"late": True})
        try:
            if message.kind == "result":
                result = parse_result(message, num_stages=self.num_stages,
                                      shape=expected.shape)
                if peer != result.path[-1] or result.path[0] not in expected.first:
                    raise NotOnPath("sender", f"a result of {mb!r} comes from the last peer of the path "
                                    f"its forward took, not {peer}")
                expected.path, tensor = result.path, result.y
            else:
                grad = parse_grad(message, shape=expected.shape)
                if peer not in expected.first:
                    raise NotOnPath("sender", f"the grad of {mb!r} comes from the stage-0 peer of its "
                                    f"path, not {peer}")
                tensor = grad.grad
                if grad.overflow:  # float16: a stage's gradient overflowed, skip the step
                    self._overflow = True
        except SwarmdError as exc:
            reason = getattr(exc, "reason", exc.code)
            self.counters[f"refused.{reason}"] += 1
            if reason in CONTENT_REASONS and peer in expected.first:  # a stage-0 peer we sent
                self.router.penalise(peer, f"{message.kind}_{reason}")  # it to: banned longer
            raise
        if not expected.future.done():
            expected.future.set_result(tensor)
        return Message(kind="ok", meta=progress_meta(self.progress))

    # ---- the pipelined schedule ------------------------------------------------------------
    async def train(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], *,
                    steps: int, microbatches: int, window: InFlight,
                    on_step: Callable[[int, float], Awaitable[bool]],
                    barrier: bool = False) -> None:
        """``steps`` steps of ``microbatches`` microbatches each (``next_batch()`` draws one),
        with ``window.target`` of them in flight all the time. A step is taken every
        ``microbatches`` microbatches that came back whole, whichever step they were sent in;
        then ``await on_step(step, its mean loss)``, which returns True to stop early (what is
        still in flight then finishes, and its gradients are dropped). With ``barrier`` (the
        synchronous schedule, exact steps) no microbatch of a step starts before the step
        before it was taken: each step's microbatches are exactly its own, on its weights."""
        total, launched, taken, stop = steps * microbatches, 0, 0, False
        # with the barrier, a step is this trainer's share of the swarm's step, decided as
        # the step begins; without it every step is ``microbatches``
        size = self.share(microbatches) if barrier else microbatches
        sent = done = 0  # of the step under way (the barrier: nothing of the next one)
        early = 0  # of the next step, started before this one was taken (``_early``)
        losses: list[float] = []
        phases = self._phases = {"start": self._clock()}
        busy = self.counters["hop_busy"]
        running = self._running

        def start_early(step: int) -> None:
            """The next step's opening burst, before this step is taken: the norm notes
            went, so its stages step without waiting for the answer (``_notes``)."""
            nonlocal early, launched
            # within stage 0's budget of requests in flight: this step's last forwards may
            # still wait for their chain's ok (beyond it, busy and a paused peer)
            burst = min(window.opening - self._stage0_sends, microbatches)
            if stop or early or step != self.step + 1 or taken + 1 >= steps or burst < 1:
                return
            self.counters["steps_started_early"] += 1
            for _ in range(burst):
                x, y = next_batch()
                running.add(asyncio.create_task(
                    self._microbatch(x, y, float(x.shape[0]), step)))
                early += 1
                launched += 1

        if barrier:
            self._plan_notes(size)
            self._early = start_early
        try:
            while running or (taken < steps and not stop):
                if self.counters["hop_busy"] > busy:  # a stage's queue was full
                    busy = self.counters["hop_busy"]
                    window.busy(len(running))
                while not stop and (sent < size if barrier else launched < total) and \
                        len(running) < (window.opening if barrier and done == 0
                                        else window.target):
                    x, y = next_batch()
                    running.add(asyncio.create_task(self._microbatch(x, y, float(x.shape[0]))))
                    launched += 1
                    sent += 1
                self._show(window, len(running))
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running -= finished
                for task in finished:
                    loss, grads, life, samples = task.result()  # a lost microbatch raises
                    window.completed(self._clock(), life)
                    if stop:
                        continue
                    done += 1
                    if done == 1:
                        phases["first_back"] = self._clock()
                    losses.append(loss)
                    await self._run(self._add, grads)
                    if done == size:
                        phases["last_back"] = self._clock()
                        taken_step = await self._pipelined_step(losses, window)
                        self.drawn_ahead = early  # (what a state saved in on_step leaves out)
                        stop = bool(await on_step(*taken_step))
                        if not stop:
                            self.drawn_ahead = 0
                        losses, taken, done, sent = [], taken + 1, 0, sent - size + early
                        early = 0
                        phases = self._phases = {"start": self._clock()}
                        if barrier:
                            size = self.share(microbatches)
                            self._plan_notes(size)
        finally:
            self._early = self._note_plan = None
            for task in running:
                task.cancel()
            running.clear()
            self._show(window, 0)

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every microbatch in flight came back; ``train``
        still counts them when it goes on. For a caller of ``on_step`` that needs the pipeline
        quiet (a benchmark's measurement boundary): no new microbatch starts meanwhile."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout_s)

    async def _pipelined_step(self, losses: list[float], window: InFlight
                              ) -> tuple[int, float]:
        await self._stepped()
        loss = sum(losses) / len(losses)
        self.stats.losses.append(loss)
        self._show(window, self.stats.in_flight)
        return self.step, loss

    def _record_phases(self) -> None:
        """``stats.step_phases`` of the step just taken, from the times ``train`` and
        ``_stepped`` noted: the microbatches from the step's start, each later phase from
        the one before it (a phase that did not happen is left out)."""
        t = self._phases
        out = {name: t[name] - t["start"] for name in ("first_back", "last_back")
               if name in t and "start" in t}
        before = t.get("last_back")
        for name in ("own_gradient", "reports", "apply"):
            if name in t and before is not None:
                out[name] = t[name] - before
                before = t[name]
        self.stats.step_phases = {k: max(0.0, v) for k, v in out.items()}

    def share(self, microbatches: int) -> int:
        """This trainer's microbatches of the swarm's next step of ``microbatches``
        (``swarmd.trainer.shares``); the trainers it was split with are remembered: a step
        is exact only while they stay the same."""
        self._step_trainers = frozenset(self.other_trainers())
        return share_of(self.host.peer_id, self._step_trainers, microbatches)

    def _trainers_changed(self) -> bool:
        return frozenset(self.other_trainers()) != self._step_trainers

    def _plan_notes(self, size: int) -> None:
        """Norm notes for the step under way (``swarmd.pipeline.exact``) when it is exact,
        this trainer's alone, and its part's gradient complete once its ``size``
        microbatches passed the head (stage 0 holds the embedding; no float16 loss scale,
        which may skip the step)."""
        self._note_plan = None
        if (self.exact and self.seam.stage0_embeds and self.scaler is None
                and not self._step_trainers and not self._trainers_changed()):
            self._note_plan = (self.step, size)
            self._head_added(self.step, 0)  # its early burst may all have passed already

    def _head_added(self, step: int, n: int = 1) -> None:
        """``n`` more of ``step``'s microbatches passed the head: with the last one, notes."""
        self._heads[step] += n
        plan = self._note_plan
        if plan is not None and plan[0] == step and self._heads[step] >= plan[1]:
            self._note_plan = None
            sender = asyncio.ensure_future(self._notes(step))
            self._late.add(sender)
            sender.add_done_callback(_finish_late(self._late))

    async def _notes(self, step: int) -> None:
        """``step``'s part's squared norm and the clipping bound to every stage's peers (at
        most ``NOTE_PEERS_PER_STAGE`` each), kept as the board's own (the stages and the
        board must sum the same numbers); then the next step's opening burst, its forwards
        naming the stage steps each stage will be at (one each step)."""
        own = await self._run(self._own_sqnorm)
        if step != self.step or not math.isfinite(own) or not self.exact:
            return
        self.board.own(step, own)
        note = NormNote(trainer=self.host.peer_id, step=step, part=self.num_stages,
                        sqnorm=own, clip=self.board.clip)
        message = Message(**note.wire())
        sends = [asyncio.ensure_future(send_note(self.host, self.proto["norm_note"], self.codec,
                                                 self.counters, peer, addrs, message))
                 for peer, addrs in note_peers(self.peers_of, range(self.num_stages))]
        expected = self.board.expected()
        if expected is not None and self._early is not None:
            self._early_at = tuple(s + 1 for s in expected)
            self._early(step + 1)
        await asyncio.gather(*sends)

    async def _step_reached(self, step: int) -> None:
        """Until the trainer took the steps before ``step`` (a microbatch of the next step,
        sent early, meets the head only after it stepped)."""
        while self.step < step:
            await self._step_moved.wait()

    async def _stepped(self) -> None:
        samples, step = self._samples, self.step
        phases = self._phases
        sqnorm = await self._run(self._mean_gradient)
        phases["own_gradient"] = self._clock()
        coefficient = None
        averaged = True
        if self.exact and any(True for _ in self.other_trainers()):
            # the parts' gradient over every trainer's share, so that the trainers' parts
            # take the same step (exact or not: it keeps them one model; the pipelined
            # schedule averages their weights instead, ``TrainerSync``)
            total = (None if self.average_gradient is None
                     else await self.average_gradient(samples))
            if total is None:
                averaged = False
                self.counters["trainer_rounds_missed"] += 1
            else:
                samples = total
                sqnorm = await self._run(self._gradient_sqnorm)
        if self.exact and averaged and not self._trainers_changed():
            coefficient = await self._reported(step, samples, sqnorm)
            phases["reports"] = self._clock()
        else:  # forwards name no stage step (the stages' steps may mix two of ours)
            self._not_exact(step)
        if self.exact and coefficient is None:
            await self._flush_stages(step + 1)
        self._step_peers.clear()
        self._missing_since.clear()
        await self._run(self._step_and_zero, coefficient)
        phases["apply"] = self._clock()
        self._record_phases()
        self.step += 1
        for old in [s for s in self._heads if s < self.step]:
            del self._heads[old]
        self._step_moved.set()
        self._step_moved = asyncio.Event()
        if self.after_step is not None:
            self.after_step(samples)

    def _show(self, window: InFlight, running: int) -> None:
        self.stats.in_flight, self.stats.in_flight_target = running, window.target
        self.stats.round_trip_ms = (None if window.round_trip_s is None
                                    else window.round_trip_s * 1e3)

    # ---- one step (the synchronous schedule) ---------------------------------------------------
    async def accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         concurrency: int = 4) -> list[float]:
        """Forward and backward every microbatch through the swarm; gradients of the mean loss
        accumulate here and on the stage peers. Returns each microbatch's loss."""
        gate = asyncio.Semaphore(concurrency)

        async def one(x: torch.Tensor, y: torch.Tensor) -> float:
            async with gate:  # gradients are sums over samples everywhere (see the module doc)
                loss, grads, _, _ = await self._microbatch(x, y, float(x.shape[0]))
            await self._run(self._add, grads)
            return loss

        return list(await asyncio.gather(*(one(x, y) for x, y in batches)))

    async def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         concurrency: int = 4) -> float:
        """``accumulate``, then step the embedding and head (stage peers step on their own
        once their stage holds ``averaging.target_batch_size`` samples)."""
        self._phases = {"start": self._clock()}
        losses = await self.accumulate(batches, concurrency)
        self._phases["last_back"] = self._clock()
        await self._stepped()
        loss = sum(losses) / len(losses)
        self.stats.losses.append(loss)
        return loss

    async def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                       concurrency: int = EVAL_IN_FLIGHT) -> float:
        """Mean loss on ``batches`` (forward only; stage peers keep nothing), ``concurrency``
        of them in flight at once (one after another, 32 batches cost 32 pipeline round
        trips)."""
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(x: torch.Tensor, y: torch.Tensor) -> float:
            async with gate:
                return await self._with_restarts(lambda: self._evaluate_one(x, y))

        losses = await asyncio.gather(*(one(x, y) for x, y in batches))
        return sum(losses) / len(losses)

    async def _evaluate_one(self, x: torch.Tensor, y: torch.Tensor) -> float:
        h = await self._run(self._embed, x, False)
        out, _ = await self._forward(h, self._next_mb(), eval_only=True)
        return await self._run(self._eval_loss, out, y)

    async def _microbatch(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                          step: int | None = None
                          ) -> tuple[float, list[torch.Tensor | None], float, int]:
        """One microbatch of ``step`` (default: the one under way), restarted as needed:
        (loss, gradients of the embedding, its round trip in seconds, samples). The head's
        gradients are added at its first head backward; the caller adds the embedding's
        (``_add``): only once it fully succeeded, so a restart never counts twice."""
        step = self.step if step is None else step
        headed = [False]
        loss, grads, path, life = await self._with_restarts(
            lambda: self._attempt(x, y, scale, step, headed))
        self.stats.microbatches += 1
        self.stats.tokens += x.numel()
        self._route(path)
        return loss, grads, life, int(x.shape[0])

    async def _with_restarts(self, attempt: Callable[[], Awaitable[Any]]) -> Any:
        """``attempt()``, run again from the start when the chain broke (``restarted``); a
        stage with no peer taking work is waited for (``MISSING_STAGE_PATIENCE_S``)."""
        failures, tries, patience = 0, 0, self._clock() + MISSING_STAGE_PATIENCE_S
        while failures < MAX_RESTARTS:
            if tries:
                self.stats.restarted += 1
            tries += 1
            try:
                return await attempt()
            except InternalError:
                raise
            except RESTARTABLE as exc:
                self._forget_gone_step()
                if _stage_unavailable(exc) and self._clock() < patience:
                    # a stage has no peer that takes work right now: wait, do not give up
                    log.warning("a stage is unavailable (%s): waiting, then restarting", exc)
                    await asyncio.sleep(MISSING_POLL_S)
                    continue
                log.info("microbatch failed (%s: %s): restarting it", type(exc).__name__, exc)
                failures += 1
            finally:
                self.stats.rerouted = self.counters["rerouted"]
        self.stats.lost += 1
        raise StageUnavailable(f"a microbatch failed {MAX_RESTARTS} times in a row")

    def _route(self, path: tuple[str, ...]) -> None:
        while len(self.stats.routes) < len(path):
            self.stats.routes.append(Counter())
        for stage, peer in enumerate(path):
            self.stats.routes[stage][peer] += 1
            self._step_peers.setdefault(stage, set()).add(peer)

    async def _attempt(self, x: torch.Tensor, y: torch.Tensor, scale: float, step: int,
                       headed: list[bool]
                       ) -> tuple[float, list[torch.Tensor | None], tuple[str, ...], float]:
        h, versions = await self._run(self._embed_kept, x)  # (B, T, width), keeps its graph
        sent = self._clock()
        mb = self._next_mb()
        tried: set[str] = set()  # the stage-0 peers it was sent to
        path: tuple[str, ...] = ()
        try:
            out, path = await self._forward(h, mb, eval_only=False, tried=tried, step=step)
            await self._step_reached(step)
            loss, g_out, g_head, overflow = await self._run(self._head_backward, out, y, scale)
            if overflow:  # float16: this step is skipped here and by the stages of the path
                self._overflow, g_out = True, torch.zeros_like(g_out)
            if not headed[0]:
                headed[0] = True
                await self._run(self._add_head, g_head, int(x.shape[0]))
                self._head_added(step)
            arrival = self._expect("grad", mb, self._hop0_grad_shape(h), first={path[0]},
                                   path=path).future
            backward = Backward(mb=mb, stage=self.num_stages - 1, step=step, path=path,
                                trainer=self.host.peer_id, model=self.model_hash, grad=g_out,
                                scale=self.loss_scale, overflow=overflow)
            try:
                g_h = await self._sent_then_arrived(self._held_request(
                    path[-1], "backward", Message(**backward.wire()),
                    g_out.numel() * g_out.element_size()), arrival)
            finally:
                self._waiting.pop(("grad", mb), None)
        except Exception:
            self._abandon(mb, tried | set(path))  # its restart runs under a new id
            raise
        life = self._clock() - sent
        g_emb = await self._run(self._embed_backward, x, h, versions, g_h)
        return loss, g_emb, path, life

    def _abandon(self, mb: str, peers: set[str]) -> None:
        """Tell the peers that may keep ``mb``'s forward that it was given up
        (``messages.Abandon``), so that a stage step draining for it goes on at once: in the
        background, one try each, bounded by ``ABANDON_TIMEOUT_S``."""
        message = Message(**Abandon(mb=mb).wire())
        for peer in peers:
            sender = asyncio.ensure_future(self._send_abandon(peer, message))
            self._late.add(sender)
            sender.add_done_callback(_finish_late(self._late))

    async def _send_abandon(self, peer: str, message: Message) -> None:
        try:
            await self.host.request(peer, self.proto["abandon"], message, codec=self.codec,
                                    timeout=ABANDON_TIMEOUT_S)
            self.counters["abandon_sent"] += 1
        except Exception as exc:  # a courtesy: the peer takes it for lost later anyway
            self.counters["abandon_failed"] += 1
            log.debug("abandon of %s to %s failed: %s", message.meta["mb"], peer, exc)

    # ---- the network -----------------------------------------------------------------------
    def _next_mb(self) -> str:
        self._counter += 1
        return f"{self.host.peer_id[-10:]}/{self._counter}"

    async def _forward(self, h: torch.Tensor, mb: str, *, eval_only: bool,
                       tried: set[str] | None = None, step: int | None = None
                       ) -> tuple[torch.Tensor, tuple[str, ...]]:
        """Send ``h`` into the swarm as microbatch ``mb`` of ``step`` (default: the one under
        way); returns the last stage's output and the path it took. ``tried`` gets every
        stage-0 peer it was sent to."""
        expected = self._expect("result", mb, tuple(h.shape) if h.is_floating_point()
                                else (*h.shape, self.seam.width), first=tried)
        step = self.step if step is None else step
        at = None if not self.exact else (
            self._early_at if step > self.step else self.board.expected())
        forward = Forward(mb=mb, stage=0, step=step, path=(), trainer=self.host.peer_id,
                          model=self.model_hash, x=_on_wire(h), eval=eval_only,
                          at=at)
        try:
            out = await self._sent_then_arrived(
                self._send_stage0(Message(**forward.wire()), expected), expected.future)
            return out, expected.path
        finally:
            self._waiting.pop(("result", mb), None)

    async def _sent_then_arrived(self, send: Awaitable[Any],
                                 arrival: asyncio.Future[torch.Tensor]) -> torch.Tensor:
        """Send, and return what arrives in answer. The arrival usually beats the sender's
        ``ok`` (which comes back up the whole chain), so it is not waited for: a send that
        fails before anything arrived raises; one that fails after is of no consequence. The
        send is bounded by its own deadline; after its ``ok``, the answer gets
        ``ARRIVAL_GRACE_S``."""
        sender = asyncio.ensure_future(send)
        try:
            await asyncio.wait((sender, arrival), return_when=asyncio.FIRST_COMPLETED)
            if not arrival.done():
                sender.result()  # raises when the send failed
                async with asyncio.timeout(ARRIVAL_GRACE_S):
                    return await arrival
        except BaseException:
            sender.cancel()
            raise
        if not sender.done():
            self._late.add(sender)
            sender.add_done_callback(_finish_late(self._late))
        return arrival.result()

    async def _held_request(self, peer: str, kind: str, message: Message, nbytes: int) -> Any:
        """A request whose reply waits on the chain after ``peer``: its deadline follows how
        long that peer held the last ones (``swarmd.pipeline.held``; 60 s until measured)."""
        t0 = self._clock()
        reply = await self.host.request(peer, self.proto[kind], message, codec=self.codec,
                                        timeout=self.held.deadline(self.router.links, peer,
                                                                   nbytes))
        self.held.observe(peer, self._clock() - t0)
        return reply

    async def _send_stage0(self, message: Message, expected: _Expected) -> None:
        deadline = self._clock() + MISSING_STAGE_PATIENCE_S
        await self._wait_for_stages(deadline)
        self._stage0_sends += 1
        try:
            await self.router.send(message, timeout=max(0.0, deadline - self._clock()),
                                   wait=True, on_attempt=expected.first.add)
        finally:
            self._stage0_sends -= 1

    async def _wait_for_stages(self, deadline: float) -> None:
        """Until every stage has a peer in the view (says which is missing meanwhile)."""
        said = None
        while True:
            missing = [s for s in range(self.num_stages) if not self.peers_of(s)]
            self.stats.missing_stage = missing[0] if missing else None
            if not missing:
                return
            if self._clock() >= deadline:
                raise StageUnavailable(f"stage {missing[0]} has no peer")
            if missing[0] != said:
                log.warning("waiting: stage %s has no live peer", missing[0])
                said = missing[0]
            await asyncio.sleep(MISSING_POLL_S)

    def _hop0_grad_shape(self, h: torch.Tensor) -> tuple[int, ...]:
        """What stage 0's ``grad`` holds: the gradient of ``h``, or nothing (B, T, 0) when
        ``h`` is token ids (stage 0 holds the embedding)."""
        return tuple(h.shape) if h.is_floating_point() else (*h.shape, 0)

    def _expect(self, kind: str, mb: str, shape: tuple[int, ...], *,
                first: set[str] | None = None, path: tuple[str, ...] = ()) -> _Expected:
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        expected = _Expected(future, shape, first if first is not None else set(), path)
        self._waiting[(kind, mb)] = expected
        return expected

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)


def _on_wire(h: torch.Tensor) -> torch.Tensor:
    """What goes to stage 0: the activations as ``wire_tensor`` makes them, or the token ids
    as int32 (4 bytes a token)."""
    return wire_tensor(h.detach()) if h.is_floating_point() else h.to("cpu", torch.int32)


def _stage_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, StageUnavailable) or (
        isinstance(exc, RemoteError) and exc.code == "stage_unavailable")


def _finish_late(late: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(sender: asyncio.Future[Any]) -> None:
        late.discard(sender)
        if not sender.cancelled() and sender.exception() is not None:
            log.debug("a send failed after its answer arrived: %s", sender.exception())
    return done
