"""The synchronous schedule keeps a bounded number of microbatches in flight: a stage peer
queues 16 for compute and refuses more with busy (64 sent at once drew 120 refusals a step)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from swarmd.trainer import run


class _Trainer:
    def __init__(self) -> None:
        self.step = 0
        self.exact = False
        self.calls: list[dict[str, Any]] = []

    async def train(self, next_batch: Any, **kw: Any) -> None:
        self.calls.append(kw)


@pytest.mark.parametrize("schedule,microbatches,in_flight,floor,ceiling,barrier", [
    ("sync", 64, 0, run.SYNC_IN_FLIGHT, run.MAX_IN_FLIGHT, True),
    ("sync", 4, 0, 4, 4, True),
    ("sync", 64, 48, run.SYNC_IN_FLIGHT, 48, True),
    ("sync", 64, 4, 4, 4, True),
    ("pipelined", 4, 0, 4, run.MAX_IN_FLIGHT, False)])
def test_a_sync_step_sends_its_microbatches_a_bounded_number_at_a_time_and_no_more(
        schedule: str, microbatches: int, in_flight: int, floor: int, ceiling: int,
        barrier: bool) -> None:
    """The synchronous schedule starts a step with a few microbatches in flight, grows to
    what the round trip calls for, never past a step's microbatches (a barrier at every
    step: exact steps) nor ``training.in_flight``; the pipelined one keeps at least a
    step's worth and crosses steps."""
    trainer = _Trainer()
    config = SimpleNamespace(training=SimpleNamespace(in_flight=in_flight))
    plan = run._Plan(steps=2, microbatches=microbatches, batch=8, seq=16, metrics_file=None,
                     schedule=schedule)
    batches = SimpleNamespace(next=lambda: ("x", "y"))

    async def stepped(step: int, loss: float) -> bool:
        return False

    asyncio.run(run._steps(trainer, batches, config, plan, stepped))
    (call,) = trainer.calls
    window = call["window"]
    assert (window.floor, window.ceiling, call["barrier"]) == (floor, ceiling, barrier)
    assert trainer.exact is barrier and call["steps"] == 2
