"""The trainers' progress a stage peer heard, per trainer, bounded. Pure: time is passed in.

A trainer tells the stage peers it talks to how its run goes (``messages.TrainerProgress``:
in its ``ok`` to each ``result`` and ``grad``, and in its answer to each ``step_report``).
:class:`TrainerBook` keeps, per trainer peer id, the latest progress and two curves: the
mean loss of each step heard and each validation loss. Many replies tell the same step; a
point is added only when the step (or the validation's step) is new. A trainer whose step
goes back (it restarted from an older state, or with a fresh one) starts its curves again.

Bounds: at most :data:`MAX_POINTS` points a curve (when full, every other point is dropped,
so a curve spans the whole run, recent steps finest) and :data:`MAX_TRAINERS` trainers (the
one heard from longest ago gives way). What the daemon shows: ``swarmd status`` (one line a
trainer) and the status page (the curves), ``swarmd.api.types.trainer_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.pipeline.messages import TrainerProgress

__all__ = ["TrainerBook", "TrainerSeries", "MAX_POINTS", "MAX_TRAINERS"]

#: points in one curve (training or validation loss) of one trainer
MAX_POINTS = 500
#: trainers remembered
MAX_TRAINERS = 64

Point = tuple[int, float]


@dataclass(slots=True)
class TrainerSeries:
    """One trainer: its latest progress, when it was heard (the caller's clock), its curves."""

    peer_id: str
    latest: TrainerProgress
    heard_at: float
    #: (step, mean loss of that step), oldest first
    losses: list[Point] = field(default_factory=list)
    #: (step, validation loss), oldest first
    val_losses: list[Point] = field(default_factory=list)


def _add(points: list[Point], point: Point) -> None:
    points.append(point)
    if len(points) > MAX_POINTS:
        del points[-2::-2]  # every other one, the newest kept


class TrainerBook:
    """Per trainer peer id, its latest progress and its loss curves (module doc)."""

    def __init__(self) -> None:
        self._series: dict[str, TrainerSeries] = {}

    def heard(self, peer_id: str, progress: TrainerProgress, now: float) -> None:
        """``peer_id`` told ``progress`` at ``now``."""
        series = self._series.get(peer_id)
        if series is None or progress.step < series.latest.step:
            if series is None and len(self._series) >= MAX_TRAINERS:
                oldest = min(self._series.values(), key=lambda s: s.heard_at)
                del self._series[oldest.peer_id]
            series = self._series[peer_id] = TrainerSeries(peer_id, progress, now)
        last = series.losses[-1][0] if series.losses else -1
        if progress.loss is not None and progress.step > last:
            _add(series.losses, (progress.step, progress.loss))
        last_val = series.val_losses[-1][0] if series.val_losses else -1
        if progress.val_loss is not None and progress.val_step is not None and \
                progress.val_step > last_val:
            _add(series.val_losses, (progress.val_step, progress.val_loss))
        series.latest, series.heard_at = progress, now

    def series(self) -> list[TrainerSeries]:
        """Every trainer, the one heard from most recently first."""
        return sorted(self._series.values(), key=lambda s: -s.heard_at)

    def __len__(self) -> int:
        return len(self._series)
