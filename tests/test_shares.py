"""How trainers split a step's microbatches (``swarmd.trainer.shares``), and a trainer's
flush of the stages after a step that was not exact (its wire message)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from swarmd.errors import BadActivation
from swarmd.pipeline.messages import Flush, parse_flush, parse_flushed
from swarmd.trainer.shares import share_of
from transport.frames import Message


@settings(max_examples=200, deadline=None)
@given(st.sets(st.text("abcdef", min_size=1, max_size=4), min_size=1, max_size=12),
       st.integers(1, 80))
def test_the_trainers_shares_make_up_the_step_when_they_see_the_same_trainers(
        trainers: set[str], microbatches: int) -> None:
    shares = {t: share_of(t, trainers - {t}, microbatches) for t in trainers}
    assert all(s >= 1 for s in shares.values())
    assert max(shares.values()) - min(shares.values()) <= 1
    if len(trainers) <= microbatches:  # each gets one at least: more trainers overshoot
        assert sum(shares.values()) == microbatches
    # a trainer listed among the others as well counts once
    t = min(trainers)
    assert share_of(t, trainers, microbatches) == shares[t]


def test_a_step_has_a_microbatch() -> None:
    with pytest.raises(ValueError):
        share_of("a", [], 0)


def test_a_flush_names_a_stage_of_the_model_and_a_step() -> None:
    flush = Flush(stage=1, step=7)
    assert parse_flush(Message(**flush.wire()), num_stages=2) == flush
    assert parse_flushed(Message(kind="ok", meta={"stage_step": 4})) == 4
    for meta in ({"stage": 2, "step": 7}, {"stage": -1, "step": 7}, {"stage": 1},
                 {"stage": 1, "step": "7"}, {"stage": True, "step": 7}, {"stage": 1.0, "step": 7}):
        with pytest.raises(BadActivation):
            parse_flush(Message(kind="flush", meta=meta), num_stages=2)
    with pytest.raises(BadActivation):
        parse_flush(Message(kind="forward", meta={"stage": 1, "step": 7}), num_stages=2)
    for reply in (Message(kind="ok", meta={}), Message(kind="error", meta={"stage_step": 1}),
                  Message(kind="ok", meta={"stage_step": -1})):
        with pytest.raises(BadActivation):
            parse_flushed(reply)


def test_a_flush_whose_rounds_do_not_end_is_answered_busy_not_left_to_fail(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage whose rounds run one after the other past ``FLUSH_WAIT_S``: the flush gets a
    typed ``busy`` and a counter (it raised a bare TimeoutError out of the handler, logged as
    an error on every try: 23 times in one 24-daemon run)."""
    import asyncio
    from collections import Counter
    from types import SimpleNamespace

    from swarmd.errors import StageBusy
    from swarmd.pipeline import server as server_module

    monkeypatch.setattr(server_module, "FLUSH_WAIT_S", 0.05)

    async def rounds_forever(trainer: str, before: int) -> int:
        await asyncio.Event().wait()
        return 0

    stage = SimpleNamespace(num_stages=2, stage=1, counters=Counter(),
                            sync=SimpleNamespace(flush=rounds_forever))
    message = Message(**Flush(stage=1, step=7).wire())
    with pytest.raises(StageBusy, match="did not end"):
        asyncio.run(server_module.StageServer.on_flush(stage, message, "trainer"))
    assert stage.counters["flush_timeouts"] == 1
