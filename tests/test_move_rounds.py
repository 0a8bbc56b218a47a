"""A peer moving to another stage lets its old stage's round in progress end first
(``Daemon._out_of_rounds``): a member that left mid-round left its parts to be repaired by its
mates, and one such move (tools/bench_scale.py, 24 daemons) held a mate in that round for over
a minute, then 40 steps behind its stage."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from swarmd.node import daemon as daemon_module
from swarmd.node.daemon import Daemon
from test_round_groups import stage_sync


def _moving(sync: Any) -> tuple[Any, Any]:
    me = SimpleNamespace(balance_counters=Counter(), stage=0)
    server = SimpleNamespace(stage=1, rounds_held=sync.held)
    return me, server


def test_a_move_waits_for_the_round_in_progress_and_joins_no_new_one() -> None:
    sync = stage_sync("b", {"a": True})
    me, server = _moving(sync)
    order: list[str] = []

    async def scenario() -> None:
        ends = asyncio.Event()

        async def round_in_progress() -> None:
            await ends.wait()
            order.append("round ended")

        sync._round = asyncio.ensure_future(round_in_progress())
        async with contextlib.AsyncExitStack() as stack:
            moving = asyncio.ensure_future(Daemon._out_of_rounds(me, server, stack))
            done, _ = await asyncio.wait({moving}, timeout=0.05)
            assert not done  # the round is waited for
            ends.set()
            await moving
            order.append("out of rounds")
            assert sync.busy  # held: a start from the leader now is refused, not joined
            refused = await _start(sync)
            order.append(f"start: {refused}")
        assert not sync.busy
        await sync.close()

    asyncio.run(scenario())
    assert order == ["round ended", "out of rounds", "start: round_refused"]
    assert not me.balance_counters


def test_a_round_that_does_not_end_is_left_after_move_round_wait_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_module, "MOVE_ROUND_WAIT_S", 0.05)
    sync = stage_sync("b", {"a": True})
    me, server = _moving(sync)

    async def scenario() -> None:
        sync._round = asyncio.ensure_future(asyncio.Event().wait())  # stuck
        async with contextlib.AsyncExitStack() as stack:
            await Daemon._out_of_rounds(me, server, stack)
            assert sync._holds == 0  # nothing held: the stage server is closed next
        await sync.close()

    asyncio.run(scenario())
    assert me.balance_counters["migration_cut_round"] == 1


async def _start(sync: Any) -> str:
    from swarmd.averaging.stage_sync import RoundRefused
    from swarmd.errors import BadRoundMessage
    from transport.frames import Message
    meta = {"stage": 1, "step": 0, "round": "1:0:x", "group": ["a", "b"],
            "bandwidths": [None, None]}
    try:
        await sync._serve(Message(kind="start", meta=meta), "a")
    except (BadRoundMessage, RoundRefused) as exc:
        return getattr(exc, "reason", exc.code)
    return "joined"
