"""Optimizers of stages and trainers: AdamW (torch's) and LAMB (You et al. 2019, "Large Batch
Optimization for Deep Learning"), selected by ``training.optimizer``.

LAMB is AdamW's update scaled per parameter tensor by the trust ratio ||w|| / ||update||, which
keeps large-batch training stable: the setting SWARM's experiments use.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
                w_norm, u_norm = float(p.norm()), float(update.norm())
                trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)
        return loss


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float
                   ) -> torch.optim.Optimizer:
    """``"adamw"`` or ``"lamb"`` over ``params`` with learning rate ``lr``."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "lamb":
        return Lamb(params, lr=lr)
    raise ValueError(f'unknown optimizer "{name}": expected "adamw" or "lamb"')
