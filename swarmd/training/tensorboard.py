"""Training curves as TensorBoard event files: ``training.tensorboard_dir``.

With the directory set (and ``pip install swarmd[tensorboard]``), the trainer writes, per
step, the series of its ``train-metrics.jsonl`` line that :data:`STEP_SERIES` names
(training loss, learning rate, the gradient norm of the trainer's own parameters, tokens/s,
microbatches rerouted, restarted and lost so far), every validation loss (``val/loss``), and
the run's settings as text (``settings``). The gradient norm is the one the trainer's
optimizer measures over the embedding and head before clipping: each stage's parameters are
stepped on its own peers, which do not send theirs, so no whole-model norm exists here.

Writing never stops training: a directory that cannot be written, TensorBoard not installed,
or a write that fails later is said once (a warning) and the run goes on without curves.
Every record is flushed at once, so a run that ends abruptly keeps what it logged.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["STEP_SERIES", "Board", "open_board"]

log = logging.getLogger(__name__)

#: metrics-line key -> TensorBoard tag, for the per-step series
STEP_SERIES: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm_trainer": "train/grad_norm_trainer",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "rerouted": "microbatches/rerouted",
    "restarted": "microbatches/restarted",
    "lost": "microbatches/lost",
}
VAL_TAG = "val/loss"
SETTINGS_TAG = "settings"
INSTALL_HINT = "pip install 'swarmd[tensorboard]'"


class Board:
    """Where the curves go: ``log_step``, ``log_eval``, ``close``. Without a writer (no
    directory, or writing failed) every call does nothing. Also an (async) context manager
    that closes it."""

    def __init__(self, writer: Any = None, directory: str = "") -> None:
        self._writer = writer
        self.directory = directory

    @property
    def writing(self) -> bool:
        return self._writer is not None

    def log_step(self, step: int, values: Mapping[str, Any]) -> None:
        """The :data:`STEP_SERIES` found in ``values`` (a metrics line) at ``step``; a
        missing, None or non-finite value is left out."""
        self._write(lambda w: [w.add_scalar(tag, float(values[key]), step)
                               for key, tag in STEP_SERIES.items()
                               if _finite(values.get(key))])

    def log_eval(self, step: int, loss: float) -> None:
        """A validation loss measured at ``step``."""
        if _finite(loss):
            self._write(lambda w: w.add_scalar(VAL_TAG, float(loss), step))

    def log_settings(self, settings: Mapping[str, Any]) -> None:
        text = json.dumps(settings, indent=2, sort_keys=True, default=str)
        # markdown: four spaces make a code block in TensorBoard's text tab
        self._write(lambda w: w.add_text(SETTINGS_TAG, "\n".join(
            "    " + line for line in text.splitlines()), 0))

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:  # the file system's refusal: said, never raised
                _said_off(self.directory, exc)

    def _write(self, write: Any) -> None:
        if self._writer is None:
            return
        try:
            write(self._writer)
            self._writer.flush()
        except Exception as exc:  # a full disk, a directory removed: said once, then off
            writer, self._writer = self._writer, None
            _said_off(self.directory, exc)
            try:
                writer.close()
            except Exception:
                pass

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Board:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


def open_board(directory: str, settings: Mapping[str, Any] | None = None) -> Board:
    """A :class:`Board` writing event files into ``directory`` (created if missing), with
    ``settings`` logged as text; one that writes nothing when ``directory`` is empty or cannot
    be used (said once)."""
    if not directory:
        return Board()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("training.tensorboard_dir = %r: TensorBoard is not installed, so no "
                    "curves are written; %s, or unset training.tensorboard_dir; training goes "
                    "on", directory, INSTALL_HINT,
                    extra={"event": "tensorboard_off", "reason": "not_installed"})
        return Board()
    try:
        path = Path(directory).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        board = Board(SummaryWriter(log_dir=str(path)), directory)
    except Exception as exc:  # OSError, or what the writer wraps it in
        _said_off(directory, exc)
        return Board()
    if settings is not None:
        board.log_settings(settings)
    return board


def _said_off(directory: str, exc: BaseException) -> None:
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    log.warning("training.tensorboard_dir = %r: cannot write TensorBoard files there (%s); "
                "choose a writable directory; training goes on without TensorBoard",
                directory, reason, extra={"event": "tensorboard_off", "reason": reason})


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)
