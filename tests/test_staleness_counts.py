"""A stage counts how late the gradients it steps with are (in optimizer steps, forward to
backward): ``late_samples`` / ``stepped_samples``, what tools/bench_schedules.py reports."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from swarmd.pipeline.stepping import Stepper
from swarmd.pipeline.worker import StageWorker
from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer

W = 8


def _stage() -> tuple[StageWorker, Stepper, Counter[str]]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W))
    worker = StageWorker(module, width=W, max_tokens=1000)
    counters: Counter[str] = Counter()
    opt = SwarmOptimizer(module.parameters(), OptimSettings(lr=1e-2))
    return worker, Stepper(module, worker, opt, counters), counters


def test_a_backward_after_two_steps_counts_two_steps_late_per_sample() -> None:
    worker, stepper, counters = _stage()
    out = worker.forward("now", torch.randn(3, 2, W), now=0.0)
    worker.backward("now", torch.ones_like(out), now=0.0)
    assert worker.late_samples == 0.0  # no step between its forward and its backward
    late = worker.forward("late", torch.randn(5, 2, W), now=0.0)
    stepper.step_alone()
    stepper.step_alone()
    worker.backward("late", torch.ones_like(late), now=0.0)
    assert worker.late_samples == 2 * 5 and worker.samples_accumulated == 5
    stepper.step_alone()
    assert worker.late_samples == 0.0 and worker.samples_accumulated == 0
    assert counters["late_samples"] == 10 and counters["stepped_samples"] == 3 + 5


@settings(max_examples=25, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=6))
def test_the_mean_is_the_samples_weighted_steps_late(plan: list[tuple[int, int]]) -> None:
    """Each microbatch (rows, steps between its forward and backward): the counters' ratio is
    the samples-weighted mean of the steps late, whatever the order."""
    worker, stepper, counters = _stage()
    for i, (rows, steps) in enumerate(plan):
        out = worker.forward(f"mb{i}", torch.randn(rows, 2, W), now=0.0)
        for _ in range(steps):
            stepper.step_alone()
        worker.backward(f"mb{i}", torch.ones_like(out), now=0.0)
    stepper.step_alone()
    total = sum(r for r, _ in plan)
    assert counters["stepped_samples"] == total
    assert counters["late_samples"] == sum(r * s for r, s in plan)


def test_a_backward_after_a_rounds_snapshot_counts_late_though_no_step_came_between() -> None:
    """A round takes its snapshot, then a backward lands, then the round applies its step:
    that gradient counts toward the step after, so it is applied one step after the weights
    its forward ran on: one step late, with no step between its forward and its backward."""
    worker, stepper, counters = _stage()
    out = worker.forward("crossing", torch.randn(4, 2, W), now=0.0)
    vector, samples = stepper.take_gradient()        # the round's snapshot: nothing yet
    worker.backward("crossing", torch.ones_like(out), now=0.0)
    stepper.apply_gradient(vector)                   # the round's step
    assert worker.late_samples == 4
    stepper.take_gradient()
    assert counters["late_samples"] == 4 and counters["stepped_samples"] == 4
