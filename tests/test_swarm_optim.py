"""SwarmOptimizer: the learning-rate schedule, clipping, loss-scale unscaling, skipped steps on
overflow, float32 masters under bfloat16, and a state that resumes the schedule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swarmd.training.optim import lr_at
from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(5, generator=g).to(dtype))]


def _grads(params: list[torch.nn.Parameter], factor: float = 1.0, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * factor).to(p.dtype)


def test_the_learning_rate_follows_warmup_and_cosine_and_resumes_from_a_state() -> None:
    s = OptimSettings(lr=0.01, schedule="cosine", warmup_steps=3, decay_steps=10)
    params = _params()
    opt = SwarmOptimizer(params, s)
    for step in range(5):
        _grads(params, seed=step)
        assert opt.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, 0.01, schedule="cosine",
                                                                warmup_steps=3, decay_steps=10))
    assert opt.updates == 5
    again = SwarmOptimizer(_params(), s)
    again.load_state_dict(opt.state_dict())
    assert again.updates == 5  # the schedule goes on where it was


def test_a_non_finite_gradient_skips_the_step_and_changes_nothing() -> None:
    params = _params()
    opt = SwarmOptimizer(params, OptimSettings(lr=0.1))
    before = [p.detach().clone() for p in params]
    _grads(params)
    params[1].grad[2] = math.inf
    assert not opt.step()
    assert opt.skipped == 1 and opt.updates == 0
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    _grads(params)
    opt.skip_next()  # an overflow seen elsewhere along the pipeline
    assert not opt.step() and opt.skipped == 2
    _grads(params)
    assert opt.step() and opt.updates == 1


def test_clipping_scales_the_global_norm_down_to_grad_clip() -> None:
    params = _params()
    opt = SwarmOptimizer(params, OptimSettings(lr=0.1, grad_clip=0.5))
    _grads(params, factor=100.0)
    opt.step()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in params]))
    assert float(norm) == pytest.approx(0.5, rel=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 16), st.sampled_from(["adamw", "lamb"]))
def test_scaled_gradients_with_their_scale_step_as_unscaled_ones(log_scale: int,
                                                                 name: str) -> None:
    scale = 2.0 ** log_scale
    plain, scaled = _params(), _params()
    a = SwarmOptimizer(plain, OptimSettings(name=name, lr=0.01, grad_clip=1.0))
    b = SwarmOptimizer(scaled, OptimSettings(name=name, lr=0.01, grad_clip=1.0))
    _grads(plain)
    _grads(scaled, factor=scale)
    b.scale = scale
    assert a.step() and b.step()
    for p, q in zip(plain, scaled):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_bfloat16_parameters_step_through_float32_masters() -> None:
    params = _params(torch.bfloat16)
    opt = SwarmOptimizer(params, OptimSettings(lr=1e-4))
    assert opt.master is not None
    for step in range(3):
        _grads(params, seed=step)
        assert opt.step()
    masters = opt.masters_state()
    assert masters is not None and all(m.dtype == torch.float32 for m in masters)
    for p, m in zip(params, masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
    # updates of 1e-4 are below bfloat16's resolution near 1: only the masters keep them
    assert any(not torch.equal(m, p.float()) for p, m in zip(params, masters))
    again = SwarmOptimizer(_params(torch.bfloat16), OptimSettings(lr=1e-4))
    again.load_state_dict(opt.state_dict())
    again.load_masters(masters)
    assert again.updates == 3
    assert all(torch.equal(a, b) for a, b in zip(again.masters_state(), masters))
