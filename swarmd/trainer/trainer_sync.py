"""Several trainers of one swarm train one embedding and head between them (issue 13).

The trainers of a swarm are its peers announced online with no stage and our model
(``MembershipService.trainers``). Between them, the trainer's parts (embedding, head, loss
module) are a stage of their own, ``TRAINERS_STAGE``, run by the machinery of a stage:

- **Joining.** A trainer that starts while others train downloads one's parts and optimizer
  (``swarmd.state.fetch``, served by each trainer's ``StateServer``) before its first step,
  so a trainer that stops leaves nothing behind that another does not carry on. Only a
  trainer with no other trainer in view keeps its own (initial or resumed) parts.
- **Averaging gradients** (exact steps, the synchronous schedule: ``gradients``). A step of
  the swarm is one target batch split between the trainers (``swarmd.trainer.shares``): once
  a trainer's share came back it reports its samples, and a round (``StageSync``: the same
  leader, progress/prepare/start and all-reduce as a stage, weighted by samples, the stage's
  target) averages the parts' mean *gradients* of the step; every trainer then steps on the
  average, so their parts stay one model, stepped once per target batch as the stages are.
  A round that does not come in time (a trainer gone, views that differ) leaves that step to
  each trainer's own gradient (``gradient_rounds_missed``), and their parts then differ a
  little: every ``WEIGHTS_EVERY``-th round averages the parts' weights as well (the same
  all-reduce, the weights appended to the gradient), which brings them back together.
- **Averaging weights** (the pipelined schedule). After every step a trainer reports its
  samples; rounds average the parts' *weights* — the float32 masters under mixed precision.
  Trainers step at their own pace, so averaging weights rather than gradients keeps one
  trainer's step independent of the others'. The round's result replaces the weights, plus
  what this trainer's own steps changed while the round ran (they are not lost). Optimizer
  moments stay each trainer's own.

A round number a mate is ahead by is taken over (``behind``): rounds count, they do not order
weights, so nothing needs downloading to join the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

import torch

from swarmd.averaging.stage_sync import StageSync, SyncSettings
from swarmd.averaging.trigger import RoundTrigger
from swarmd.protocols import Protocols
from swarmd.state.encoding import StageState, capture, restore, state_bytes_bound
from swarmd.state.fetch import fetch_state
from swarmd.state.messages import SizeBound
from swarmd.state.round_digest import round_digest_of
from swarmd.state.serve import StateServer
from swarmd.state.trainer_state import MAX_PARTS_BYTES, TRAINERS_STAGE
from swarmd.state.transfer import StateTransferFailed
from transport.errors import TransportError
from swarmd.models.registry import model_hash_of

log = logging.getLogger("swarmd.trainer.trainer_sync")

#: a joining trainer's whole download of a mate's state (its parts are small)
TRAINER_STATE_FETCH_TIMEOUT_S = 120.0
#: how long a trainer waits for the round that averages a step's gradients with the other
#: trainers (they finish their shares about together: they wait on the same stages);
#: after a round missed, ``GRADIENT_AFTER_MISS_S`` until one comes again (a trainer that
#: stopped stays in view for a while, and must not cost every step the whole wait)
GRADIENT_WAIT_S = 60.0
GRADIENT_AFTER_MISS_S = 10.0
GRADIENT_POLL_S = 0.5
#: once the round is this many polls late, every mate is dialed and pinged (again each time
#: the last probe ended), each within ``PROBE_S``: one that fails is gone, not waited for (a
#: killed trainer stays in the view until its announcement expires, up to a minute)
PROBE_POLLS = 2
PROBE_S = 5.0
#: every this many gradient rounds also average the parts' weights (``_grad_snapshot``)
WEIGHTS_EVERY = 16


class TrainerSync:
    """``async with TrainerSync(host, trainer, ...) as sync:`` serves this trainer's parts to
    joiners and averages them with the other trainers. ``mates()`` returns {peer: addrs} of the
    other trainers; ``averager`` is the host's ``Averager``. The trainer calls ``stepped(n)``
    after each of its steps (``n`` samples)."""

    def __init__(self, host: Any, trainer: Any, *, swarm: str, model_hash: str,
                 mates: Callable[[], dict[str, tuple[str, ...]]], averager: Any,
                 settings: SyncSettings = SyncSettings(compression="none"),
                 gradients: bool = False, target: int = 1) -> None:
        """``gradients``: average each step's gradients over ``target`` samples (the swarm's
        step), else the weights now and then (module doc)."""
        self.host = host
        self.gradients = gradients
        #: the step waiting for its averaged gradient (``average_gradient``)
        self._pending: asyncio.Future[int] | None = None
        self._missed = False
        self.trainer = trainer
        self.model_hash = model_hash
        self.mates = mates
        self.protocol = Protocols(swarm).state
        #: where the parts came from: "own" (initial or the home's) or "trainers"
        self.parts_from = "own"
        self.counters: dict[str, int] = {}
        self._samples = 0
        self._taken: torch.Tensor | None = None
        self.sync = StageSync(
            host, swarm=swarm, stage=TRAINERS_STAGE,
            trigger=RoundTrigger(me=host.peer_id, target=max(1, target) if gradients else 1),
            averager=averager, mates=mates,
            snapshot=self._snapshot, apply=self._apply, give_back=self._give_back,
            on_behind=self._behind, samples_now=lambda: self._samples,
            step_alone=self._alone, settings=settings)
        self._serving = StateServer(host, self.protocol, self._capture_parts,
                                    stage=TRAINERS_STAGE, model_hash=model_hash,
                                    counters=self.counters, step=lambda: self.sync.step,
                                    weights_digest=self._parts_digest)

    @property
    def rounds(self) -> int:
        """Rounds this trainer averaged in with others."""
        return int(self.sync.counters.get("rounds", 0))

    async def __aenter__(self) -> TrainerSync:
        self._serving.start()
        self.sync.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.sync.close()
        self._serving.close()

    # ---- joining ----------------------------------------------------------------------------
    async def join(self) -> str:
        """Take the parts of a trainer in view, if any; returns where the parts came from."""
        sources = sorted(self.mates().items())
        if not sources:
            return self.parts_from
        low, high = state_bytes_bound(self.trainer.parts)
        try:
            state = await fetch_state(self.host, self.protocol, sources, stage=TRAINERS_STAGE,
                                      model_hash=self.model_hash,
                                      timeout_s=TRAINER_STATE_FETCH_TIMEOUT_S,
                                      max_bytes=MAX_PARTS_BYTES, counters=self.counters,
                                      size_bound=SizeBound(low, high))
        except (StateTransferFailed, TransportError) as exc:
            log.warning("could not take the other trainers' embedding and head (%s): training "
                        "with this trainer's own; rounds bring them together", exc)
            self._count("parts_downloads_failed")
            return self.parts_from
        if state is None:
            return self.parts_from
        await self.trainer._run(self._restore, state)
        self.sync.took_state(state.step, 0)
        self.parts_from = "trainers"
        log.info("took the embedding and head of the other trainers (round %d)", state.step)
        return self.parts_from

    def _restore(self, state: StageState) -> None:
        restore(state, self.trainer.parts, self.trainer.optimizer, stage=TRAINERS_STAGE,
                model_hash=self.model_hash)

    async def _capture_parts(self) -> StageState | None:
        return await self.trainer._run(lambda: capture(
            self.trainer.parts, self.trainer.optimizer, stage=TRAINERS_STAGE,
            step=self.sync.step, model_hash=self.model_hash,
            meta={"trainer_step": self.trainer.step}))

    async def _parts_digest(self) -> tuple[int, str]:
        """(round, round digest) of the parts, for ``state_digest`` (``swarmd export``
        checks the parts it downloaded against it)."""
        return await self.trainer._run(lambda: (
            self.sync.step, round_digest_of(self.trainer.parts.parameters())))

    # ---- averaging gradients ----------------------------------------------------------------
    async def average_gradient(self, samples: int) -> int | None:
        """The parts' mean gradient of this trainer's ``samples`` becomes the average over
        every trainer's share of the step; the step's samples in all, or None when the round
        did not come in time (the gradient is then this trainer's own)."""
        mates = set(self.mates())
        if not mates:
            return samples
        self._pending = pending = asyncio.get_running_loop().create_future()
        self._samples = samples
        self.sync.progressed(samples)
        wait_s = GRADIENT_AFTER_MISS_S if self._missed else GRADIENT_WAIT_S
        # a mate that fails a probe (dial and ping) has died
        addrs_of = self.mates()
        probes: dict[str, asyncio.Task[bool]] = {}
        polls = 0
        try:
            async with asyncio.timeout(wait_s):
                while True:  # a trainer that left (or came) changes the step: not waited for
                    done, _ = await asyncio.wait({pending}, timeout=GRADIENT_POLL_S)
                    if done:
                        total = pending.result()
                        break
                    if set(self.mates()) != mates:
                        raise TimeoutError("the trainers changed")
                    polls += 1
                    if polls % PROBE_POLLS == 0:  # the round is late: is every mate alive?
                        for peer in mates:
                            if peer not in probes or (probes[peer].done()
                                                      and probes[peer].result()):
                                probes[peer] = asyncio.ensure_future(
                                    self._alive(peer, addrs_of.get(peer, ())))
                    # (a failed round message alone is no proof: on a loaded machine a live
                    # mate's reply can be late; a failed dial or ping is)
                    dead = sorted(p for p, probe in probes.items()
                                  if probe.done() and not probe.result())
                    if dead:
                        self._count("gradient_rounds_mate_gone")
                        raise TimeoutError(f"trainer {dead[0]} is gone")
        except TimeoutError as exc:
            self._count("gradient_rounds_missed")
            if not self._missed:
                log.warning("the other trainers did not average this step's gradient with this "
                            "one (%s): stepping on its own",
                            str(exc) or f"no round within {wait_s:.0f} s")
            self._missed = True
            return None
        finally:
            for probe in probes.values():
                probe.cancel()
            self._pending, self._samples = None, 0
            if not self.sync.busy:
                self.sync.trigger.samples = 0
        self._missed = False
        return total

    async def _alive(self, peer: str, addrs: tuple[str, ...]) -> bool:
        """Whether ``peer`` can be dialed and answers a ping (each within ``PROBE_S``)."""
        try:
            await self.host.connect(peer, addrs, timeout=PROBE_S)
            await self.host.ping(peer, timeout=PROBE_S)
            return True
        except Exception:  # a failed dial or ping: a trainer announced but gone
            return False

    def _with_weights(self) -> bool:
        """Whether this round averages the weights too: decided from the round's number,
        which every member of a round shares, so their vectors have one length."""
        return self.sync.step % WEIGHTS_EVERY == WEIGHTS_EVERY - 1

    async def _grad_snapshot(self) -> tuple[torch.Tensor, int]:
        weights = self._with_weights()
        if self._pending is None or self._pending.done():  # not waiting: nothing to add
            n = self._numel() * (2 if weights else 1)
            return await self.trainer._run(lambda: torch.zeros(n)), 0
        vector = await self.trainer._run(self._gradient)
        if weights:
            vector = torch.cat([vector, await self.trainer._run(self._weights)])
        samples, self._samples = max(1, self._samples), 0
        return vector, samples

    async def _grad_apply(self, vector: torch.Tensor) -> None:
        pending = self._pending
        if pending is None or pending.done():  # the trainer gave up on this round
            self._count("gradient_rounds_late")
            return
        n = self._numel()
        await self.trainer._run(self._set_gradient, vector[:n])
        if vector.numel() > n:  # the weights too (``WEIGHTS_EVERY``), before the step
            await self.trainer._run(self._set_weights, vector[n:], None)
        self._count("gradients_averaged")
        pending.set_result(self.sync.trigger.target)

    def _numel(self) -> int:
        return sum(p.numel() for p in self.trainer.params)

    def _gradient(self) -> torch.Tensor:
        """In the compute thread: the parts' mean gradient as one float32 vector, loss scale
        removed (zeros for a parameter without one)."""
        scale = self.trainer.loss_scale
        return torch.cat([(p.grad.detach().to("cpu", torch.float32) / scale).flatten()
                          if p.grad is not None else torch.zeros(p.numel())
                          for p in self.trainer.params])

    def _set_gradient(self, vector: torch.Tensor) -> None:
        scale = self.trainer.loss_scale
        offset = 0
        for p in self.trainer.params:
            n = p.numel()
            p.grad = (vector[offset:offset + n].view_as(p) * scale).to(p.device, p.dtype)
            offset += n

    # ---- averaging weights --------------------------------------------------------------------
    def stepped(self, samples: int) -> None:
        """This trainer took a step over ``samples`` samples."""
        self._samples += samples
        self.sync.progressed(self._samples)

    def _behind(self, peer: str, step: int) -> None:
        if step > self.sync.step and not self.sync.busy:
            self.sync.took_state(step, self._samples)
            self._count("rounds_skipped_to")

    async def _snapshot(self) -> tuple[torch.Tensor, int]:
        if self.gradients:
            return await self._grad_snapshot()
        vector = await self.trainer._run(self._weights)
        self._taken, samples, self._samples = vector, max(1, self._samples), 0
        return vector.clone(), samples

    async def _apply(self, vector: torch.Tensor, exact: Any = None) -> None:
        if self.gradients:
            await self._grad_apply(vector)
            return
        taken, self._taken = self._taken, None
        await self.trainer._run(self._set_weights, vector, taken)

    async def _give_back(self, vector: torch.Tensor, samples: int) -> None:
        if self.gradients:  # the round failed: the trainer steps on its own gradient
            if self._pending is not None and not self._pending.done():
                self._pending.set_exception(TimeoutError("the trainers' round failed"))
            return
        self._taken = None
        self._samples += samples  # the weights were never changed: only the count returns

    async def _alone(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(self._samples)  # no other trainer in view now
        self._samples = 0  # no other trainer: this one's steps are the parts' steps

    def _tensors(self) -> list[torch.Tensor]:
        """The weights the optimizer steps: the float32 masters, else the parameters."""
        master = getattr(self.trainer.optimizer, "master", None)
        return list(master.masters) if master is not None else list(self.trainer.params)

    def _weights(self) -> torch.Tensor:
        """In the compute thread: the weights as one float32 vector."""
        return torch.cat([t.detach().to("cpu", torch.float32).flatten()
                          for t in self._tensors()])

    def _set_weights(self, average: torch.Tensor, taken: torch.Tensor | None) -> None:
        """In the compute thread: the average plus what our own steps changed since the
        snapshot was taken."""
        now = self._weights()
        new = average.to(torch.float32) + (now - taken if taken is not None else 0.0)
        master = getattr(self.trainer.optimizer, "master", None)
        offset = 0
        with torch.no_grad():
            for t in self._tensors():
                n = t.numel()
                t.copy_(new[offset:offset + n].view_as(t).to(t.device, t.dtype))
                offset += n
            if master is not None:  # the module's parameters follow their masters
                for p, m in zip(master.params, master.masters):
                    p.copy_(m.to(p.dtype))
        self._count("averaged")

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1


@contextlib.asynccontextmanager
async def trainer_sync(host: Any, trainer: Any, membership: Any, config: Any, *,
                       gradients: bool = False, target: int = 1
                       ) -> AsyncIterator[TrainerSync]:
    """The trainer's ``Averager`` and ``TrainerSync``, wired to the trainer: with
    ``gradients`` (exact steps) to ``trainer.average_gradient``, the swarm's step being
    ``target`` samples; else to ``trainer.after_step``."""
    from swarmd.averaging.allreduce import Averager, protocol_id

    async with Averager(host, protocol_id(config.swarm.name),
                        addrs_of=lambda peer: membership.trainers().get(peer, ())) as averager:
        sync = TrainerSync(host, trainer, swarm=config.swarm.name,
                           model_hash=model_hash_of(config), mates=membership.trainers,
                           averager=averager,
                           settings=SyncSettings(compression="none",
                                                 aggregator="mean",
                                                 timeout_s=config.averaging.timeout_s),
                           gradients=gradients, target=target)
        async with sync:
            if gradients:
                trainer.average_gradient = sync.average_gradient
            else:
                trainer.after_step = sync.stepped
            try:
                yield sync
            finally:
                trainer.after_step = trainer.average_gradient = None
