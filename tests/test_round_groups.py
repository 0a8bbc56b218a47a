"""What a round's leader counts about its group (issue 28): members, live mates left out.

``sync.group_members`` over ``sync.rounds_led`` is a stage's mean all-reduce group, and
``sync.mates_left_out`` / ``sync.rounds_short`` say whether its rounds include every live mate
(``tools/bench_scale.py`` reports them for a swarm of 24 daemons)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from swarmd.averaging.stage_sync import StageSync
from swarmd.averaging.trigger import RoundTrigger
from transport.errors import DeadlineExceeded
from transport.frames import Message


class Host:
    """Answers ``prepare`` for each mate as ``answers`` says: free, busy, or silent (None)."""

    def __init__(self, me: str, answers: dict[str, bool | None]) -> None:
        self.peer_id = me
        self.answers = answers

    async def ensure_connected(self, peer: str, *a: Any, **k: Any) -> bool:
        return True

    async def ping(self, peer: str, **k: Any) -> float:
        return 0.001

    async def request(self, peer: str, protocol: str, message: Message, **k: Any) -> Message:
        free = self.answers[peer]
        if free is None:
            raise DeadlineExceeded(f"{peer} did not answer")
        if message.kind == "prepare":
            return Message(kind="ok", meta={"step": message.meta["step"], "free": free})
        return Message(kind="ok")

    def set_request_handler(self, *a: Any, **k: Any) -> None:
        pass

    def remove_handler(self, *a: Any) -> None:
        pass


def lead_one_round(answers: dict[str, bool | None],
                   suspected: tuple[str, ...] = ()) -> dict[str, int]:
    """Leader "a" (the smallest id) with mates ``answers``' keys, at its target: one round.
    ``suspected``: mates that failed it a moment ago. Its group counters."""
    sync = led_round(answers, suspected)
    return {k: v for k, v in sync.counters.items() if k in (
        "rounds_led", "group_members", "mates_left_out", "rounds_short") or k.startswith(
        "left_out.")}


def led_round(answers: dict[str, bool | None], suspected: tuple[str, ...] = ()) -> StageSync:
    """The leader of ``lead_one_round``, after its round."""
    async def snapshot() -> tuple[torch.Tensor, int]:
        return torch.zeros(4), 1

    async def nothing(*a: Any) -> None:
        pass

    sync = StageSync(Host("a", answers), swarm="t", stage=1,
                     trigger=RoundTrigger(me="a", target=1), averager=None,
                     mates=lambda: {p: () for p in answers}, snapshot=snapshot, apply=nothing,
                     give_back=nothing, on_behind=lambda p, s: None, samples_now=lambda: 0)

    for p in suspected:
        sync.trigger.suspect(p, time.monotonic())

    async def scenario() -> None:
        sync.progressed(1)
        for _ in range(100):
            await asyncio.sleep(0)
        await sync.close()

    asyncio.run(scenario())
    return sync


def test_a_round_with_every_live_mate_counts_its_whole_group_and_leaves_none_out() -> None:
    assert lead_one_round({"b": True, "c": True, "d": True}) == {
        "rounds_led": 1, "group_members": 4, "mates_left_out": 0, "rounds_short": 0}


def test_busy_silent_or_suspected_live_mates_are_counted_as_left_out_and_why() -> None:
    assert lead_one_round({"b": True, "c": False, "d": None, "e": True}, suspected=("e",)) == {
        "rounds_led": 1, "group_members": 2, "mates_left_out": 3, "rounds_short": 1,
        "left_out.busy": 1, "left_out.silent": 1, "left_out.suspected": 1}


def test_the_mates_answer_times_are_kept_by_kind_and_a_silent_mate_is_not_one() -> None:
    """``round_ask_seconds.<kind>`` (``/metrics``): what a shorter wait than ``ASK_TIMEOUT_S``
    for a mate's answer would be chosen from."""
    sync = led_round({"b": True, "c": False, "d": None})
    seen = sync.histograms.snapshot()
    assert seen["round_ask_seconds.prepare"].count == 2  # b and c answered; d did not
    assert seen["round_ask_seconds.start"].count == 1    # the round's start, to b
