"""LAMB's trust ratio, computed on the device (no host synchronisation per tensor), is the
layer-wise ratio of the paper: ||w|| / ||update||, 1 where either is 0."""

from __future__ import annotations

import torch

from swarmd.training.optim import Lamb


def _reference_step(w: torch.Tensor, g: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
    beta1, beta2, eps = 0.9, 0.999, 1e-6
    m, v = (1 - beta1) * g, (1 - beta2) * g * g
    update = (m / (1 - beta1)) / ((v / (1 - beta2)).sqrt() + eps) + wd * w
    w_norm, u_norm = float(w.norm()), float(update.norm())
    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    return w - lr * trust * update


def test_one_step_matches_the_layerwise_trust_ratio_and_a_zero_weight_uses_one() -> None:
    torch.manual_seed(0)
    for w0 in (torch.randn(5, 7), torch.zeros(4)):
        p = torch.nn.Parameter(w0.clone())
        p.grad = torch.randn_like(p)
        expected = _reference_step(w0, p.grad, lr=0.01, wd=0.01)
        Lamb([p], lr=0.01, weight_decay=0.01).step()
        assert torch.allclose(p.detach(), expected, rtol=1e-5, atol=1e-7)
