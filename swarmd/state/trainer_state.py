"""A trainer's state in its home: ``<home>/trainer/state.pt``, written atomically.

One file holds everything a restarted trainer needs to go on where it stopped: the step, the
trainer's parameters (embedding and head), its optimizer (with float32 master weights and the
loss scale under mixed precision) and where its data stood. Written to a temporary file in the
same directory, flushed to disk and renamed over the old one, so a trainer killed at any moment
leaves either the previous state or the new one, never half of one. Read back with
``torch.load(weights_only=True)``: tensors and plain values only, nothing executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarmd.errors import DataError, ModelMismatch

__all__ = ["TrainerState", "state_path", "capture", "restore", "save", "load", "FORMAT",
           "params_digest", "TRAINERS_STAGE", "MAX_PARTS_BYTES"]

#: the stage number the trainers' rounds and state transfers use (a stage no model has): the
#: trainers share one embedding and head as a stage of their own (``swarmd.trainer.trainer_sync``)
TRAINERS_STAGE = (1 << 16) - 1
#: the most a download of the trainers' parts may bring
MAX_PARTS_BYTES = 16 << 30

#: bump when the file's layout changes
FORMAT = 1
STATE_DIR = "trainer"
STATE_FILE = "state.pt"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerState:
    step: int
    model_hash: str
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    #: float32 master weights as states before they were part of ``optimizer`` kept them
    masters: list[torch.Tensor] | None = None
    scaler: dict[str, float] | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "model_hash": self.model_hash,
                "params": self.params, "optimizer": self.optimizer, "masters": self.masters,
                "scaler": self.scaler, "data": self.data}


def state_path(home: Path) -> Path:
    return Path(home) / STATE_DIR / STATE_FILE


def capture(trainer: Any, data: dict[str, Any]) -> TrainerState:
    """The state of ``trainer`` (a ``swarmd.trainer.trainer.Trainer``) between two steps,
    copied to the CPU; ``data`` is the batches' ``state()``."""
    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    return TrainerState(
        step=trainer.step, model_hash=trainer.model_hash,
        params={k: cpu(v) for k, v in trainer.parts.state_dict().items()},
        optimizer=_tree(trainer.optimizer.state_dict(), cpu),  # float32 masters included
        scaler=trainer.scaler.state_dict() if trainer.scaler is not None else None, data=data)


def restore(trainer: Any, state: TrainerState) -> None:
    """Load ``state`` into ``trainer``; :class:`ModelMismatch` when it is another model's."""
    if state.model_hash != trainer.model_hash:
        raise ModelMismatch(f"the trainer state in the home is of model {state.model_hash}, "
                            f"this configuration trains {trainer.model_hash}; move "
                            f"<home>/{STATE_DIR} away to start over")
    try:
        trainer.parts.load_state_dict(state.params, strict=True)
        trainer.optimizer.load_state_dict(state.optimizer)
        if state.masters is not None:  # a state saved before the optimizer's held them
            trainer.optimizer.load_masters(state.masters)
        if trainer.scaler is not None and state.scaler is not None:
            trainer.scaler.load_state_dict(state.scaler)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ModelMismatch(f"the trainer state in the home does not fit this model ({exc}); "
                            f"move <home>/{STATE_DIR} away to start over") from None
    trainer.step = state.step


def save(home: Path, state: TrainerState) -> Path:
    """Write ``state`` atomically to ``<home>/trainer/state.pt``."""
    from swarmd.files import write_atomic

    return write_atomic(state_path(home), lambda f: torch.save(state.to_dict(), f))


def load(home: Path) -> TrainerState | None:
    """The state saved in ``home``; None when there is none. A damaged file is a
    :class:`DataError` saying what to do."""
    path = state_path(home)
    if not path.exists():
        return None
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a format {FORMAT} trainer state")
        step = raw["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"bad step {step!r}")
        return TrainerState(step=step, model_hash=str(raw["model_hash"]),
                            params=dict(raw["params"]), optimizer=dict(raw["optimizer"]),
                            masters=raw.get("masters"), scaler=raw.get("scaler"),
                            data=dict(raw.get("data") or {}))
    except Exception as exc:  # any damage: one message saying what to do
        raise DataError(f"{path}: unreadable trainer state ({exc}); move it away to start "
                        f"over") from None


def params_digest(params: dict[str, torch.Tensor]) -> str:
    """blake2b-128 over the names and bytes of ``params`` (a state dict), in name order."""
    import hashlib

    from swarmd.models.gpt import tensor_bytes

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(params):
        h.update(name.encode())
        h.update(tensor_bytes(params[name]))
    return h.hexdigest()


def _tree(value: Any, leaf: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return leaf(value)
    if isinstance(value, dict):
        return {k: _tree(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree(v, leaf) for v in value)
    return value
