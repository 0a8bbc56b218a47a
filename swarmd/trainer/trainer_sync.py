"""Several trainers of one swarm train one embedding and head between them (issue 13).

The trainers of a swarm are its peers announced online with no stage and our model
(``MembershipService.trainers``). Between them, the trainer's parts (embedding, head, loss
module) are a stage of their own, ``TRAINERS_STAGE``, run by the machinery of a stage:

- **Joining.** A trainer that starts while others train downloads one's parts and optimizer
  (``swarmd.state.fetch``, served by each trainer's ``StateServer``) before its first step,
  so a trainer that stops leaves nothing behind that another does not carry on. Only a
  trainer with no other trainer in view keeps its own (initial or resumed) parts.
- **Averaging.** After every step a trainer reports its samples; rounds (``StageSync``: the
  same leader, progress/prepare/start and all-reduce as a stage, weighted by samples) average
  the parts' *weights* — the float32 masters under mixed precision. Trainers step at their own
  pace, so averaging weights rather than gradients keeps one trainer's step independent of the
  others'. The round's result replaces the weights, plus what this trainer's own steps changed
  while the round ran (they are not lost). Optimizer moments stay each trainer's own.

A round number a mate is ahead by is taken over (``behind``): rounds count, they do not order
weights, so nothing needs downloading to join the next one.
"""

from __future__ import annotations

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


class TrainerSync:
    """``async with TrainerSync(host, trainer, ...) as sync:`` serves this trainer's parts to
    joiners and averages them with the other trainers. ``mates()`` returns {peer: addrs} of the
    other trainers; ``averager`` is the host's ``Averager``. The trainer calls ``stepped(n)``
    after each of its steps (``n`` samples)."""

    def __init__(self, host: Any, trainer: Any, *, swarm: str, model_hash: str,
                 mates: Callable[[], dict[str, tuple[str, ...]]], averager: Any,
                 settings: SyncSettings = SyncSettings(compression="none")) -> None:
        self.host = host
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
            trigger=RoundTrigger(me=host.peer_id, target=1), averager=averager, mates=mates,
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

    # ---- averaging --------------------------------------------------------------------------
    def stepped(self, samples: int) -> None:
        """This trainer took a step over ``samples`` samples."""
        self._samples += samples
        self.sync.progressed(self._samples)

    def _behind(self, peer: str, step: int) -> None:
        if step > self.sync.step and not self.sync.busy:
            self.sync.took_state(step, self._samples)
            self._count("rounds_skipped_to")

    async def _snapshot(self) -> tuple[torch.Tensor, int]:
        vector = await self.trainer._run(self._weights)
        self._taken, samples, self._samples = vector, max(1, self._samples), 0
        return vector.clone(), samples

    async def _apply(self, vector: torch.Tensor, source: Any = None) -> None:
        taken, self._taken = self._taken, None
        await self.trainer._run(self._set_weights, vector, taken)

    async def _give_back(self, vector: torch.Tensor, samples: int) -> None:
        self._taken = None
        self._samples += samples  # the weights were never changed: only the count returns

    async def _alone(self) -> None:
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
async def trainer_sync(host: Any, trainer: Any, membership: Any, config: Any
                       ) -> AsyncIterator[TrainerSync]:
    """The trainer's ``Averager`` and ``TrainerSync``, wired to ``trainer.after_step``."""
    from swarmd.averaging.allreduce import Averager, protocol_id

    async with Averager(host, protocol_id(config.swarm.name),
                        addrs_of=lambda peer: membership.trainers().get(peer, ())) as averager:
        sync = TrainerSync(host, trainer, swarm=config.swarm.name,
                           model_hash=model_hash_of(config), mates=membership.trainers,
                           averager=averager,
                           settings=SyncSettings(compression="none",
                                                 aggregator="mean",
                                                 timeout_s=config.averaging.timeout_s))
        async with sync:
            trainer.after_step = sync.stepped
            try:
                yield sync
            finally:
                trainer.after_step = None
