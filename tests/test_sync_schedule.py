"""The synchronous schedule keeps a bounded number of microbatches in flight: a stage peer
queues 16 for compute and refuses more with busy (64 sent at once drew 120 refusals a step)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from swarmd.training import run


class _Trainer:
    def __init__(self) -> None:
        self.step = 0
        self.stats = SimpleNamespace(in_flight_target=0)
        self.seen: list[tuple[int, int]] = []

    async def train_step(self, batches: list[Any], concurrency: int) -> float:
        self.seen.append((len(batches), concurrency))
        self.step += 1
        return 1.0


@pytest.mark.parametrize("microbatches,in_flight,expected", [
    (64, 0, run.SYNC_IN_FLIGHT), (4, 0, 4), (64, 48, 48)])
def test_a_sync_step_sends_all_its_microbatches_a_bounded_number_at_a_time(
        microbatches: int, in_flight: int, expected: int) -> None:
    trainer = _Trainer()
    config = SimpleNamespace(training=SimpleNamespace(in_flight=in_flight))
    plan = run._Plan(steps=2, microbatches=microbatches, batch=8, seq=16, metrics_file=None,
                     schedule="sync")
    batches = SimpleNamespace(next=lambda: ("x", "y"))

    async def stepped(step: int, loss: float) -> bool:
        return False

    asyncio.run(run._steps(trainer, batches, config, plan, stepped))
    assert trainer.seen == [(microbatches, expected)] * 2
    assert trainer.stats.in_flight_target == expected
