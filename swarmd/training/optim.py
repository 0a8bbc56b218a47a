"""Optimizers of stages and trainers: AdamW (torch's) and LAMB (You et al. 2019, "Large Batch
Optimization for Deep Learning"), selected by ``training.optimizer``.

LAMB is AdamW's update scaled per parameter tensor by the trust ratio ||w|| / ||update||, which
keeps large-batch training stable: the setting SWARM's experiments use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

#: ``training.lr_schedule`` values
LR_SCHEDULES = ("constant", "cosine")
#: the cosine schedule ends at this share of the base learning rate
MIN_LR_RATIO = 0.1


class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0:
            raise ValueError("Lamb needs lr > 0, 0 <= betas < 1 and eps > 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                # the trust ratio stays on the device: no host synchronisation per tensor
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                    torch.ones_like(w_norm))
                p.add_(update.mul_(trust), alpha=-group["lr"])
        return loss


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, *,
                   weight_decay: float | None = None) -> torch.optim.Optimizer:
    """``"adamw"`` or ``"lamb"`` over ``params`` with learning rate ``lr``; ``weight_decay``
    (``training.weight_decay``) when given, else each optimizer's default (0.01)."""
    extra = {} if weight_decay is None else {"weight_decay": weight_decay}
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **extra)
    if name == "lamb":
        return Lamb(params, lr=lr, **extra)
    raise ValueError(f'unknown optimizer "{name}": expected "adamw" or "lamb"')


def lr_at(step: int, lr: float, *, schedule: str = "constant", warmup_steps: int = 0,
          decay_steps: int = 1) -> float:
    """The learning rate of optimizer step ``step`` (from 0): a linear rise over
    ``warmup_steps``, then ``lr`` (constant) or a cosine from ``lr`` down to
    ``MIN_LR_RATIO * lr`` at ``decay_steps``, and flat after."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f'unknown lr_schedule "{schedule}": expected one of {LR_SCHEDULES}')
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    span = max(decay_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (call before each step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
