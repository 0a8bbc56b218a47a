"""A trainer's progress as the stage peers hear it: the message (``TrainerProgress``, read by
``parse_progress`` from any ``ok`` reply), the bounded book each stage keeps per trainer
(``swarmd.pipeline.progress``), and the rows the API and ``swarmd status`` show. Pure: no loop."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.api.types import TrainerRow, TrainingInfo, to_json, trainer_rows
from swarmd.cli.client import trainer_line
from swarmd.errors import BadActivation
from swarmd.pipeline.messages import (StepAnswer, TrainerProgress, parse_progress,
                                      parse_step_answer, progress_meta)
from swarmd.pipeline.progress import MAX_POINTS, MAX_TRAINERS, TrainerBook
from transport.frames import Message

T = "12D3KooWtrainer"


def reply(progress: Any) -> Message:
    return Message(kind="ok", meta={"progress": progress})


# ---- the message ----------------------------------------------------------------------------
def test_progress_rides_on_a_step_answer_and_an_arrival_s_ok() -> None:
    p = TrainerProgress(step=7, loss=2.5, val_loss=2.75, val_step=5, shard="1/3", epoch=2)
    answer = Message(**StepAnswer(coefficient=0.5, progress=p).wire())
    assert parse_progress(answer) == p
    assert parse_step_answer(answer).coefficient == 0.5  # the coefficient is read as before
    assert parse_progress(Message(kind="ok", meta=progress_meta(p))) == p
    # only what is known goes on the wire
    assert TrainerProgress(step=0).wire() == {"step": 0}


def test_an_older_trainer_s_reply_tells_no_progress() -> None:
    assert parse_progress(Message(kind="ok")) is None
    assert parse_progress(Message(kind="ok", meta={"coefficient": None})) is None
    assert parse_progress(Message(kind="ok", meta={"late": True})) is None
    assert parse_progress(Message(kind="ok", meta={"progress": None})) is None


@pytest.mark.parametrize("body", [
    "not a map", [1, 2], {}, {"step": -1}, {"step": "3"}, {"step": True}, {"step": 2**63},
    {"step": 1, "loss": math.nan}, {"step": 1, "loss": math.inf}, {"step": 1, "loss": 1e300},
    {"step": 1, "loss": "2.5"}, {"step": 1, "loss": True},
    {"step": 1, "val_loss": 2.0}, {"step": 1, "val_step": 1},
    {"step": 1, "val_loss": -math.inf, "val_step": 1}, {"step": 1, "val_loss": 2.0, "val_step": -1},
    {"step": 1, "shard": "2/2"}, {"step": 1, "shard": "1"}, {"step": 1, "shard": "a/b"},
    {"step": 1, "shard": "-1/2"}, {"step": 1, "shard": "1/2/3"}, {"step": 1, "shard": 3},
    {"step": 1, "shard": "0/" + "9" * 5000}, {"step": 1, "shard": "０/２"},
    {"step": 1, "epoch": -1}, {"step": 1, "epoch": 1.5},
])
def test_malformed_progress_is_refused_with_a_typed_error(body: Any) -> None:
    with pytest.raises(BadActivation):
        parse_progress(reply(body))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["step", "loss", "val_loss", "val_step", "shard",
                                        "epoch", "other"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                                 st.text(max_size=30), st.lists(st.integers(), max_size=3))))
def test_any_progress_gives_a_value_or_a_typed_error(body: dict[str, Any]) -> None:
    try:
        progress = parse_progress(reply(body))
    except BadActivation:
        return
    assert progress is not None
    assert parse_progress(reply(progress.wire())) == progress  # a value that round-trips


def test_a_progress_is_checked_when_built() -> None:
    for bad in ({"step": -1}, {"step": 1, "loss": math.nan},
                {"step": 1, "val_loss": 1.0}, {"step": 1, "shard": "3/2"}):
        with pytest.raises(ValueError):
            TrainerProgress(**bad)


# ---- the book ---------------------------------------------------------------------------------
def told(step: int, loss: float | None = None, val: tuple[int, float] | None = None,
         shard: str = "0/1") -> TrainerProgress:
    return TrainerProgress(step=step, loss=loss, val_loss=val[1] if val else None,
                           val_step=val[0] if val else None, shard=shard, epoch=0)


def test_a_point_per_step_however_many_replies_tell_it() -> None:
    book = TrainerBook()
    book.heard(T, told(0, val=(0, 6.0)), now=1.0)  # the initial validation
    for step in range(1, 4):
        for _ in range(5):  # every microbatch's ok and every stage's answer tell it
            book.heard(T, told(step, 6.0 - step, val=(0, 6.0)), now=1.0 + step)
    book.heard(T, told(3, 3.0, val=(3, 3.5)), now=5.0)  # an evaluation after step 3
    (series,) = book.series()
    assert series.losses == [(1, 5.0), (2, 4.0), (3, 3.0)]
    assert series.val_losses == [(0, 6.0), (3, 3.5)]
    assert series.latest.val_loss == 3.5 and series.heard_at == 5.0


def test_a_trainer_that_starts_over_starts_its_curves_over() -> None:
    book = TrainerBook()
    for step in range(1, 6):
        book.heard(T, told(step, 1.0), now=step)
    book.heard(T, told(2, 9.0), now=10.0)  # restarted from an older state
    assert book.series()[0].losses == [(2, 9.0)]


def test_a_curve_is_bounded_and_still_spans_the_run() -> None:
    book = TrainerBook()
    steps = 3 * MAX_POINTS
    for step in range(1, steps + 1):
        book.heard(T, told(step, float(step), val=(step, float(step))), now=step)
    (series,) = book.series()
    for curve in (series.losses, series.val_losses):
        assert MAX_POINTS // 2 <= len(curve) <= MAX_POINTS
        assert curve[0][0] == 1 and curve[-1][0] == steps  # first and newest kept
        assert [s for s, _ in curve] == sorted({s for s, _ in curve})


def test_trainers_are_bounded_the_one_heard_longest_ago_gives_way() -> None:
    book = TrainerBook()
    for i in range(MAX_TRAINERS + 3):
        book.heard(f"t{i}", told(1, 1.0), now=float(i))
    assert len(book) == MAX_TRAINERS
    names = [s.peer_id for s in book.series()]
    assert names[0] == f"t{MAX_TRAINERS + 2}"  # the most recent first
    assert "t0" not in names and "t2" not in names and "t3" in names


# ---- what the daemon shows ---------------------------------------------------------------------
def test_rows_for_status_and_the_training_endpoint() -> None:
    book = TrainerBook()
    book.heard(T, told(0, val=(0, 6.25), shard="1/2"), now=10.0)
    book.heard(T, told(1, 5.5, val=(0, 6.25), shard="1/2"), now=12.0)
    (row,) = trainer_rows(book.series(), 13.5, curves=False)
    assert (row.peer_id, row.step, row.loss, row.val_loss, row.val_step, row.shard,
            row.heard_s) == (T, 1, 5.5, 6.25, 0, "1/2", 1.5)
    assert row.losses == () and row.val_losses == ()
    info = TrainingInfo(trainers=trainer_rows(book.series(), 13.5, curves=True))
    assert info.trainers[0].losses == ((1, 5.5),)
    assert TrainingInfo.from_json(to_json(info)) == info
    assert "step 1  loss 5.5000  val 6.2500 (step 0)  shard 1/2  epoch 0" in trainer_line(row)
    unknown = TrainerRow(peer_id=T, step=0)
    assert "loss -  val -  shard -  epoch -" in trainer_line(unknown)


class _Handlers:
    """``PipelineHandlers.heard_from`` on what it needs: counters, a book and a clock."""

    def __init__(self) -> None:
        from swarmd.pipeline.handlers import PipelineHandlers

        self.counters: Counter[str] = Counter()
        self.trainers = TrainerBook()
        self._clock = lambda: 42.0
        self.heard_from = PipelineHandlers.heard_from.__get__(self)


def test_a_stage_keeps_good_progress_and_counts_bad_without_failing() -> None:
    h = _Handlers()
    h.heard_from(T, reply({"step": 3, "loss": 2.0, "shard": "0/1"}))
    h.heard_from(T, reply({"step": 4, "loss": math.nan}))
    h.heard_from("other", reply("garbage"))
    h.heard_from(T, Message(kind="ok"))  # an older trainer: nothing, no counter
    assert h.counters["trainer_progress_refused"] == 2
    (series,) = h.trainers.series()
    assert series.latest.step == 3 and series.heard_at == 42.0
