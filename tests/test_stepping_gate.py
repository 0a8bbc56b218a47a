"""The gate a step closes: a new forward waits for it only briefly (then is refused with busy),
so a step that waits out a lost microbatch does not make new ones miss their deadlines."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from swarmd.pipeline import stepping
from swarmd.pipeline.stepping import Gate


class _Worker:
    def __init__(self) -> None:
        self.held = {"lost"}  # a microbatch whose backward never comes

    @property
    def saved(self) -> int:
        return len(self.held)

    def expire(self, now: float) -> list[str]:
        gone, self.held = list(self.held), set()
        return gone


class _Compute:
    async def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def test_a_forward_at_a_closed_gate_gives_up_after_its_wait_and_a_step_drops_the_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stepping, "DRAIN_S", 0.5)
    counters: Counter[str] = Counter()
    gate = Gate(_Worker(), _Compute(), counters, stage=0)  # type: ignore[arg-type]

    async def scenario() -> list[Any]:
        step = asyncio.ensure_future(gate.when_drained(lambda: "stepped"))
        await asyncio.sleep(0)
        waited = await gate.wait_open(0.05)   # the step still waits for the lost one
        stepped = await step
        return [waited, stepped, await gate.wait_open(0.05)]

    assert asyncio.run(scenario()) == [False, "stepped", True]
    assert counters["dropped_for_step"] == 1
