"""Mixed precision: low-precision compute with float32 master weights, and loss scaling.

``model.dtype = "bfloat16"``: the module computes in bfloat16; :class:`MasterWeights` keeps a
float32 copy of every parameter and the optimizer's state over those copies, so small updates
are not rounded away. ``"float16"``: the same, with a :class:`LossScaler`: the loss is
multiplied by ``scale`` before backward so small gradients do not underflow to 0, gradients are
divided by it before the step, and a step whose gradients overflowed (Inf/NaN) is skipped and
the scale halved; after ``growth_interval`` good steps it doubles.

In a swarm the scale is the trainer's: the backward of a microbatch carries it, and every stage
unscales its gradients with it (``MasterWeights.step(scale=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.training.optim import make_optimizer, set_lr

__all__ = ["LossScaler", "MasterWeights", "StepResult", "masters_mismatch"]


class LossScaler:
    """Dynamic loss scale (pure: no tensors): ``update(found_inf)`` after each step."""

    def __init__(self, init_scale: float = 2.0 ** 16, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval >= 1 and 0 < min_scale <= init_scale <= max_scale):
            raise ValueError("LossScaler needs init_scale in [min_scale, max_scale], "
                             "growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale, self.max_scale = growth_interval, min_scale, max_scale
        self.good_steps = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float]) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and self.min_scale <= scale <= self.max_scale):
            raise ValueError(f"loss scale {scale} out of range")
        self.scale, self.good_steps = scale, int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What one :meth:`MasterWeights.step` did: ``stepped`` False when gradients overflowed."""

    stepped: bool
    grad_norm: float


def masters_mismatch(masters: Any, shapes: Sequence[tuple[int, ...]]) -> str | None:
    """Why ``masters`` (from a saved or downloaded state) are not one float32 tensor per
    parameter of ``shapes``, in order; None when they are."""
    if not isinstance(masters, (list, tuple)) or len(masters) != len(shapes):
        held = len(masters) if isinstance(masters, (list, tuple)) else "no list of"
        return f"the state holds {held} master tensors, this optimizer {len(shapes)}"
    for i, (m, shape) in enumerate(zip(masters, shapes)):
        if not isinstance(m, torch.Tensor) or m.dtype != torch.float32 \
                or tuple(m.shape) != tuple(shape):
            got = f"{m.dtype} {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
            return f"master tensor {i} is {got} in the state, float32 {tuple(shape)} here"
    return None


class MasterWeights:
    """An optimizer over float32 master copies of (possibly low-precision) ``params``.

    ``step`` takes the gradients the module accumulated (scaled by ``scale``), unscales them
    into the masters in float32, skips the step when any is Inf/NaN, clips the global norm to
    ``grad_clip`` (0: off), steps the inner optimizer and writes the masters back into the
    module's parameters in their own dtype.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, optimizer: str = "adamw",
                 lr: float = 1e-3, weight_decay: float | None = None,
                 grad_clip: float = 0.0) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().to(torch.float32).clone())
                        for p in self.params]
        self.inner = make_optimizer(optimizer, self.masters, lr, weight_decay=weight_decay)
        self.grad_clip = grad_clip

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def set_lr(self, lr: float) -> None:
        set_lr(self.inner, lr)

    @torch.no_grad()
    def step(self, *, scale: float = 1.0) -> StepResult:
        finite = True
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32) / scale
            if m.grad is not None and not bool(torch.isfinite(m.grad).all()):
                finite = False
        grads = [m.grad for m in self.masters if m.grad is not None]
        if not finite:
            for m in self.masters:
                m.grad = None
            return StepResult(stepped=False, grad_norm=math.inf)
        norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if self.grad_clip and norm > self.grad_clip:
            for g in grads:
                g.mul_(self.grad_clip / (norm + 1e-6))
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)  # rounded to the module's dtype
        return StepResult(stepped=True, grad_norm=norm)

    def state_dict(self) -> dict[str, object]:
        return {"masters": [m.detach().clone() for m in self.masters],
                "optimizer": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        masters = state["masters"]
        if not isinstance(masters, list) or len(masters) != len(self.masters):
            held = len(masters) if isinstance(masters, list) else "no"
            raise ValueError(f"the saved state holds {held} master tensors, this optimizer "
                             f"{len(self.masters)}")
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, masters):
                m.copy_(saved)
                p.copy_(m)
        self.inner.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
