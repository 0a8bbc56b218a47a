"""The optimizer of a stage peer and of a trainer, whatever the model's dtype.

:class:`SwarmOptimizer` looks like a ``torch.optim.Optimizer`` to what drives it (the stage's
``Stepper`` calls ``step()``; the state keeper reads ``param_groups``, ``state_dict()`` and
``load_state_dict()``), and adds what ``[training]`` asks for:

* the learning rate of each step from ``lr_at`` (warm-up, then constant or cosine); the count
  of steps taken travels in ``param_groups[0]["updates"]``, so a state handed to a joiner or
  loaded from a checkpoint resumes the schedule where it was;
* global-norm clipping (``training.grad_clip``) and weight decay (``training.weight_decay``);
* for ``model.dtype`` bfloat16/float16: float32 master weights (``MasterWeights``), the
  module's own parameters rounded from them after each step;
* loss scaling: gradients are divided by :attr:`scale` (the trainer's loss scale, which
  travels with each backward) before the step; a step whose gradients are not finite is
  skipped (counted in :attr:`skipped`), as is one after :meth:`skip_next`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.training.optim import lr_at, make_optimizer, set_lr
from swarmd.training.precision import MasterWeights, masters_mismatch

__all__ = ["OptimSettings", "SwarmOptimizer"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimSettings:
    """The ``[training]`` keys an optimizer follows."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float | None = None
    grad_clip: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 1

    @classmethod
    def from_config(cls, training: Any) -> OptimSettings:
        return cls(name=training.optimizer, lr=training.lr,
                   weight_decay=training.weight_decay, grad_clip=training.grad_clip,
                   schedule=training.lr_schedule, warmup_steps=training.warmup_steps,
                   decay_steps=training.decay_steps)

    def lr_of(self, step: int) -> float:
        return lr_at(step, self.lr, schedule=self.schedule, warmup_steps=self.warmup_steps,
                     decay_steps=self.decay_steps)


class SwarmOptimizer:
    """An optimizer over ``params`` (see the module's doc)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], settings: OptimSettings, *,
                 dtype: torch.dtype | None = None) -> None:
        """``dtype`` is the module's (None: from the parameters); anything but float32 gets
        float32 master weights."""
        self.settings = settings
        self.params = [p for p in params if p.requires_grad]
        self.master: MasterWeights | None = None
        low = (any(p.dtype != torch.float32 for p in self.params) if dtype is None
               else dtype != torch.float32)
        if low:
            self.master = MasterWeights(self.params, optimizer=settings.name, lr=settings.lr,
                                        weight_decay=settings.weight_decay,
                                        grad_clip=settings.grad_clip)
            self.inner = self.master.inner
        else:
            self.inner = make_optimizer(settings.name, self.params, settings.lr,
                                        weight_decay=settings.weight_decay)
        self.inner.param_groups[0]["updates"] = 0
        #: gradients are divided by this before a step (the trainer's loss scale)
        self.scale = 1.0
        #: steps skipped because gradients overflowed
        self.skipped = 0
        self._skip_next = False
        #: the learning rate of the last step (None before the first)
        self.last_lr: float | None = None
        #: the global norm of the last step's gradients, unscaled and before clipping (None
        #: before the first step, and for a skipped step)
        self.last_grad_norm: float | None = None

    # ---- what torch.optim callers read --------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def updates(self) -> int:
        """Steps taken (skipped ones excluded): the learning-rate schedule's position."""
        return int(self.inner.param_groups[0].get("updates", 0))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state; with master weights, under ``"masters"`` the float32
        masters too (the module's parameters are only their rounding: a peer or checkpoint
        that took the parameters alone would step from other weights than its mates)."""
        state = self.inner.state_dict()
        if self.master is not None:
            state["masters"] = [m.detach() for m in self.master.masters]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state_dict()``'s state. With master weights and no ``"masters"`` in it (a state
        saved before they travelled), the masters are taken from the module's parameters
        (loaded just before, so rounded to the module's dtype); a state of a float32 module
        holds none, and any given are ignored there."""
        masters = state.get("masters")
        if masters is not None and self.master is not None:
            self._check_masters(masters)
        self.inner.load_state_dict({k: v for k, v in state.items() if k != "masters"})
        self.inner.param_groups[0].setdefault("updates", 0)
        if self.master is not None:
            with torch.no_grad():
                for i, (p, m) in enumerate(zip(self.master.params, self.master.masters)):
                    m.copy_(masters[i] if masters is not None else p.detach().to(torch.float32))

    def _check_masters(self, masters: Any) -> None:
        """ValueError unless ``masters`` is one float32 tensor per parameter, of its shape."""
        assert self.master is not None
        reason = masters_mismatch(masters, [tuple(m.shape) for m in self.master.masters])
        if reason is not None:
            raise ValueError(reason)

    def masters_state(self) -> list[torch.Tensor] | None:
        """The float32 masters (None without them): a trainer checkpoint keeps them."""
        return None if self.master is None else [m.detach().clone() for m in self.master.masters]

    def load_masters(self, masters: list[torch.Tensor]) -> None:
        if self.master is None:
            return
        if len(masters) != len(self.master.masters):
            raise ValueError(f"{len(masters)} saved master tensors, this optimizer holds "
                             f"{len(self.master.masters)}")
        with torch.no_grad():
            for p, m, saved in zip(self.master.params, self.master.masters, masters):
                m.copy_(saved)
                p.copy_(m)

    # ---- the step -------------------------------------------------------------------------
    def skip_next(self) -> None:
        """The next step is skipped (a gradient overflowed somewhere along the pipeline)."""
        self._skip_next = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> bool:
        """One step with the gradients the parameters hold; False when it was skipped."""
        lr = self.settings.lr_of(self.updates)
        self.last_lr, self.last_grad_norm = lr, None
        if self._skip_next:
            self._skip_next = False
            self.skipped += 1
            return False
        if self.master is not None:
            self.master.set_lr(lr)
            result = self.master.step(scale=self.scale)
            stepped = result.stepped
            self.last_grad_norm = result.grad_norm if stepped else None
        else:
            stepped = self._step_float32(lr)
        if stepped:
            self.inner.param_groups[0]["updates"] = self.updates + 1
        else:
            self.skipped += 1
        return stepped

    def _step_float32(self, lr: float) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.scale != 1.0:
            for g in grads:
                g.div_(self.scale)
        norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.float()) for g in grads]))) if grads else 0.0
        if not math.isfinite(norm):
            return False
        self.last_grad_norm = norm
        if self.settings.grad_clip and norm > self.settings.grad_clip:
            for g in grads:
                g.mul_(self.settings.grad_clip / (norm + 1e-6))
        set_lr(self.inner, lr)
        self.inner.step()
        return True
