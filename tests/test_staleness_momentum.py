"""Staleness compensation (docs/pipeline.md, "Staleness compensation"): a step's momentum is
lowered by the lateness of the gradients it applies; nothing changes when nothing is late."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from swarmd.pipeline.stepping import Stepper
from swarmd.pipeline.worker import StageWorker
from swarmd.training.staleness import MIN_BETA1, mean_lateness, stale_beta1
from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer

W = 8
finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)


def test_no_lateness_or_no_k_keeps_beta1() -> None:
    assert stale_beta1(0.9, 0.0, k=0.5) == 0.9
    assert stale_beta1(0.9, 3.0, k=0.0) == 0.9
    assert stale_beta1(0.9, -2.0, k=0.5) == 0.9


def test_the_rule_at_known_points() -> None:
    assert math.isclose(stale_beta1(0.9, 1.0, k=1.0), 0.8)  # Mitliagkas et al.'s k = 1
    assert math.isclose(stale_beta1(0.9, 2.0, k=0.5), 0.8)
    assert stale_beta1(0.9, 100.0, k=0.5) == MIN_BETA1


@given(base=st.floats(min_value=0.0, max_value=0.999), late=finite, more=finite,
       k=st.floats(min_value=0.0, max_value=10.0))
def test_beta1_is_bounded_and_falls_with_lateness(base: float, late: float, more: float,
                                                  k: float) -> None:
    b = stale_beta1(base, late, k=k)
    assert min(MIN_BETA1, base) <= b <= base
    assert stale_beta1(base, late + more, k=k) <= b


@given(bad=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_bad_measurement_changes_nothing(bad: float) -> None:
    assert stale_beta1(0.9, bad, k=0.5) == 0.9
    assert stale_beta1(0.9, 2.0, k=bad) == 0.9
    assert mean_lateness(bad, 4) == 0.0


@given(late=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 64)), min_size=1))
def test_mean_lateness_is_the_samples_weighted_mean(late: list[tuple[int, int]]) -> None:
    total = sum(n for _, n in late)
    got = mean_lateness(float(sum(d * n for d, n in late)), total)
    assert min(d for d, _ in late) - 1e-9 <= got <= max(d for d, _ in late) + 1e-9
    assert mean_lateness(5.0, 0) == 0.0


def _stage(seed: int = 0) -> tuple[nn.Module, StageWorker, SwarmOptimizer, Stepper]:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W))
    worker = StageWorker(module, width=W, max_tokens=1000)
    opt = SwarmOptimizer(module.parameters(), OptimSettings(lr=1e-2, stale_momentum=0.5))
    from collections import Counter
    return module, worker, opt, Stepper(module, worker, opt, Counter())


def _fwd_bwd(worker: StageWorker, mb: str, x: torch.Tensor) -> None:
    out = worker.forward(mb, x, now=0.0)
    worker.backward(mb, torch.ones_like(out), now=0.0)


def test_the_worker_counts_each_backwards_lateness_in_samples() -> None:
    _, worker, _, stepper = _stage()
    x = torch.randn(3, 2, W)
    _fwd_bwd(worker, "now", x)
    assert worker.late_samples == 0.0  # no step between forward and backward
    out = worker.forward("late", torch.randn(5, 2, W), now=0.0)
    stepper.step_alone()
    stepper.step_alone()
    worker.backward("late", torch.ones_like(out), now=0.0)
    assert worker.late_samples == 2 * 5 and worker.samples_accumulated == 5
    stepper.step_alone()
    assert worker.late_samples == 0.0 and worker.samples_accumulated == 0


def test_a_synchronous_step_is_plain_adamw() -> None:
    """Nothing late: the step is exactly torch's AdamW with its own betas (exactness holds)."""
    module, worker, _, stepper = _stage(1)
    ref = nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W))
    ref.load_state_dict(module.state_dict())
    adam = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(4, 2, W)
        _fwd_bwd(worker, "mb", x)
        stepper.step_alone()
        (ref(x) * 1.0).sum().div(4).backward()
        adam.step()
        adam.zero_grad()
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_late_step_lowers_beta1_for_that_step_only() -> None:
    torch.manual_seed(2)
    params = [nn.Parameter(torch.randn(5))]
    opt = SwarmOptimizer(params, OptimSettings(lr=1e-2, stale_momentum=0.5))
    ref = [nn.Parameter(params[0].detach().clone())]
    adam = torch.optim.AdamW(ref, lr=1e-2)
    grads = [torch.randn(5) for _ in range(3)]
    for i, (g, late) in enumerate(zip(grads, (0.0, 2.0, 4.0))):
        params[0].grad = g.clone()
        opt.step(lateness=late)
        assert opt.param_groups[0]["betas"][0] == 0.9  # restored: a state handed on has it
        adam.param_groups[0]["betas"] = (stale_beta1(0.9, late, k=0.5), 0.999)
        ref[0].grad = g.clone()
        adam.step()
        assert torch.allclose(params[0], ref[0], atol=1e-7), i
    # and it is not the plain step: the same late gradients move the weights differently
    torch.manual_seed(2)
    plain = [nn.Parameter(torch.randn(5))]
    opt = SwarmOptimizer(plain, OptimSettings(lr=1e-2, stale_momentum=0.5))
    for g in grads:
        plain[0].grad = g.clone()
        opt.step()
    assert not torch.allclose(plain[0], params[0], atol=1e-6)


def test_off_means_the_optimizers_own_betas() -> None:
    torch.manual_seed(3)
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(a.detach().clone())
    off = SwarmOptimizer([a], OptimSettings(lr=1e-2, stale_momentum=0.0))
    adam = torch.optim.AdamW([b], lr=1e-2)
    for _ in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        off.step(lateness=3.0)
        adam.step()
    assert torch.allclose(a, b, atol=1e-7)
