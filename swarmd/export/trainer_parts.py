"""Where an export takes the trainers' embedding and head from.

* :class:`RemoteTrainers`: a trainer training now (else, when given, the state saved in a
  trainer's home), over the state protocol (the trainers are
  a stage of their own, ``TRAINERS_STAGE``, ``swarmd.trainer.trainer_sync``): downloaded,
  then checked against the round digest the trainer reports for that round. A trainer that
  stepped on during the download is asked again (``ATTEMPTS`` times; the last copy is then
  taken unverified, the transfer's own checks passed);
* :class:`OwnParts`: a trainer exporting by itself (``swarmd.export.periodic``) takes its
  own parts, copied from memory between two steps;
* :class:`SavedParts`: the state a trainer saved in its home (``<home>/trainer/state.pt``),
  for an export after the training stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from swarmd.errors import ModelMismatch, PartUnverified, StageUnavailable
from swarmd.export.collect import Context, PartReport
from swarmd.export.parts import NamedPart, PartMismatch, trainer_part
from swarmd.state.fetch import ask_digest, fetch_state
from swarmd.state.transfer import StateTransferFailed
from swarmd.state.trainer_state import MAX_PARTS_BYTES, TRAINERS_STAGE

__all__ = ["RemoteTrainers", "OwnParts", "SavedParts"]

log = logging.getLogger("swarmd.export")

ATTEMPTS = 3
DIGEST_TIMEOUT_S = 10.0
#: how long an export waits for a trainer to show up in its view
TRAINER_WAIT_S = 10.0


class RemoteTrainers:
    """The parts of a trainer in the view (``trainers()``: {peer: addrs})."""

    def __init__(self, trainers: Callable[[], Mapping[str, tuple[str, ...]]], *,
                 wait_s: float = TRAINER_WAIT_S, poll_s: float = 0.25,
                 fallback: SavedParts | None = None) -> None:
        self.trainers = trainers
        self.wait_s = wait_s
        self.poll_s = poll_s
        #: where the parts come from when no trainer trains now (a trainer's home)
        self.fallback = fallback

    async def take(self, ctx: Context, cut_step: int | None) -> tuple[NamedPart, PartReport]:
        try:
            found = await self._wait_for_trainers()
        except StageUnavailable:
            if self.fallback is None:
                raise
            log.info("no trainer trains now: the parts saved in %s", self.fallback.home)
            return await self.fallback.take(ctx, cut_step)
        faults: dict[str, str] = {}
        for peer, addrs in found:
            try:
                return await self._take_from(ctx, peer, addrs)
            except (PartMismatch, PartUnverified, StateTransferFailed) as exc:
                log.warning("export: the trainers' parts: leaving %s out: %s", peer, exc)
                faults[peer] = str(exc)
        reasons = "; ".join(f"{p}: {why}" for p, why in faults.items())
        raise PartUnverified(f"the trainers' embedding and head: no trainer gave parts that "
                             f"pass the checks ({reasons})")

    async def _wait_for_trainers(self) -> list[tuple[str, tuple[str, ...]]]:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.wait_s
        while not (found := sorted(self.trainers().items())):
            if loop.time() >= until:
                raise StageUnavailable(
                    f"no trainer is training now to give the embedding and head (waited "
                    f"{self.wait_s:.0f} s): export while a trainer runs, or pass "
                    f"--trainer-home HOME (a trainer's home: its trainer/state.pt)")
            await asyncio.sleep(self.poll_s)
        return found

    async def _take_from(self, ctx: Context, peer: str,
                         addrs: tuple[str, ...]) -> tuple[NamedPart, PartReport]:
        named: NamedPart | None = None
        total = [0]

        def progress(done: int, whole: int) -> None:
            total[0] = whole
            if ctx.progress is not None:
                ctx.progress("trainers", done, whole)

        for _ in range(ATTEMPTS):
            state = await fetch_state(
                ctx.host, ctx.protocol, [(peer, addrs)], stage=TRAINERS_STAGE,
                model_hash=ctx.model_hash, timeout_s=ctx.settings.transfer_timeout_s,
                max_bytes=MAX_PARTS_BYTES, on_progress=progress)
            assert state is not None  # no newer_than: a state or an error
            named = await asyncio.to_thread(trainer_part, ctx.seam, state.params,
                                            dtype=ctx.dtype)
            step = state.meta.get("trainer_step")
            report = PartReport(part="trainers", step=state.step, source=peer, verified=False,
                                bytes=total[0],
                                trainer_step=step if isinstance(step, int) else None)
            heard = await ask_digest(ctx.host, ctx.protocol, peer, addrs, stage=TRAINERS_STAGE,
                                     model_hash=ctx.model_hash, timeout_s=DIGEST_TIMEOUT_S,
                                     counters={})
            if heard is None or heard.step != state.step:
                continue  # it stepped on (or does not say): the parts again
            if heard.digest != named.digest:
                raise PartUnverified(f"sent parts of round {state.step} whose round digest "
                                     f"{named.digest} is not {heard.digest}, the one it "
                                     f"reports for that round")
            return named, _replace(report, verified=True)
        assert named is not None
        log.warning("export: the trainer %s kept stepping: its parts are taken as downloaded "
                    "(the transfer's checks passed, the round digest not compared)", peer)
        return named, report


class OwnParts:
    """A trainer's own parts, copied between two of its steps (:meth:`copy_of`)."""

    def __init__(self, params: Mapping[str, torch.Tensor], step: int) -> None:
        self.params = params
        self.step = step

    @classmethod
    async def copy_of(cls, trainer: Any) -> OwnParts:
        """The parts of ``trainer`` (a ``swarmd.trainer.trainer.Trainer``) now, on the CPU,
        copied in its compute thread (nothing steps them meanwhile)."""
        def own() -> tuple[dict[str, torch.Tensor], int]:
            return ({k: v.detach().to("cpu", copy=True)
                     for k, v in trainer.parts.state_dict().items()}, trainer.step)

        return cls(*await trainer._run(own))

    async def take(self, ctx: Context, cut_step: int | None) -> tuple[NamedPart, PartReport]:
        named = await asyncio.to_thread(trainer_part, ctx.seam, self.params, dtype=ctx.dtype)
        return named, PartReport(part="trainers", step=self.step, source="this trainer",
                                 verified=True, trainer_step=self.step)


class SavedParts:
    """The parts a trainer saved in ``home`` (``swarmd.state.trainer_state``)."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)

    async def take(self, ctx: Context, cut_step: int | None) -> tuple[NamedPart, PartReport]:
        from swarmd.state import trainer_state

        state = await asyncio.to_thread(trainer_state.load, self.home)
        path = trainer_state.state_path(self.home)
        if state is None:
            raise StageUnavailable(f"--trainer-home {self.home}: no trainer state there "
                                   f"({path} is missing); point it at the home a trainer ran "
                                   f"with")
        if state.model_hash != ctx.model_hash:
            raise ModelMismatch(f"{path} is of model {state.model_hash}, the swarm trains "
                                f"{ctx.model_hash}: point --trainer-home at this swarm's "
                                f"trainer")
        try:
            named = await asyncio.to_thread(trainer_part, ctx.seam, state.params,
                                            dtype=ctx.dtype)
        except PartMismatch as exc:
            raise ModelMismatch(f"{path}: {exc}") from None
        return named, PartReport(part="trainers", step=state.step, source=str(path),
                                 verified=False, trainer_step=state.step)


def _replace(report: PartReport, **changes: Any) -> PartReport:
    from dataclasses import replace

    return replace(report, **changes)
