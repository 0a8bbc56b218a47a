"""A trainer that exports the model by itself every ``training.export_every`` steps.

A trainer holds only the embedding and head: every stage is fetched from its peers as
``swarmd export`` fetches it (``swarmd.export.run``), the trainer's own parts copied from
memory at the step that triggered the export (``OwnParts``). The export runs beside the
training (the steps go on); the stages are waited for at that step or later for
``PREFER_S`` (when no other trainer trains: only then do stage steps follow this trainer's),
then at any one step, and past ``DEADLINE_S`` each at its own step (the manifest says which).
It is written into ``<home>/exports/step-<N>`` atomically, in ``model.dtype``; the newest
``training.export_keep`` are kept. One export at a time: a step that comes while one is still
under way is skipped. A failed export is logged and training goes on; nothing half-written
is left.

Hooked into ``swarmd.trainer.run`` as one context (:func:`periodic_export`) chained onto the
trainer's ``after_step``; on exit it waits for the export under way (at most ``CLOSE_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from swarmd.errors import SwarmdError
from swarmd.export.collect import CollectSettings
from swarmd.export.run import export_model
from swarmd.export.target import keep_newest
from swarmd.export.trainer_parts import OwnParts
from transport.errors import TransportError

__all__ = ["periodic_export", "PeriodicExport", "EXPORTS_DIR"]

log = logging.getLogger("swarmd.export")

EXPORTS_DIR = "exports"
PREFER_S = 30.0
DEADLINE_S = 120.0
CLOSE_S = 900.0
_NAME = re.compile(r"step-(?P<n>\d+)")


class PeriodicExport:
    """Exports of ``trainer``'s model into ``home/exports`` every ``every`` steps."""

    def __init__(self, config: Any, trainer: Any, membership: Any, home: Path, *,
                 every: int, keep: int, say: Callable[[str], None]) -> None:
        self.config = config
        self.trainer = trainer
        self.membership = membership
        self.dir = Path(home) / EXPORTS_DIR
        self.every = every
        self.keep = keep
        self.say = say
        self.task: asyncio.Task[None] | None = None
        self.done: list[int] = []
        self.failed: list[int] = []

    def stepped(self, step: int) -> None:
        """After the trainer's step ``step``: an export starts if one is due."""
        if step % self.every:
            return
        if self.task is not None and not self.task.done():
            log.warning("export at step %d skipped: the previous one is still under way", step)
            return
        self.task = asyncio.get_running_loop().create_task(self._export(step))

    async def _export(self, step: int) -> None:
        own = await OwnParts.copy_of(self.trainer)  # before the next step changes them
        alone = not self.membership.trainers()
        settings = CollectSettings(deadline_s=DEADLINE_S, prefer_s=PREFER_S,
                                   min_step=own.step if alone else None, mixed=True)
        out = self.dir / f"step-{own.step}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            result = await export_model(self.trainer.host, self.membership, self.config, out,
                                        parts=own, dtype=self.config.model.dtype,
                                        settings=settings, replace=True)
        except (SwarmdError, TransportError, OSError) as exc:
            self.failed.append(own.step)
            log.warning("export at step %d failed: %s", own.step, exc)
            self.say(f"export at step {own.step} failed: {exc}")
            return
        removed = await asyncio.to_thread(keep_newest, self.dir, _NAME, self.keep)
        self.done.append(own.step)
        steps = sorted({p.step for p in result.parts if p.part != "trainers"})
        self.say(f"exported step {own.step} to {out} (stages at step "
                 f"{'/'.join(map(str, steps))}, {result.bytes / 1e6:.1f} MB"
                 + (f", removed {', '.join(p.name for p in removed)}" if removed else "") + ")")

    async def close(self) -> None:
        """Wait for the export under way (at most ``CLOSE_S``; then it is cancelled)."""
        if self.task is not None and not self.task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.task), CLOSE_S)
            except TimeoutError:
                self.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.task


@contextlib.asynccontextmanager
async def periodic_export(config: Any, trainer: Any, membership: Any, home: Path | None,
                          say: Callable[[str], None]) -> AsyncIterator[PeriodicExport | None]:
    """Exports every ``training.export_every`` steps while the block runs (None: off, or no
    home to write them in)."""
    every = config.training.export_every
    if not every:
        yield None
        return
    if home is None:
        say("training.export_every is set but this trainer has no home: no exports")
        yield None
        return
    exporter = PeriodicExport(config, trainer, membership, home, every=every,
                              keep=config.training.export_keep, say=say)
    before = trainer.after_step

    def after_step(samples: int) -> None:
        if before is not None:
            before(samples)
        exporter.stepped(trainer.step)

    trainer.after_step = after_step
    try:
        yield exporter
    finally:
        trainer.after_step = before
        await exporter.close()
