"""The stage server in the daemon: one peer's stage, assembled from parts with one job each.

Protocol (docs/pipeline.md): a ``forward`` arrives with activations; the ``StageWorker`` runs the
blocks in the compute thread; the output goes directly to a peer of the next stage chosen by
the ``Router`` (or, from the last stage, to the trainer as a ``result``); the reply ``ok``
travels back up the chain once the rest of it accepted. A ``backward`` walks the recorded path
in reverse the same way; stage 0 sends the input gradient to the trainer as ``grad``.

=====================================  ===========================================
part                                    its job
=====================================  ===========================================
``handlers.PipelineHandlers``          checking requests, authority, passing on
``batching.Compute``                   the compute thread and its bounded queue
``batching.Batcher``                   forward batching, joined backward
``batching.Throughput``                the throughput average membership announces
``stepping.Stepper``                   the optimizer math (in the compute thread)
``stepping.Gate``                      steps between compute calls; drains for a restore
``router.Router``                      choosing, dialing and judging the next hop
``averaging.stage_sync.StageSync``     when the stage steps, and averaging
=====================================  ===========================================
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter
from collections.abc import Iterable
from typing import Any, Callable

import torch

from swarmd.api.histogram import Histograms
from swarmd.averaging.allreduce import Averager
from swarmd.averaging.messages import Exact, Source
from swarmd.averaging.stage_sync import StageSync, SyncSettings
from swarmd.averaging.trigger import RoundTrigger, exact_step
from swarmd.pipeline.exact import AGREE, NormNotes
from swarmd.pipeline.batching import MAX_BATCH, MAX_QUEUE, Batcher, Compute, Throughput
from swarmd.pipeline.handlers import PipelineHandlers
from swarmd.errors import NotOnPath, StageBusy, SwarmdError
from swarmd.pipeline.messages import (Expect, NormNote, StepReport, hop_seconds, parse_flush,
                                      parse_norm_note, parse_step_answer)
from swarmd.pipeline.held import HOP_TIMEOUT_S
from swarmd.pipeline.progress import TrainerBook
from swarmd.pipeline.router import Router
from swarmd.pipeline.stepping import DRAIN_S, Gate, Stepper
from swarmd.pipeline.worker import StageWorker
from swarmd.pipeline.wiring import Wiring
from swarmd.protocols import Protocols
from swarmd.state.replay import ReplayLog
from swarmd.models.seam import ModelSeam
from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer
from transport.errors import TransportError
from transport.frames import Message

log = logging.getLogger("swarmd.stage")

#: how long a stage peer waits for the trainer's answer to its step report: the trainer
#: answers once every part reported, or at its own deadline (``Trainer.REPORTS_MAX_S``)
REPORT_WAIT_S = 75.0
#: how long telling the trainer that a step failed here may take (answered at once)
FAILED_REPORT_S = 5.0
#: how long a flush waits for the round in progress and the one it calls
FLUSH_WAIT_S = 60.0
#: a step of several trainers: how long the others' answers are waited for after the first
REPORT_OTHERS_S = 10.0
#: norm notes (``swarmd.pipeline.exact``): how long sending one may take, and to how many
#: peers of each other stage a peer stepping alone sends its own
NOTE_TIMEOUT_S = 5.0
NOTE_PEERS_PER_STAGE = 4

__all__ = ["StageServer", "MAX_QUEUE", "MAX_BATCH", "HOP_TIMEOUT_S", "DRAIN_S",
           "hop_seconds", "protocols"]

PeersOf = Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]]


def protocols(swarm: str) -> dict[str, str]:
    return Protocols(swarm).pipeline()


class StageServer:
    """Serves one stage. ``peers_of(stage)`` returns {peer_id: (throughput, queue, addrs)} from
    membership; ``addrs_of(peer)`` the addresses of any peer's signed announcement (the
    trainer's included): the only addresses the last stage dials a trainer at."""

    def __init__(self, host: Any, *, swarm: str, stage: int, num_stages: int,
                 model_hash: str, codec: Any, lr: float, seed: int,
                 peers_of: PeersOf, max_tokens: int, model_config: Any = None,
                 seam: ModelSeam | None = None, rng: random.Random | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 optimizer: str = "adamw", optim: OptimSettings | None = None,
                 target_batch_size: int = 1,
                 averager: Averager | None = None, sync: SyncSettings = SyncSettings(),
                 on_behind: Callable[[str, int], None] | None = None,
                 on_diverged: Callable[[str, int], None] | None = None,
                 module: torch.nn.Module | None = None, max_batch: int = 1,
                 step_drains: bool = False,
                 addrs_of: Callable[[str], tuple[str, ...]] = lambda peer: (),
                 replay: ReplayLog | None = None, trainers: TrainerBook | None = None) -> None:
        """``seam`` is the model (default: the built-in GPT of ``model_config``); ``module``
        this stage's part of it when already built (else built here, randomly initialised);
        ``optim`` the ``[training]`` optimizer keys (default: ``optimizer`` at ``lr``);
        ``replay`` logs the gradients stepped with, for mates to replay (default: none);
        ``trainers`` keeps what the trainers tell of their runs (default: a book of its own)."""
        from swarmd.models.builtin import BuiltinGPT

        if seam is None:
            seam = BuiltinGPT(model_config)
        self.seam = seam
        self.host, self.stage, self.num_stages = host, stage, num_stages
        self.model_hash = model_hash
        self.proto = protocols(swarm)
        self.peers_of = peers_of
        self.codec = codec
        #: the parts' norms of the trainer steps told here, and an event set (and replaced)
        #: whenever one comes (``on_norm_note``)
        self.notes = NormNotes(num_stages)
        self._note_came = asyncio.Event()
        #: notes being sent, answers a noted step no longer waits for
        self._background: set[asyncio.Future[Any]] = set()
        self.module = module if module is not None else seam.build_stage(
            stage, num_stages, seed=seed, device=device, dtype=dtype)
        #: > 0: token ids come in (stage 0 holding the embedding)
        vocab = seam.vocab_size if stage == 0 and seam.stage0_embeds else 0
        self.worker = StageWorker(self.module, width=seam.width, max_tokens=max_tokens,
                                  device=device, dtype=dtype, vocab=vocab)
        self.optimizer = SwarmOptimizer(self.module.parameters(),
                                        optim or OptimSettings(name=optimizer, lr=lr),
                                        dtype=dtype)
        self.counters: Counter[str] = Counter(forward=0, backward=0, rerouted=0,
                                              optimizer_steps=0)
        self.compute = Compute(f"stage{stage}-compute", self.counters)
        self.batcher = Batcher(self.worker, self.compute, self.counters, max_batch=max_batch)
        self.gate = Gate(self.worker, self.compute, self.counters, stage,
                         drain_steps=step_drains, step_samples=max(1, target_batch_size))
        #: hop and step times for ``/metrics`` (``swarmd.api.histogram``)
        self.histograms = Histograms()
        self.stepper = Stepper(self.module, self.worker, self.optimizer, self.counters,
                               replay=replay, step=lambda: self.sync.step,
                               histograms=self.histograms)
        self._throughput = Throughput()
        last = stage == num_stages - 1
        self.router = None if last else Router(
            host, stage=stage + 1, protocol=self.proto["forward"], peers_of=peers_of,
            codec=codec, rng=rng, counters=self.counters, histograms=self.histograms)
        self.handlers = PipelineHandlers(
            host, proto=self.proto, codec=codec, worker=self.worker, compute=self.compute,
            batcher=self.batcher, gate=self.gate, throughput=self._throughput,
            router=self.router, addrs_of=addrs_of, counters=self.counters,
            progressed=lambda samples: self.sync.progressed(samples),
            expect=Expect(stage=stage, num_stages=num_stages, model=model_hash,
                          width=seam.width, max_tokens=max_tokens, vocab=vocab),
            optimizer=self.optimizer, reached=self.reached,
            trainers=trainers if trainers is not None else TrainerBook())
        #: set (and replaced) whenever the stage's step changes: ``reached`` waits on it
        self._step_changed = asyncio.Event()
        self._step_listeners: list[Callable[[], None]] = []
        port = _SyncPort(self)
        self.sync = StageSync(
            host, swarm=swarm, stage=stage, averager=averager, settings=sync,
            trigger=RoundTrigger(me=host.peer_id, target=max(1, target_batch_size)),
            mates=port.mates, snapshot=port.snapshot, apply=port.apply,
            give_back=port.give_back, on_behind=on_behind or (lambda peer, step: None),
            samples_now=port.samples_now, on_stepped=port.stepped, step_alone=port.step_alone,
            digest=port.digest, on_diverged=on_diverged or (lambda peer, step: None),
            round_over=self.gate.round_over, sources=self.worker.sources.peek,
            failed=self.step_failed, histograms=self.histograms, moved=port.moved)

    def start(self) -> None:
        self.host.set_request_handler(self.proto["forward"],
                                      self.gate.passing(self.handlers.on_forward))
        self.host.set_request_handler(self.proto["backward"],
                                      self.gate.passing(self.handlers.on_backward))
        self.host.set_request_handler(self.proto["abandon"], self.handlers.on_abandon)
        self.host.set_request_handler(self.proto["flush"], self.on_flush)
        self.host.set_request_handler(self.proto["norm_note"], self.on_norm_note)
        self.sync.start()

    async def close(self) -> None:
        self.host.remove_handler(self.proto["forward"])
        self.host.remove_handler(self.proto["backward"])
        self.host.remove_handler(self.proto["abandon"])
        self.host.remove_handler(self.proto["flush"])
        self.host.remove_handler(self.proto["norm_note"])
        for task in list(self._background):
            task.cancel()
        if self.router is not None:
            await self.router.aclose()
        await self.sync.close()
        self.batcher.close()
        self.compute.close()

    def on_step(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every step (the keeper saves checkpoints from here)."""
        self._step_listeners.append(listener)

    # ---- what membership, the keeper and the API read --------------------------------------
    @property
    def wiring(self) -> Wiring | None:
        """The next stage's wiring (None at the last stage)."""
        return self.router.wiring if self.router is not None else None

    @property
    def step(self) -> int:
        """Optimizer steps this stage has taken (agreed among its peers)."""
        return self.sync.step

    @property
    def queue(self) -> int:
        """Requests waiting for or in compute (what membership announces as queue length)."""
        return self.compute.queued + self.batcher.waiting

    @property
    def throughput(self) -> float:
        """Samples per second through this stage's compute (EMA), announced in membership."""
        return self._throughput.value

    @throughput.setter
    def throughput(self, value: float) -> None:
        self._throughput.value = float(value)

    async def retire(self, timeout_s: float = DRAIN_S, *,
                     hurry: asyncio.Event | None = None) -> int:
        """Stop taking new microbatches and let those in flight here finish their backward
        (at most ``timeout_s``, not once ``hurry`` is set); the rest are handed back (their
        senders restart them). Returns how many were handed back (``stepping.Gate``)."""
        return await self.gate.retire(timeout_s, hurry=hurry)

    def staleness(self) -> dict[str, Any]:
        """What ``GET /api/v0/stage`` shows of what the stage takes in, of the gradients'
        lateness and of draining."""
        stepped = self.counters.get("stepped_samples", 0)
        return {"takes": "token ids" if self.worker.vocab else "activations",
                "step_drains": self.gate.drain_steps,
                "lateness_steps": (round(self.counters.get("late_samples", 0) / stepped, 3)
                                   if stepped else None),
                "gate_closed_s": self.counters.get("step_gate_closed_ms", 0) / 1000}

    @property
    def in_flight(self) -> int:
        """Microbatches held here, at most (``stepping.Gate.in_flight``)."""
        return self.gate.in_flight

    async def when_drained(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` (which replaces the weights, e.g. a downloaded state) once no microbatch
        waits here for its backward (``stepping.Gate``); optimizer steps do not drain."""
        return await self.gate.when_drained(fn, *args)

    def rounds_held(self) -> Any:
        """An async context in which no averaging round runs (``StageSync.held``)."""
        return self.sync.held()

    async def run_exclusive(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the compute thread, between two steps (to read the state)."""
        return await self.compute.run(fn, *args)

    def params_fingerprint(self) -> tuple[str, float]:
        """(blake2b-128 of the parameters' bytes, their L2 norm): equal weights, equal digest."""
        return self.stepper.fingerprint()

    def took_state(self, step: int) -> None:
        """The weights and optimizer were replaced by a state at ``step``."""
        self.sync.took_state(step, self.worker.samples_accumulated)
        self._step_moved()

    def _step_moved(self) -> None:
        self._step_changed.set()
        self._step_changed = asyncio.Event()

    async def reached(self, step: int, timeout_s: float) -> bool:
        """Whether the stage's step is ``step`` or more within ``timeout_s`` (a forward that
        must run on that step's weights waits: ``swarmd.pipeline.exact``)."""
        if self.sync.step > step:
            self.counters["ahead_of_forward"] += 1
        try:
            async with asyncio.timeout(timeout_s):
                while self.sync.step < step:
                    await self._step_changed.wait()
        except TimeoutError:
            return False
        return True

    async def on_flush(self, message: Message, peer: str) -> Message:
        """A trainer's ``Flush``: its step was not exact, so what this stage holds of its
        earlier steps is stepped on now (``StageSync.flush``; nothing when the stage holds
        none of them: a peer can flush only its own samples)."""
        flush = parse_flush(message, num_stages=self.num_stages)  # refusals: request_errors
        if flush.stage != self.stage:
            raise NotOnPath("stage", f"this peer serves stage {self.stage}, not {flush.stage}")
        try:
            async with asyncio.timeout(FLUSH_WAIT_S):
                stage_step = await self.sync.flush(peer, flush.step)
        except TimeoutError:  # rounds one after the other (the trainer gave up long ago)
            self.counters["flush_timeouts"] += 1
            raise StageBusy(f"stage {self.stage}'s rounds did not end within "
                            f"{FLUSH_WAIT_S:.0f} s: not flushed") from None
        return Message(kind="ok", meta={"stage_step": stage_step})

    async def on_norm_note(self, message: Message, peer: str) -> Message:
        """A part's squared norm of a trainer's step (``NormNote``): from that trainer for its
        own part, or from a peer the view lists at the stage it tells of (another stage)."""
        note = parse_norm_note(message, num_stages=self.num_stages)  # refusals: request_errors
        if note.part == self.num_stages:
            if peer != note.trainer:
                self.counters["refused.note_sender"] += 1
                raise NotOnPath("sender", f"{peer} tells the part of trainer {note.trainer}")
        elif note.part == self.stage or peer not in self.peers_of(note.part):
            self.counters["refused.note_sender"] += 1
            raise NotOnPath("sender", f"{peer} is not a peer of stage {note.part} here")
        self.notes.add(note.trainer, note.step, note.part, note.sqnorm, note.clip)
        self.counters["norm_notes_in"] += 1
        self._note_came.set()
        self._note_came = asyncio.Event()
        return Message(kind="ok")

    async def step_failed(self, exact: Exact) -> None:
        """Tell the trainers of ``exact`` that this stage takes no step for their steps now
        (its round failed), so that they do not wait for the report."""
        await self.report_step(exact, 0.0, 0, failed=True)

    async def report_step(self, exact: Exact, sqnorm: float, samples: int, *,
                          failed: bool = False, alone: bool = False) -> float | None:
        """Report the step about to be applied to each trainer whose step it is made of
        (``exact``, one step per trainer) and return the whole model's clipping coefficient
        they answer; None (each part clips its own) when there is none, one answers None or
        cannot be asked, or they disagree (``step_reports_disagree``). A peer stepping
        ``alone`` on one trainer's step that trainer sent its norm note for takes part in
        the notes (``_noted_or_answered``)."""
        if not exact:
            return None
        stage_step = self.sync.step
        if alone and len(exact) == 1 and not failed and math.isfinite(sqnorm):
            trainer, step = exact[0]
            return await self._noted_or_answered(trainer, step, sqnorm, samples, stage_step)
        asks = [asyncio.ensure_future(self._report_one(trainer, step, sqnorm, samples, failed,
                                                       stage_step))
                for trainer, step in exact]
        # the trainers of one step answer together (each once every part reported); one that
        # does not within REPORT_OTHERS_S of the first has died or left: not waited for
        done, pending = await asyncio.wait(asks, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            more, pending = await asyncio.wait(pending, timeout=REPORT_OTHERS_S)
            done |= more
            for task in pending:
                task.cancel()
            self.counters["step_reports_unanswered"] += len(pending)
        answers = [t.result() for t in done]
        if failed or any(a is None for a in answers):
            return None
        coefficients = [a for a in answers if a is not None]
        if max(coefficients) - min(coefficients) > AGREE * max(coefficients):
            self.counters["step_reports_disagree"] += 1
            return None
        return min(coefficients)

    async def _noted_or_answered(self, trainer: str, step: int, sqnorm: float, samples: int,
                                 stage_step: int) -> float | None:
        """Report this stage's norm of ``trainer``'s ``step``, and tell the other stages too
        once that trainer's own note is here (it takes part in notes); the coefficient is the
        notes' once every part's norm is here, or the answer if that comes first (an answer
        that comes after is checked against it: ``step_notes_disagree``)."""
        ask = asyncio.ensure_future(self._report_one(trainer, step, sqnorm, samples, False,
                                                     stage_step))
        told = False
        try:
            while not ask.done():
                if not told and self.notes.has_trainer(trainer, step):
                    told = True
                    self.notes.add(trainer, step, self.stage, sqnorm)
                    self._send_notes(NormNote(trainer=trainer, step=step, part=self.stage,
                                              sqnorm=sqnorm))
                coefficient = self.notes.coefficient(trainer, step)
                if coefficient is not None:
                    self.counters["steps_noted"] += 1
                    self._background.add(ask)
                    ask.add_done_callback(
                        lambda done: self._answer_after_notes(done, coefficient))
                    return coefficient
                came = asyncio.ensure_future(self._note_came.wait())
                try:
                    await asyncio.wait((ask, came), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    came.cancel()
        except BaseException:
            ask.cancel()
            raise
        return ask.result()

    def _answer_after_notes(self, ask: asyncio.Future[float | None], noted: float) -> None:
        self._background.discard(ask)
        if ask.cancelled() or ask.exception() is not None:
            return
        answer = ask.result()
        if answer is not None and answer != noted:
            self.counters["step_notes_disagree"] += 1
            log.warning("stage %d: the trainer answered %r for a step this stage took with "
                        "%r from the norm notes", self.stage, answer, noted)

    def _send_notes(self, note: NormNote) -> None:
        """``note`` to the peers of every other stage (at most ``NOTE_PEERS_PER_STAGE``
        each), in the background: one try each, within ``NOTE_TIMEOUT_S``."""
        message = Message(**note.wire())
        others = [stage for stage in range(self.num_stages) if stage != self.stage]
        for peer, addrs in note_peers(self.peers_of, others):
            task = asyncio.ensure_future(self._note_one(peer, addrs, message))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _note_one(self, peer: str, addrs: tuple[str, ...], message: Message) -> None:
        await send_note(self.host, self.proto["norm_note"], self.codec, self.counters, peer,
                        addrs, message)

    async def _report_one(self, trainer: str, step: int, sqnorm: float, samples: int,
                          failed: bool, stage_step: int) -> float | None:
        report = StepReport(step=step, stage=self.stage, stage_step=stage_step,
                            sqnorm=sqnorm if math.isfinite(sqnorm) else 0.0, samples=samples,
                            failed=failed or not math.isfinite(sqnorm))  # overflow: skipped
        try:
            reply = await self.handlers.ask_trainer(trainer, "step_report",
                                                    Message(**report.wire()),
                                                    FAILED_REPORT_S if failed else REPORT_WAIT_S)
            coefficient = parse_step_answer(reply).coefficient
        except (SwarmdError, TransportError, TimeoutError) as exc:
            self.counters["step_report_failed"] += 1
            log.info("stage %d: reporting step %d to trainer %s failed (%s): clipping this "
                     "stage's gradient on its own", self.stage, self.sync.step, trainer, exc)
            return None
        if report.failed:
            self.counters["step_reports_failed"] += 1
            return None
        self.counters["step_reports" if coefficient is not None else "step_reports_expired"] += 1
        return coefficient

    # ---- the step, in the compute thread (tests may wrap these on the instance) -------------
    def _take_gradient(self) -> tuple[torch.Tensor, int]:
        return self.stepper.take_gradient()

    def _apply_gradient(self, vector: torch.Tensor) -> None:
        self.stepper.apply_gradient(vector)


class _SyncPort:
    """What ``StageSync`` asks of the stage, as bound methods. Each looks the server's step
    functions up when called, so a wrapped ``_take_gradient`` or ``_apply_gradient`` is used."""

    def __init__(self, server: StageServer) -> None:
        self._s = server
        #: the sources of the gradient the last snapshot took (back with it if its round fails)
        self._sources: list[tuple[str, int]] = []

    def mates(self) -> dict[str, tuple[str, ...]]:
        s = self._s
        return {p: v[2] for p, v in s.peers_of(s.stage).items() if p != s.host.peer_id}

    def moved(self) -> set[str]:
        """The peers the view lists at the other stages."""
        s = self._s
        return {p for stage in range(s.num_stages) if stage != s.stage for p in s.peers_of(stage)}

    async def snapshot(self) -> tuple[torch.Tensor, int]:
        if self._s.gate.drain_steps:  # closed and drained until the round's step (Gate)
            vector, samples, self._sources = await self._s.gate.hold_for_round(self._take)
        else:
            vector, samples, self._sources = await self._s.compute.run(self._take)
        return vector, samples

    def _take(self) -> tuple[torch.Tensor, int, list[tuple[str, int]]]:
        """In the compute thread: the gradient and the sources of its samples, together."""
        sources = self._s.worker.sources.peek()
        vector, samples = self._s._take_gradient()
        return vector, samples, sources

    async def apply(self, vector: torch.Tensor, exact: Exact) -> None:
        """Step with the round's mean gradient, scaled by the whole model's clipping
        coefficient when the step is exactly one target batch of trainer steps
        (``swarmd.pipeline.exact``)."""
        s = self._s
        if exact:
            scale = getattr(s.optimizer, "scale", 1.0)
            sqnorm = float(await s.compute.run(_sqnorm, vector)) / (scale * scale)
            coefficient = await s.report_step(exact, sqnorm, 0)
            if coefficient is not None and coefficient < 1.0:
                vector = vector * coefficient
        # no drain: microbatches in flight finish on their stashed weights (worker.py)
        await s.gate.between(s._apply_gradient, vector)

    async def give_back(self, vector: torch.Tensor, samples: int) -> None:
        await self._s.compute.run(self._s.stepper.give_back, vector, samples)
        for trainer, step in self._sources:  # the round failed: their sources are back too
            if trainer:
                self._s.worker.sources.add(trainer, step)

    def samples_now(self) -> int:
        return self._s.worker.samples_accumulated

    async def digest(self) -> str:
        """The weights' round digest (sampled), in the compute thread (between two steps)."""
        return await self._s.compute.run(self._s.stepper.round_digest)

    async def step_alone(self) -> tuple[Source, ...]:
        """Step alone on what is held, reported when exact; the sources of a step that was
        not (their trainers are told: ``StageSync._tell_not_exact``), else ()."""
        s = self._s
        pairs, samples = await s.compute.run(s.worker.accumulated)  # one instant
        exact = exact_step(pairs, samples, s.sync.trigger.target) or ()
        coefficient = None
        if exact:  # the gradient's norm only for a step that is reported
            sqnorm, samples = await s.compute.run(s.stepper.mean_sqnorm)
            coefficient = await s.report_step(exact, sqnorm, samples, alone=True)
        await s.gate.between(s.stepper.step_alone, coefficient)
        return () if exact else tuple(pairs)

    def stepped(self) -> None:
        self._s._step_moved()
        for listener in list(self._s._step_listeners):
            listener()


def note_peers(peers_of: Callable[[int], dict[str, Any]],
               stages: Iterable[int]) -> list[tuple[str, tuple[str, ...]]]:
    """Where a norm note goes: at most ``NOTE_PEERS_PER_STAGE`` peers of each of ``stages``
    in the view, with their addresses."""
    return [(peer, tuple(row[2])) for stage in stages
            for peer, row in list(peers_of(stage).items())[:NOTE_PEERS_PER_STAGE]]


async def send_note(host: Any, protocol: str, codec: Any, counters: Counter[str], peer: str,
                    addrs: tuple[str, ...], message: Message) -> None:
    """One ``NormNote`` to ``peer``, one try within ``NOTE_TIMEOUT_S`` (``norm_notes_sent``,
    ``norm_notes_failed``: a note only saves time, the trainer's answer still comes)."""
    try:
        async with asyncio.timeout(NOTE_TIMEOUT_S):
            await host.connect(peer, addrs)
            await host.request(peer, protocol, message, codec=codec, timeout=NOTE_TIMEOUT_S)
        counters["norm_notes_sent"] += 1
    except Exception as exc:
        counters["norm_notes_failed"] += 1
        log.debug("norm note to %s failed: %s", peer, exc)


def _sqnorm(vector: torch.Tensor) -> float:
    return float(vector.double().pow(2).sum())

