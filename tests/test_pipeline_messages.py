"""The typed pipeline messages: built and checked from the wire in one place; unknown keys
dropped; every field's type, size and range, and the tensors' number, shape and dtype."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import BadActivation, ModelMismatch, WrongStage
from swarmd.pipeline.messages import (
    Abandon,
    Expect,
    Forward,
    HopReply,
    hop_seconds,
    parse_abandon,
    parse_backward,
    parse_forward,
    parse_grad,
    parse_hop_reply,
    parse_result,
)
from transport.frames import Message

W = 8
EXPECT = Expect(stage=1, num_stages=3, model="m:1", width=W, max_tokens=64)


def _forward(**over: Any) -> Message:
    meta = {"mb": "t/1", "stage": 1, "step": 3, "path": ["p0"], "trainer": "t", "model": "m:1"}
    tensors = over.pop("tensors", (torch.randn(2, 4, W),))
    meta.update(over)
    return Message(kind="forward", meta=meta, tensors=tensors)


def test_a_forward_round_trips_and_unknown_keys_are_dropped() -> None:
    msg = _forward(evil="x" * 100, trainer_addrs=["/x"] * 10_000)
    fwd = parse_forward(msg, EXPECT)
    assert fwd.path == ("p0",) and fwd.step == 3 and not fwd.eval
    nxt = fwd.next_hop("me", torch.zeros(2, 4, W))
    wire = nxt.wire()
    assert set(wire["meta"]) == {"mb", "stage", "step", "path", "trainer", "model"}
    assert wire["meta"]["path"] == ["p0", "me"] and wire["meta"]["stage"] == 2
    again = parse_forward(Message(**fwd.wire()), EXPECT)
    assert again.mb == fwd.mb and again.path == fwd.path


@pytest.mark.parametrize("over, error", [
    ({"path": "p0"}, BadActivation),                   # not a list
    ({"path": [5]}, BadActivation),                    # not peer ids
    ({"path": []}, BadActivation),                     # wrong length for stage 1
    ({"path": ["p0", "p1"]}, BadActivation),
    ({"path": ["x" * 500]}, BadActivation),
    ({"mb": 5}, BadActivation),
    ({"mb": ""}, BadActivation),
    ({"mb": "m" * 10_000}, BadActivation),
    ({"step": -1}, BadActivation),
    ({"step": True}, BadActivation),
    ({"step": 1.5}, BadActivation),
    ({"trainer": None}, BadActivation),
    ({"eval": "yes"}, BadActivation),
    ({"stage": 2}, WrongStage),
    ({"model": "other:0"}, ModelMismatch),
    ({"tensors": ()}, BadActivation),
    ({"tensors": (torch.randn(2, 4, W), torch.randn(2, 4, W))}, BadActivation),
    ({"tensors": (torch.randn(2, 4, W + 1),)}, BadActivation),
    ({"tensors": (torch.randn(4, W),)}, BadActivation),
    ({"tensors": (torch.zeros(2, 4, W, dtype=torch.int64),)}, BadActivation),
    ({"tensors": (torch.full((2, 4, W), float("inf")),)}, BadActivation),
    ({"tensors": (torch.randn(4, 32, W),)}, BadActivation),  # over max_tokens
    ({"tensors": ("not a tensor",)}, BadActivation),
])
def test_bad_forwards_are_refused_with_typed_errors(over: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        parse_forward(_forward(**over), EXPECT)


@pytest.mark.parametrize("x, reason", [
    (torch.randn(2, 4, W), "shape"),
    (torch.randn(2, 4), "dtype"),
    (torch.tensor([[1, 2, 100]]), "out_of_range"),
    (torch.tensor([[-1, 2, 3]]), "out_of_range"),
    (torch.zeros(4, 32, dtype=torch.int64), "too_large"),
    (torch.zeros(0, 4, dtype=torch.int64), "shape"),
])
def test_a_stage_holding_the_embedding_takes_token_ids_only(x: torch.Tensor, reason: str
                                                             ) -> None:
    """Stage 0 of a model whose embedding it holds (``Expect.vocab``): (B, T) integer ids
    below the vocabulary, nothing else."""
    stage0 = Expect(stage=0, num_stages=3, model="m:1", width=W, max_tokens=64, vocab=100)
    ids = torch.randint(100, (2, 4), dtype=torch.int32)
    fwd = parse_forward(_forward(stage=0, path=[], tensors=(ids,)), stage0)
    assert torch.equal(fwd.x, ids)
    with pytest.raises(BadActivation) as err:
        parse_forward(_forward(stage=0, path=[], tensors=(x,)), stage0)
    assert err.value.reason == reason


def test_a_backward_needs_the_whole_path() -> None:
    meta = {"mb": "t/1", "stage": 1, "step": 0, "path": ["p0", "p1", "p2"], "trainer": "t",
            "model": "m:1"}
    bwd = parse_backward(Message(kind="backward", meta=meta, tensors=(torch.randn(2, 4, W),)),
                         EXPECT)
    assert bwd.previous_hop(torch.zeros(1)).stage == 0
    for path in (["p0", "p1"], ["p0", "p1", "p1"], "p0p1p2", None):
        with pytest.raises(BadActivation):
            parse_backward(Message(kind="backward", meta={**meta, "path": path},
                                   tensors=(torch.randn(2, 4, W),)), EXPECT)


def test_results_and_grads_must_have_the_expected_shape_and_a_float_dtype() -> None:
    y = torch.randn(2, 4, W)
    ok = parse_result(Message(kind="result", meta={"mb": "a", "path": ["x", "y"], "z": 1},
                              tensors=(y,)), num_stages=2, shape=(2, 4, W))
    assert ok.path == ("x", "y")
    for tensors, meta in [((y[:1],), {"mb": "a", "path": ["x", "y"]}),
                          ((y.long(),), {"mb": "a", "path": ["x", "y"]}),
                          ((y, y), {"mb": "a", "path": ["x", "y"]}),
                          ((y,), {"mb": "a", "path": ["x"]}),
                          ((y,), {"path": ["x", "y"]})]:
        with pytest.raises(BadActivation):
            parse_result(Message(kind="result", meta=meta, tensors=tensors), num_stages=2,
                         shape=(2, 4, W))
    assert parse_grad(Message(kind="grad", meta={"mb": "a"}, tensors=(y,)),
                      shape=(2, 4, W)).mb == "a"
    with pytest.raises(BadActivation):
        parse_grad(Message(kind="grad", meta={"mb": "a"}, tensors=(y.half()[:, :2],)),
                   shape=(2, 4, W))


def test_an_ok_reply_s_timings_are_used_only_when_they_make_sense() -> None:
    assert hop_seconds(Message(kind="ok", meta={"service_s": 0.02, "held_s": 0.5}), 0.53) == \
        pytest.approx(0.05)
    for bad in ({}, {"service_s": "x", "held_s": 0.5}, {"service_s": 0.6, "held_s": 0.5},
                {"service_s": 0.1, "held_s": 9.0}, {"service_s": -1, "held_s": 0.5},
                {"service_s": True, "held_s": 0.5}, {"service_s": float("nan"), "held_s": 1}):
        assert hop_seconds(Message(kind="ok", meta=bad), 0.53) == 0.53
    assert hop_seconds(Message(kind="result"), 0.5) == 0.5
    with pytest.raises(BadActivation):
        parse_hop_reply(Message(kind="error"))
    assert parse_hop_reply(Message(**HopReply(service_s=1.0, held_s=2.0).wire())).held_s == 2.0


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(meta=st.dictionaries(st.sampled_from(["mb", "stage", "step", "path", "trainer", "model",
                                             "eval", "other"]), _json, max_size=8))
def test_any_metadata_gives_a_forward_or_a_typed_error(meta: dict[str, Any]) -> None:
    try:
        fwd = parse_forward(Message(kind="forward", meta=meta,
                                    tensors=(torch.randn(1, 2, W),)), EXPECT)
    except (BadActivation, WrongStage, ModelMismatch):
        return
    assert isinstance(fwd, Forward) and len(fwd.path) == 1 and fwd.stage == 1


def test_an_abandon_names_one_microbatch_and_carries_nothing_else() -> None:
    sent = Abandon(mb="t/7")
    got = parse_abandon(Message(**sent.wire()))
    assert got == sent
    assert parse_abandon(Message(kind="abandon", meta={"mb": "t/7", "evil": "x" * 100})) == sent
    for bad in (Message(kind="abandon", meta={}), Message(kind="abandon", meta={"mb": 7}),
                Message(kind="abandon", meta={"mb": "x" * 1000}),
                Message(kind="abandon", meta={"mb": "t/7"}, tensors=(torch.zeros(1),)),
                Message(kind="forward", meta={"mb": "t/7"})):
        with pytest.raises(BadActivation):
            parse_abandon(bad)


@settings(max_examples=200, deadline=None)
@given(meta=st.dictionaries(st.sampled_from(["mb", "other"]), _json, max_size=3))
def test_any_metadata_gives_an_abandon_or_a_typed_error(meta: dict[str, Any]) -> None:
    try:
        got = parse_abandon(Message(kind="abandon", meta=meta))
    except BadActivation:
        return
    assert isinstance(got.mb, str) and got.mb == meta["mb"]
