"""Exact steps (``swarmd.pipeline.exact``): the stages report each step to the trainer, every
part scales its gradient by the whole model's clipping coefficient, and the next step's
forwards wait for the stage steps they must run on. Pure parts first, then three steps through
a real libp2p swarm in this process against ``clip_grad_norm_`` over one model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any, AsyncIterator

import pytest
import torch
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.averaging.messages import Progress, Start, parse_round
from swarmd.averaging.trigger import exact_step
from swarmd.errors import BadActivation, BadRoundMessage
from swarmd.errors import NotOnPath
from swarmd.pipeline.exact import (MAX_SOURCES, NormNotes, Posted, Sources, StepBoard,
                                  clip_coefficient, stages_behind)
from swarmd.pipeline.messages import (Expect, Forward, NormNote, StepAnswer, StepReport,
                                      parse_forward, parse_norm_note, parse_step_answer,
                                      parse_step_report)
from transport.frames import Message

from inprocess_swarm import two_stage_swarm


# ---- sources ---------------------------------------------------------------------------------

def test_sources_name_the_trainer_steps_a_step_is_exactly_made_of() -> None:
    sources = Sources()
    assert exact_step(sources.peek(), 0, 8) is None  # nothing accumulated: nothing to report
    sources.add("T", 3)
    sources.add("T", 3)
    assert exact_step(sources.peek(), 8, 8) == (("T", 3),)
    assert exact_step(sources.peek(), 12, 8) is None  # more than one target batch
    assert exact_step(sources.peek(), 4, 8) is None  # part of one
    sources.add("U", 7)  # another trainer's share of the same swarm step: still exact
    assert exact_step(sources.peek(), 8, 8) == (("T", 3), ("U", 7))
    sources.add("T", 4)  # two steps of one trainer: not exact
    assert exact_step(sources.take(), 8, 8) is None
    assert sources.peek() == []  # taken: the next step starts over


def test_sources_that_overflow_are_never_taken_for_exact() -> None:
    sources = Sources()
    for i in range(MAX_SOURCES + 3):
        sources.add(f"T{i}", 0)
    assert len(sources.peek()) == MAX_SOURCES + 1 and exact_step(sources.peek(), 8, 8) is None
    assert exact_step([("", -1)], 8, 8) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["", "A", "B", "C"]), st.integers(-1, 3)),
                max_size=6), st.integers(0, 20), st.integers(1, 20))
def test_an_exact_step_names_each_trainer_once_and_holds_the_target(
        pairs: list[tuple[str, int]], samples: int, target: int) -> None:
    exact = exact_step(pairs, samples, target)
    if exact is None:
        trainers = [t for t, _ in set(pairs)]
        assert (not pairs or samples != target or len(set(trainers)) != len(trainers)
                or any(not t or s < 0 for t, s in pairs))
        return
    assert samples == target and set(exact) == set(pairs)
    assert len({t for t, _ in exact}) == len(exact) and all(t and s >= 0 for t, s in exact)


# ---- the coefficient ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.floats(0.01, 10.0),
       st.floats(0.01, 100.0), st.integers(0, 2 ** 31))
def test_the_coefficient_clips_as_clip_grad_norm_over_the_whole_model(
        sizes: list[int], clip: float, magnitude: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g, dtype=torch.float64) * magnitude for n in sizes]
    expected = [p.clone().requires_grad_(True) for p in parts]
    for e, p in zip(expected, parts):
        e.grad = p.clone()
    torch.nn.utils.clip_grad_norm_(expected, clip)
    c = clip_coefficient([float(p.pow(2).sum()) for p in parts], clip)
    for e, p in zip(expected, parts):
        assert torch.allclose(p * c, e.grad, rtol=1e-9, atol=1e-12)
    # a part scaled by it is within the bound: its own clipping is then a no-op
    assert all(float((p * c).norm()) <= clip * (1 + 1e-9) or c == 1.0 for p in parts)


def test_no_clipping_and_a_non_finite_norm_give_one() -> None:
    assert clip_coefficient([4.0, 5.0], 0.0) == 1.0
    assert clip_coefficient([math.inf], 1.0) == 1.0
    assert clip_coefficient([0.25], 1.0) == 1.0  # within the bound: unchanged


# ---- the trainer's board ------------------------------------------------------------------------

def test_a_step_is_answered_once_every_stage_and_the_trainer_reported() -> None:
    board = StepBoard(num_stages=2, clip=1.0)
    assert board.post(0, 1, 9.0, stage_step=5, samples=32) == Posted.TAKEN  # before open
    board.open(0, samples=32)
    board.own(0, 0.0)
    assert not board.complete(0) and board.answer(0) is None
    assert board.post(0, 0, 16.0, stage_step=7, samples=32) == Posted.TAKEN
    assert board.complete(0)
    assert board.answer(0) == pytest.approx(1.0 / (5.0 + 1e-6))
    assert board.norm(0) == pytest.approx(5.0)
    assert board.expected() == (8, 6)  # each stage's next step
    assert board.post(0, 0, 16.0, stage_step=7, samples=32) == Posted.NOT_OPEN  # answered
    assert board.samples_mismatch == 0


def test_reports_that_disagree_keep_the_first_and_a_late_step_expires() -> None:
    board = StepBoard(num_stages=2, clip=1.0)
    board.open(4, samples=8)
    assert board.post(4, 0, 1.0, stage_step=4, samples=8) == Posted.TAKEN
    assert board.post(4, 0, 1.0000001, stage_step=4, samples=8) == Posted.AGAIN
    assert board.post(4, 0, 2.0, stage_step=4, samples=8) == Posted.DISAGREES
    board.own(4, 1.0)
    board.expire(4)  # stage 1 never reported
    assert board.answered(4) and board.answer(4) is None and board.expected() is None


def test_a_stage_whose_round_failed_ends_the_wait_for_its_step() -> None:
    board = StepBoard(num_stages=2, clip=1.0)
    board.open(2, samples=8)
    board.own(2, 1.0)
    board.post(2, 0, 1.0, stage_step=2, samples=8)
    assert board.fail(2) == Posted.FAILED  # stage 1's round failed: it takes no step now
    assert board.answered(2) and board.answer(2) is None and board.expected() is None
    assert board.fail(2) == Posted.NOT_OPEN
    report = StepReport(step=2, stage=1, stage_step=2, sqnorm=0.0, samples=0, failed=True)
    assert parse_step_report(Message(**report.wire()), num_stages=2).failed
    with pytest.raises(BadActivation):
        parse_step_report(_report(failed="yes"), num_stages=2)


def test_a_stage_stepping_on_other_samples_than_the_trainer_s_step_is_counted() -> None:
    board = StepBoard(num_stages=1, clip=0.0)
    board.open(0, samples=32)
    board.own(0, 1.0)
    board.post(0, 0, 1.0, stage_step=0, samples=16)
    assert board.answer(0) == 1.0 and board.samples_mismatch == 1
    board.open(1, samples=32)  # a round's member does not say its samples: nothing counted
    board.own(1, 1.0)
    board.post(1, 0, 1.0, stage_step=1, samples=0)
    assert board.answer(1) == 1.0 and board.samples_mismatch == 1


def test_the_board_remembers_a_bounded_number_of_steps() -> None:
    board = StepBoard(num_stages=1, clip=1.0, keep=4)
    for step in range(100):
        board.open(step, samples=1)
    assert len(board._steps) <= 4
    assert board.post(0, 0, 1.0, stage_step=0, samples=1) == Posted.NOT_OPEN


# ---- norm notes --------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e12, allow_subnormal=False), min_size=2, max_size=5),
       st.floats(0.0, 10.0), st.randoms(use_true_random=False))
def test_a_stage_holding_every_part_s_norm_gets_the_trainer_s_answer_bitwise(
        sqnorms: list[float], clip: float, rnd: Any) -> None:
    """The board's answer and a stage's notes: the same coefficient to the last bit, in
    whatever order the reports and notes come (their sums of the same numbers could otherwise
    differ in the last place, and the parts would step apart)."""
    *stages, own = sqnorms
    board = StepBoard(num_stages=len(stages), clip=clip)
    board.open(7, samples=4)
    board.own(7, own)
    for stage in rnd.sample(range(len(stages)), len(stages)):
        board.post(7, stage, stages[stage], stage_step=3, samples=4)
    notes = NormNotes(num_stages=len(stages))
    parts = [*enumerate(stages), (len(stages), own)]
    for part, sqnorm in rnd.sample(parts, len(parts)):
        assert notes.coefficient("T", 7) is None
        notes.add("T", 7, part, sqnorm, clip if part == len(stages) else None)
    assert notes.coefficient("T", 7) == board.answer(7)
    assert notes.coefficient("U", 7) is None and notes.coefficient("T", 8) is None


def test_norm_notes_need_the_trainer_s_clip_keep_a_stage_s_first_and_stay_bounded() -> None:
    notes = NormNotes(num_stages=1, keep=4)
    notes.add("T", 0, 0, 4.0)
    notes.add("T", 0, 1, 5.0)  # the trainer's part without its bound: not complete
    assert notes.has_trainer("T", 0) and notes.coefficient("T", 0) is None
    notes = NormNotes(num_stages=1, keep=4)
    notes.add("T", 0, 1, 5.0, clip=1.0)
    notes.add("T", 0, 0, 4.0)
    notes.add("T", 0, 0, 100.0)  # a second note of a stage's part: the first stays
    assert notes.coefficient("T", 0) == clip_coefficient([4.0, 5.0], 1.0)
    notes.add("T", 0, 1, 9.0, clip=2.0)  # the trainer again (restarted): the step starts over
    assert notes.coefficient("T", 0) is None
    notes.add("T", 0, 0, 16.0)
    assert notes.coefficient("T", 0) == clip_coefficient([16.0, 9.0], 2.0)
    for step in range(1, 100):
        notes.add("T", step, 0, 1.0)
    assert len(notes._parts) <= 4 and not notes.has_trainer("T", 0)
    # a trainer starting at step 0 (a new run) after another's high steps: kept, not dropped
    # as the oldest (every step of a 40-step run on `far` lost its notes that way)
    for step in range(8):
        notes.add("U", step, 1, 5.0, clip=1.0)
        assert notes.has_trainer("U", step)


def test_a_norm_note_round_trips_and_bad_ones_are_refused() -> None:
    mine = NormNote(trainer="T", step=3, part=2, sqnorm=2.5, clip=1.0)
    theirs = NormNote(trainer="T", step=3, part=1, sqnorm=0.0)
    for note in (mine, theirs):
        assert parse_norm_note(Message(**note.wire()), num_stages=2) == note
    for base, bad in ((mine, {"sqnorm": float("nan")}), (mine, {"sqnorm": -1.0}),
                      (mine, {"clip": float("inf")}), (mine, {"clip": True}),
                      (mine, {"clip": None}), (theirs, {"clip": 1.0}), (mine, {"part": 3}),
                      (mine, {"part": -1}), (mine, {"trainer": ""}), (mine, {"step": 1.5})):
        meta = {k: v for k, v in {**base.wire()["meta"], **bad}.items() if v is not None}
        with pytest.raises(BadActivation):
            parse_norm_note(Message(kind="norm_note", meta=meta), num_stages=2)
    with pytest.raises(BadActivation):
        parse_norm_note(Message(kind="norm_note", meta=mine.wire()["meta"],
                                tensors=(torch.zeros(1),)), num_stages=2)


# ---- messages -------------------------------------------------------------------------------

def test_a_norm_note_goes_to_a_bounded_number_of_peers_of_each_stage_named() -> None:
    from swarmd.pipeline.server import NOTE_PEERS_PER_STAGE, note_peers

    view = {0: {f"a{i}": (0, 0, [f"/ip4/127.0.0.1/tcp/{i}"]) for i in range(6)},
            1: {"b0": (0, 0, ["/ip4/127.0.0.1/tcp/9"])}, 2: {}}
    peers = note_peers(lambda stage: view.get(stage, {}), [0, 1, 2])
    assert [p for p, _ in peers] == [f"a{i}" for i in range(NOTE_PEERS_PER_STAGE)] + ["b0"]
    assert dict(peers)["b0"] == ("/ip4/127.0.0.1/tcp/9",)
    assert note_peers(lambda stage: view[stage], [1]) == [("b0", ("/ip4/127.0.0.1/tcp/9",))]


def test_a_stage_is_behind_when_every_peer_of_it_announces_less_than_the_named_step() -> None:
    assert stages_behind((6, 6, 6), [{"a": 6}, {"b": 5}, {"c": 6, "d": 5}]) == [1]
    assert stages_behind((6, 6), [{"a": 7}, {"b": 5, "c": 6}]) == []
    # a stage without a peer in view is missing (waited for), not behind
    assert stages_behind((6, 6), [{"a": 2}, {}]) == [0]
    assert stages_behind((6, 6), [{"a": 6}]) == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.lists(st.integers(0, 20), max_size=3)),
                min_size=1, max_size=4))
def test_behind_means_no_peer_of_the_stage_could_run_its_forwards(
        stages: list[tuple[int, list[int]]]) -> None:
    expected = tuple(want for want, _ in stages)
    announced = [{f"p{i}": step for i, step in enumerate(steps)} for _, steps in stages]
    behind = stages_behind(expected, announced)
    for stage, (want, steps) in enumerate(stages):
        assert (stage in behind) == (bool(steps) and all(step < want for step in steps))


def _report(**meta: object) -> Message:
    base = {"step": 3, "stage": 1, "stage_step": 9, "sqnorm": 2.5, "samples": 32}
    return Message(kind="step_report", meta={**base, **meta})


def test_a_step_report_round_trips_and_bad_ones_are_refused() -> None:
    report = StepReport(step=3, stage=1, stage_step=9, sqnorm=2.5, samples=32)
    assert parse_step_report(Message(**report.wire()), num_stages=2) == report
    for bad in ({"sqnorm": float("nan")}, {"sqnorm": -1.0}, {"sqnorm": float("inf")},
                {"sqnorm": True}, {"stage": 2}, {"stage": -1}, {"step": "3"},
                {"samples": None}, {"stage_step": 1.5}):
        with pytest.raises(BadActivation):
            parse_step_report(_report(**bad), num_stages=2)
    with pytest.raises(BadActivation):
        parse_step_report(Message(kind="step_report", meta=_report().meta,
                                  tensors=(torch.zeros(1),)), num_stages=2)


def test_a_step_answer_is_a_coefficient_in_zero_one_or_none() -> None:
    assert parse_step_answer(Message(**StepAnswer(coefficient=0.5).wire())).coefficient == 0.5
    assert parse_step_answer(Message(**StepAnswer(coefficient=None).wire())).coefficient is None
    for bad in (0.0, 1.5, -0.1, float("nan"), True, "1"):
        with pytest.raises(BadActivation):
            parse_step_answer(Message(kind="ok", meta={"coefficient": bad}))
    with pytest.raises(BadActivation):
        parse_step_answer(Message(kind="error", meta={}))


def test_a_forward_names_one_stage_step_per_stage_or_none() -> None:
    expect = Expect(stage=0, num_stages=2, model="m", width=4, max_tokens=64)
    fwd = Forward(mb="a/1", stage=0, step=0, path=(), trainer="T", model="m",
                  x=torch.zeros(1, 2, 4), at=(3, 5))
    parsed = parse_forward(Message(**fwd.wire()), expect)
    assert parsed.at == (3, 5) and parsed.next_hop("me", parsed.x).at == (3, 5)
    for bad in ([3], [3, 5, 7], [3, -1], [3, "5"], [3, 5.0], "35", [True, 1]):
        meta = {**fwd.wire()["meta"], "at": bad}
        with pytest.raises(BadActivation):
            parse_forward(Message(kind="forward", meta=meta, tensors=(fwd.x,)), expect)


def test_round_messages_carry_the_sources_of_the_samples() -> None:
    progress = Progress(stage=1, step=4, samples=8, sources=(("T", 2),))
    assert parse_round("progress", progress.to_meta()) == progress
    start = Start(stage=1, step=4, round_id="1:4:ab", group=("a", "b"), bandwidths=(None, None),
                  sources=(("T", 2), ("U", 5)))
    assert parse_round("start", start.to_meta()).sources == (("T", 2), ("U", 5))
    for bad in ({"sources": [["T"]]}, {"sources": [["T", 1.5]]},
                {"sources": [["T", 1]] * 20}, {"sources": "T"}):
        with pytest.raises(BadRoundMessage):
            parse_round("progress", {**progress.to_meta(), **bad})
    for bad in ([["", 2]], [["T", 2], ["T", 3]], [["T", -1]], ["T"], "T"):
        with pytest.raises(BadRoundMessage):  # one step per named trainer, or not exact
            parse_round("start", {**start.to_meta(), "sources": bad})


# ---- three steps through a real swarm ----------------------------------------------------------

def _swarm(config: Any, optim: Any) -> Any:
    """Two stage servers (one peer each, a step target of 6 samples) and an exact trainer."""
    return _exact(two_stage_swarm(config, target_batch_size=6, swarm="exact-steps",
                                  lr=optim.lr, optim=optim))


@contextlib.asynccontextmanager
async def _exact(swarm: Any) -> AsyncIterator[tuple[list[Any], Any]]:
    async with swarm as (servers, trainer):
        trainer.exact = True
        yield servers, trainer


async def _train(trainer: Any, steps: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """The default schedule's path: a barrier at every step of 3 microbatches, up to 6 in
    flight, so the next step's early burst has room even while all 3 of this step's forwards
    still wait for their chain's ok (an opening of 3 left it none under a loaded CI)."""
    from swarmd.pipeline.inflight import InFlight

    drawn = iter([b for batches in steps for b in batches])

    async def stepped(step: int, loss: float) -> bool:
        return False

    await trainer.train(lambda: next(drawn), steps=len(steps), microbatches=3,
                        window=InFlight(floor=2, ceiling=6), on_step=stepped, barrier=True)


def test_a_step_sends_its_opening_burst_before_anything_comes_back() -> None:
    """The window's target is 1 (its floor: nothing measured yet) and its ceiling 3: every
    step launches its 3 microbatches at once, not one at a time, each step on the weights
    after the one before it (the barrier holds)."""
    from swarmd.models.gpt import ModelConfig
    from swarmd.pipeline.inflight import InFlight
    from swarmd.training.swarm_optim import OptimSettings

    config = ModelConfig(width=16, heads=2, layers=2, seq_len=16)
    optim = OptimSettings(name="adamw", lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    drawn = iter([b for batches in _batches(2) for b in batches])
    peaks: list[int] = []

    async def scenario() -> None:
        async with _swarm(config, optim) as (servers, trainer):
            inner, running = trainer._microbatch, 0

            async def counted(*args: Any) -> Any:
                nonlocal running
                running += 1
                peaks.append(running)
                try:
                    return await inner(*args)
                finally:
                    running -= 1

            trainer._microbatch = counted

            async def stepped(step: int, loss: float) -> bool:
                peaks.append(0)  # a step's end
                return False

            await trainer.train(lambda: next(drawn), steps=2, microbatches=3,
                                window=InFlight(floor=1, ceiling=3), on_step=stepped,
                                barrier=True)

    uvloop.run(asyncio.wait_for(scenario(), 120))
    assert peaks == [1, 2, 3, 0, 1, 2, 3, 0]


def test_a_state_saved_after_a_step_resumes_before_the_next_step_s_early_batches() -> None:
    """The next step's opening burst starts before the step is taken (the norm notes went):
    what ``on_step`` sees as drawn ahead (``drawn_ahead``, which a saved state's data
    position leaves out) is exactly what was drawn beyond the steps taken."""
    from swarmd.models.gpt import ModelConfig
    from swarmd.pipeline.inflight import InFlight
    from swarmd.training.swarm_optim import OptimSettings

    config = ModelConfig(width=16, heads=2, layers=2, seq_len=16)
    optim = OptimSettings(name="adamw", lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    batches = [b for step in _batches(4) for b in step]
    drawn: list[int] = []
    seen: list[tuple[int, int]] = []  # (drawn, drawn ahead) at each step's end

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        drawn.append(1)
        return batches[len(drawn) - 1]

    async def scenario() -> None:
        async with _swarm(config, optim) as (servers, trainer):
            async def stepped(step: int, loss: float) -> bool:
                seen.append((len(drawn), trainer.drawn_ahead))
                return False

            await trainer.train(draw, steps=4, microbatches=3,
                                window=InFlight(floor=1, ceiling=8), on_step=stepped,
                                barrier=True)
            assert trainer.counters["steps_started_early"] == 2  # steps 2 and 3

    uvloop.run(asyncio.wait_for(scenario(), 120))
    assert [n - ahead for n, ahead in seen] == [3, 6, 9, 12]
    assert [ahead for _, ahead in seen] == [0, 3, 3, 0]


def test_a_stage_takes_a_norm_note_only_from_the_trainer_or_a_peer_of_the_stage_it_tells_of(
        ) -> None:
    """The trainer's part only from that trainer; a stage's only from a peer the view lists
    at that stage, and never this peer's own stage: the rest are refused and counted, and
    change nothing."""
    from swarmd.models.gpt import ModelConfig
    from swarmd.training.swarm_optim import OptimSettings

    config = ModelConfig(width=16, heads=2, layers=2, seq_len=16)
    optim = OptimSettings(name="adamw", lr=1e-2, weight_decay=0.0, grad_clip=1.0)

    async def scenario() -> None:
        async with _swarm(config, optim) as (servers, trainer):
            s0, s1 = servers
            me, zero = trainer.host.peer_id, s0.host.peer_id

            async def told(server: Any, peer: str, **note: Any) -> None:
                await server.on_norm_note(Message(**NormNote(**note).wire()), peer)

            for server, peer, note in (
                    (s1, zero, dict(trainer=me, step=0, part=2, sqnorm=1.0, clip=1.0)),
                    (s1, me, dict(trainer=me, step=0, part=0, sqnorm=1.0)),  # not stage 0's
                    (s1, zero, dict(trainer=me, step=0, part=1, sqnorm=1.0)),  # its own stage
                    (s0, s1.host.peer_id, dict(trainer=me, step=0, part=0, sqnorm=1.0))):
                with pytest.raises(NotOnPath):
                    await told(server, peer, **note)
            assert s1.counters["refused.note_sender"] == 3
            assert s0.counters["refused.note_sender"] == 1
            assert not s1.notes.has_trainer(me, 0) and s1.counters["norm_notes_in"] == 0
            await told(s1, me, trainer=me, step=0, part=2, sqnorm=4.0, clip=1.0)
            await told(s1, zero, trainer=me, step=0, part=0, sqnorm=5.0)
            s1.notes.add(me, 0, 1, 7.0)  # its own, as it reports
            assert s1.counters["norm_notes_in"] == 2
            assert s1.notes.coefficient(me, 0) == clip_coefficient([5.0, 7.0, 4.0], 1.0)

    uvloop.run(asyncio.wait_for(scenario(), 120))


async def _until(condition: Any, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


def _batches(n: int, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 256, (2, 16), generator=g),
              torch.randint(0, 256, (2, 16), generator=g)) for _ in range(3)]
            for _ in range(n)]


@pytest.mark.parametrize("answers", ["prompt", "late"])
def test_three_exact_steps_through_the_swarm_equal_clip_grad_norm_over_one_model(
        answers: str) -> None:
    """Two stages and a trainer on real libp2p hosts in this process, codec none, one peer per
    stage, a step target of exactly one trainer step, a clipping bound the gradients exceed:
    after three steps every weight equals a single process's with AdamW and
    ``clip_grad_norm_`` over the whole model (per-part clipping would not). With the
    trainer's answers ``late`` (held until the stage stepped), the stages step on the norm
    notes alone, the next step's forwards already there, and the answers that come after
    agree bit for bit."""
    from swarmd.models.gpt import FullModel, ModelConfig
    from swarmd.training.swarm_optim import OptimSettings

    config = ModelConfig(width=32, heads=2, layers=4, seq_len=16)
    optim = OptimSettings(name="adamw", lr=1e-2, weight_decay=0.0, grad_clip=0.05)
    steps = _batches(3)

    async def swarm() -> dict[str, torch.Tensor]:
        async with _swarm(config, optim) as (servers, trainer):
            if answers == "late":
                answer = trainer._on_step_report
                by_peer = {s.host.peer_id: s for s in servers}

                async def held(message: Message, peer: str) -> Message:
                    # held until the reporting stage stepped without it (at most 10 s)
                    reply = await answer(message, peer)
                    report = parse_step_report(message, num_stages=2)
                    with contextlib.suppress(TimeoutError):
                        await _until(lambda: by_peer[peer].step > report.stage_step, 10.0)
                    return reply

                trainer.host.set_request_handler(trainer.proto["step_report"], held)
            await _train(trainer, steps)
            # where the last step's time went (train-metrics.jsonl's "phases"): every phase
            # of an exact step, the first microbatch back no later than the last
            phases = trainer.stats.step_phases
            assert set(phases) == {"first_back", "last_back", "own_gradient", "reports",
                                   "apply"} and min(phases.values()) >= 0
            assert phases["first_back"] <= phases["last_back"]
            # the last step's forwards-to-be: the stages must have taken it
            await _until(lambda: all(s.step == 3 for s in servers))
            # (late answers are waited for: the stages stepped without them)
            await _until(lambda: all(s.counters["step_reports"] == 3 for s in servers))
            out = {f"head.{n}": p.detach().clone() for n, p in trainer.head.named_parameters()}
            for s in servers:  # stage 0 holds the embedding
                assert s.step == 3 and s.counters["step_reports"] == 3
                out.update({n if n.startswith("embedding.") else f"stages.{s.stage}.{n}":
                            p.detach().clone() for n, p in s.module.named_parameters()})
            assert trainer.counters["steps_exact"] == 3 and trainer.counters["steps_clipped"] == 3
            assert trainer.board.expected() == (3, 3)
            assert trainer.counters["norm_notes_sent"] == 6  # each step, to both stages
            if answers == "late":
                assert trainer.counters["steps_started_early"] == 1  # step 2 (1: no at yet)
                for s in servers:
                    assert s.counters["steps_noted"] == 3
                    await _until(lambda: not s._background)  # every late answer compared
                    assert s.counters["step_notes_disagree"] == 0
            return out

    weights = uvloop.run(asyncio.wait_for(swarm(), 120))
    model = FullModel(config, num_stages=2, seed=0)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=optim.lr, weight_decay=0.0)
    for batches in steps:
        opt.zero_grad()
        for x, y in batches:
            _, loss = model(x, y)
            (loss * x.shape[0] / 6).backward()
        torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
    ref = dict(model.named_parameters())
    assert set(weights) == set(ref), set(weights) ^ set(ref)
    for name, w in weights.items():
        # Adam divides by the gradient's own size, so float32 summation order alone moves an
        # element with a near-zero gradient: 1.2e-4 was seen once (a zero-initialised bias,
        # a loaded machine); a wrong clipping coefficient or gradient is off by 1e-2 or more
        err = float((w - ref[name].detach()).norm() / ref[name].detach().norm())
        assert err <= 3e-4, (name, err)


@pytest.mark.parametrize("appears", ["while_it_waits", "before_its_step"])
def test_a_trainer_answers_the_stages_at_once_when_another_trainer_appears(
        monkeypatch: pytest.MonkeyPatch, appears: str) -> None:
    """Another trainer's samples mix into the stages' steps: a stage whose step is not one
    trainer step does not report it (stage 0 here never reports), and a stage that did report
    waits for the answer with its step held. When the trainer sees the other trainer, while it
    waits for step 0's reports or before it takes step 0 with stage 1's report already in, it
    answers None at once (not after ``REPORTS_MAX_S``, an hour here: the run or stage 1's
    steps would hang), and both stages step once per trainer step: the later steps are split
    with the other trainer (``swarmd.trainer.shares``), whose share never comes, and the
    trainer's flushes have the stages step on what they hold."""
    from swarmd.trainer import step_reports
    from swarmd.models.gpt import ModelConfig
    from swarmd.training.swarm_optim import OptimSettings

    monkeypatch.setattr(step_reports, "REPORTS_MAX_S", 3600.0)
    config = ModelConfig(width=32, heads=2, layers=2, seq_len=16)
    optim = OptimSettings(name="adamw", lr=1e-2, weight_decay=0.0, grad_clip=1.0)

    async def swarm() -> None:
        async with _swarm(config, optim) as (servers, trainer):
            others: dict[str, list[str]] = {"ids": []}
            trainer.other_trainers = lambda: others["ids"]

            async def mixed(source: Any, sqnorm: float, samples: int, **kw: Any) -> None:
                return None  # the step mixed another trainer's samples: no report

            servers[0].report_step = mixed
            reported, stepped = trainer._reported, trainer._stepped

            async def reported_then_appear(step: int, samples: int, sqnorm: float) -> Any:
                waiting = asyncio.ensure_future(reported(step, samples, sqnorm))
                await asyncio.sleep(0)  # it opened the step and waits for reports
                others["ids"] = ["another-trainer"]
                return await waiting

            async def appear_then_step() -> None:
                while trainer.counters["reports_taken"] < 1:  # stage 1's report waits
                    await asyncio.sleep(0.005)
                others["ids"] = ["another-trainer"]
                await stepped()

            if appears == "while_it_waits":
                trainer._reported = reported_then_appear
            else:
                trainer._stepped = appear_then_step
            await _train(trainer, _batches(3))
            for s in servers:  # each steps once its 6 samples of a trainer step are in
                for _ in range(500):
                    if s.step == 3:
                        break
                    await asyncio.sleep(0.01)
                assert s.step == 3, (s.stage, s.step, dict(s.counters))
            assert trainer.counters["steps_exact"] == 0, dict(trainer.counters)
            assert trainer.counters["reports_others_appeared"] == (
                appears == "while_it_waits"), dict(trainer.counters)
            # step 0 was reported and answered None; steps 1 and 2 were split with the other
            # trainer, whose share never came: the stages stepped on this one's when it
            # flushed them (their samples short of the target: not reported)
            assert servers[1].counters["step_reports_expired"] == 1, dict(servers[1].counters)
            assert trainer.counters["flushes"] == 3, dict(trainer.counters)
            assert all(s.sync.counters["flushed"] == 2 for s in servers), [
                dict(s.sync.counters) for s in servers]

    uvloop.run(asyncio.wait_for(swarm(), 120))


def _trainer(table: dict[int, dict[str, tuple[float, int, tuple[str, ...]]]],
             clock: Any = None) -> Any:
    """A trainer of a 2-stage swarm whose view is ``table`` (its host is never started),
    timing with ``clock`` when given."""
    from swarmd.trainer.trainer import Trainer
    from swarmd.models.gpt import ModelConfig
    from transport import identity
    from transport.codecs import CodecSpec
    from transport.host import Host, HostOptions

    config = ModelConfig(width=32, heads=2, layers=4, seq_len=16)
    codec = CodecSpec(name="none")
    trainer = Trainer(Host(identity.generate(), HostOptions(pubsub=None, codec=codec)),
                      swarm="exact-steps", num_stages=2, model_config=config,
                      model_hash=config.model_hash(), codec=codec, lr=1e-3, seed=0,
                      peers_of=lambda s: dict(table.get(s, {})),
                      **({} if clock is None else {"clock": clock}))
    trainer.exact = True
    return trainer


def test_a_peer_has_left_its_stage_after_the_grace_on_the_trainer_s_clock() -> None:
    """The grace a peer missing from its stage gets (``LEFT_GRACE_S``) runs on the clock
    the trainer was given: no real time passes here."""
    from swarmd.trainer.step_reports import LEFT_GRACE_S

    now = [100.0]
    table = {0: {"a": (1.0, 0, ())}, 1: {"c": (1.0, 0, ())}}
    trainer = _trainer(table, clock=lambda: now[0])
    trainer._route(("a", "c"))
    trainer.board.open(0, 4)
    del table[0]["a"]  # a served step 0 at stage 0, which has not reported, and is gone
    assert not trainer._left_its_stage(0)  # first seen missing at 100
    now[0] += LEFT_GRACE_S - 0.01
    assert not trainer._left_its_stage(0)
    now[0] += 0.01
    assert trainer._left_its_stage(0) and trainer.counters["reports_left"] == 1


def test_a_report_from_a_peer_that_served_the_step_counts_while_the_view_lost_it() -> None:
    """c served step 0 at stage 1, then the trainer's view lost it for a moment (its
    announcements late while a mate was frozen): its report still counts. A peer neither
    listed nor on the step's paths is refused, as before."""
    table = {0: {"a": (1.0, 0, ())}, 1: {"c": (1.0, 0, ())}}
    trainer = _trainer(table)
    trainer._route(("a", "c"))
    trainer.board.open(0, 4)
    del table[1]["c"]
    report = Message(**StepReport(step=0, stage=1, stage_step=0, sqnorm=1.0,
                                  samples=4).wire())

    async def send(peer: str) -> Any:
        reply = asyncio.ensure_future(trainer._on_step_report(report, peer))
        for _ in range(100):  # posted: it waits for the step's answer
            await asyncio.sleep(0.01)
            if reply.done() or 0 in trainer._answers:
                break
        if not reply.done():
            trainer._answers.pop(0).set_result(1.0)
        return await reply

    assert asyncio.run(send("c")).meta["coefficient"] == 1.0
    assert trainer.counters["reports_taken"] == 1
    assert trainer.counters["refused.report_sender"] == 0
    with pytest.raises(NotOnPath):
        asyncio.run(send("x"))
    assert trainer.counters["refused.report_sender"] == 1


@pytest.mark.parametrize("case", ["a_server_leaves", "nobody_leaves", "missing_a_moment"])
def test_the_wait_for_a_step_s_reports_ends_when_a_peer_that_served_it_left_its_stage(
        case: str) -> None:
    # a peer that served a step at stage 0 moves to another stage before stage 0 reported
    # the step: stage 0's report will not come (the leader's is refused, its mates miss its
    # samples), so the trainer must not wait REPORTS_MAX_S (60 s) for it, stalling the swarm;
    # a peer missing from the view for less than LEFT_GRACE_S (an announcement late on a
    # loaded machine) has not left
    from swarmd.trainer import step_reports

    table = {0: {"a": (1.0, 0, ()), "b": (1.0, 0, ())}, 1: {"c": (1.0, 0, ())}}
    trainer = _trainer(table)
    trainer._route(("a", "c"))
    trainer._route(("b", "c"))
    leaves = case == "a_server_leaves"
    poll = step_reports.REPORTS_POLL_S

    async def step() -> tuple[float | None, bool]:
        waiting = asyncio.create_task(trainer._reported(0, 4, 1.0))
        await asyncio.sleep(0.05)
        trainer.board.post(0, 1, 1.0, 0, 4)  # stage 1 reports; stage 0 does not
        trainer._report_came.set()
        if case != "nobody_leaves":
            b = table[0].pop("b")
        if case == "missing_a_moment":
            await asyncio.sleep(2 * poll)  # seen missing at a poll or two, then back
            table[0]["b"] = b
        # ends within the grace and a poll or two when the peer left (30 s: a loaded
        # machine); otherwise it must still wait after the grace and several polls
        # (REPORTS_MAX_S is 60 s)
        done, _ = await asyncio.wait({waiting}, timeout=30.0 if leaves else
                                     step_reports.LEFT_GRACE_S + 4 * poll)
        if not done:  # still waiting, as it should when nobody left
            waiting.cancel()
            return None, False
        return waiting.result(), True

    coefficient, ended = asyncio.run(step())
    assert ended is leaves and coefficient is None
    assert trainer.counters["reports_left"] == int(leaves)
    assert trainer.counters["reports_missed"] == int(leaves)


def test_a_trainer_waiting_long_for_a_steps_reports_says_which_stages_it_waits_for(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from swarmd.trainer import step_reports

    monkeypatch.setattr(step_reports, "REPORTS_SAY_S", 0.2)
    trainer = _trainer({0: {"a": (1.0, 0, ())}, 1: {"c": (1.0, 0, ())}})
    trainer._route(("a", "c"))

    async def step() -> None:
        waiting = asyncio.create_task(trainer._reported(0, 4, 1.0))
        await asyncio.sleep(0.05)
        trainer.board.post(0, 1, 1.0, 0, 4)  # stage 1 reports; stage 0 does not
        trainer._report_came.set()
        for _ in range(100):
            if trainer.counters["reports_slow"]:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(4 * step_reports.REPORTS_POLL_S)  # said once a step
        waiting.cancel()

    with caplog.at_level(logging.INFO, logger="swarmd.trainer.step_reports"):
        asyncio.run(step())
    assert trainer.counters["reports_slow"] == 1
    said = [r.getMessage() for r in caplog.records if "step reports of" in r.getMessage()]
    assert len(said) == 1 and "stage(s) [0]" in said[0] and "{0: ['a']}" in said[0], said


def test_a_stage_step_no_peer_of_the_stage_announces_is_taken_for_gone_after_a_grace() -> None:
    """The reports named stage step 6 for stage 1 (its peer took it there), then that peer
    left and the mate left behind announces 5: microbatches failing for ``STEP_GONE_S`` with
    that stage behind make the forwards name no stage step (``steps_gone``); a stage that
    catches up meanwhile starts the grace over."""
    from swarmd.trainer.step_reports import STEP_GONE_S

    now = [100.0]
    announced = {0: {"a": 6}, 1: {"d": 5}}
    trainer = _trainer({0: {"a": (1.0, 0, ())}, 1: {"d": (1.0, 0, ())}},
                       clock=lambda: now[0])
    trainer.steps_of = lambda stage: announced[stage]
    trainer.board.open(4, 4)
    trainer.board.own(4, 1.0)
    trainer.board.post(4, 0, 1.0, 5, 4)
    trainer.board.post(4, 1, 1.0, 5, 4)
    assert trainer.board.answer(4) == 1.0 and trainer.board.expected() == (6, 6)
    trainer._forget_gone_step()  # first seen behind at 100
    now[0] += STEP_GONE_S - 0.02
    trainer._forget_gone_step()
    assert trainer.board.expected() == (6, 6)
    announced[1] = {"d": 6}  # it was only late to announce: the grace starts over
    trainer._forget_gone_step()
    announced[1] = {"d": 5}
    now[0] += 1.0
    trainer._forget_gone_step()
    now[0] += STEP_GONE_S - 0.02
    trainer._forget_gone_step()
    assert trainer.board.expected() == (6, 6) and not trainer.counters["steps_gone"]
    now[0] += 0.02
    trainer._forget_gone_step()
    assert trainer.board.expected() is None and trainer.counters["steps_gone"] == 1
