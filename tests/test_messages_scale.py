"""The loss scale and overflow flag of backward and grad messages: they survive the wire and
the next hop, and bad values are refused with a typed error."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from swarmd.errors import BadActivation
from swarmd.pipeline.messages import (MAX_SCALE, MIN_SCALE, Backward, Expect, Grad,
                                      parse_backward, parse_grad)
from transport.frames import Message

EXPECT = Expect(stage=1, num_stages=2, model="m", width=4, max_tokens=64)


def _backward(**over) -> Backward:  # type: ignore[no-untyped-def]
    args = dict(mb="t/1", stage=1, step=0, path=("a", "b"), trainer="t", model="m",
                grad=torch.zeros(1, 2, 4))
    return Backward(**(args | over))


@given(st.floats(MIN_SCALE, MAX_SCALE), st.booleans())
def test_scale_and_overflow_survive_the_wire_and_the_next_hop(scale: float,
                                                               overflow: bool) -> None:
    got = parse_backward(Message(**_backward(scale=scale, overflow=overflow).wire()), EXPECT)
    assert got.scale == scale and got.overflow is overflow
    hop = got.previous_hop(torch.zeros(1, 2, 4))
    assert hop.scale == scale and hop.overflow is overflow
    assert got.previous_hop(torch.zeros(1, 2, 4), overflow=True).overflow


def test_an_unscaled_backward_says_nothing_and_reads_as_scale_one() -> None:
    wire = _backward().wire()
    assert "scale" not in wire["meta"] and "overflow" not in wire["meta"]
    got = parse_backward(Message(**wire), EXPECT)
    assert got.scale == 1.0 and not got.overflow


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, MAX_SCALE * 2, True, "2", None])
def test_a_bad_scale_is_refused(bad: object) -> None:
    wire = _backward().wire()
    wire["meta"]["scale"] = bad
    with pytest.raises(BadActivation, match="scale"):
        parse_backward(Message(**wire), EXPECT)


@pytest.mark.parametrize("bad", [1, "yes", None, [True]])
def test_a_bad_overflow_flag_is_refused(bad: object) -> None:
    wire = _backward().wire()
    wire["meta"]["overflow"] = bad
    with pytest.raises(BadActivation, match="overflow"):
        parse_backward(Message(**wire), EXPECT)
    grad = Grad(mb="t/1", grad=torch.zeros(1, 2, 4)).wire()
    grad["meta"]["overflow"] = bad
    with pytest.raises(BadActivation, match="overflow"):
        parse_grad(Message(**grad), shape=(1, 2, 4))
    assert parse_grad(Message(**Grad(mb="t/1", grad=torch.zeros(1, 2, 4),
                                     overflow=True).wire()), shape=(1, 2, 4)).overflow
