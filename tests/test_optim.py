"""LAMB: a trust-ratio-scaled Adam step; both optimizers train a tiny regression."""

from __future__ import annotations

import pytest
import torch

from swarmd.training.optim import Lamb, make_optimizer


def test_lamb_step_size_follows_the_trust_ratio() -> None:
    w = torch.nn.Parameter(torch.full((4,), 2.0))
    opt = Lamb([w], lr=0.1, weight_decay=0.0)
    w.grad = torch.ones(4)
    opt.step()
    # first Adam update is sign(g) = 1 per entry: ||u|| = 2, ||w|| = 4, trust 2, step lr*2*1
    assert torch.allclose(w.detach(), torch.full((4,), 2.0 - 0.2), atol=1e-5)


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_optimizers_fit_a_linear_map(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    model = torch.nn.Linear(8, 1)
    opt = make_optimizer(name, model.parameters(), 0.05)
    first = None
    for _ in range(200):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.1 * first


def test_unknown_optimizer() -> None:
    with pytest.raises(ValueError, match="adamw"):
        make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(1))], 0.1)
