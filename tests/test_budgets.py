"""Per-peer budgets on the serving side (issue 14 item 2): at most N requests and B tensor
bytes in flight per remote peer, the excess refused at once and counted per reason. The pure
accounting here; a hostile peer flooding a real daemon beside an honest trainer is in
tests/test_penalties_daemons.py."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.budgets import BudgetConfig, PeerBudgets, Ticket, message_bytes
from transport.frames import Message


def test_requests_beyond_the_budget_are_refused_and_counted() -> None:
    b = PeerBudgets(BudgetConfig(max_requests=2, max_bytes=1000))
    t1, t2 = b.admit("x", 10), b.admit("x", 10)
    assert isinstance(t1, Ticket) and isinstance(t2, Ticket)
    assert b.admit("x", 10) == "requests"
    assert isinstance(b.admit("y", 10), Ticket)  # another peer has its own budget
    b.release(t1)
    assert isinstance(b.admit("x", 10), Ticket)
    assert b.refused == {"requests": 1} and b.refused_by_peer == {"x": 1}


def test_bytes_beyond_the_budget_are_refused_but_one_large_request_alone_passes() -> None:
    b = PeerBudgets(BudgetConfig(max_requests=10, max_bytes=100))
    big = b.admit("x", 500)
    assert isinstance(big, Ticket)  # alone: the transport's frame limit bounds it
    assert b.admit("x", 1) == "bytes"
    b.release(big)
    small = b.admit("x", 60)
    assert isinstance(small, Ticket) and b.admit("x", 50) == "bytes"
    assert isinstance(b.admit("x", 40), Ticket) and b.in_flight("x") == (2, 100)
    assert b.refused == {"bytes": 2}


def test_nothing_in_flight_keeps_no_entry() -> None:
    b = PeerBudgets()
    tickets = [b.admit(f"p{i}", 1) for i in range(100)]
    for t in tickets:
        assert isinstance(t, Ticket)
        b.release(t)
    assert b.peers() == [] and b.in_flight("p1") == (0, 0)


def test_config_is_validated_and_defaults_are_generous() -> None:
    cfg = BudgetConfig()
    assert cfg.max_requests >= 16 and cfg.max_bytes >= 256 << 20
    for bad in ({"max_requests": 0}, {"max_bytes": 0}, {"max_requests": 1.5}):
        with pytest.raises(ValueError):
            BudgetConfig(**bad)  # type: ignore[arg-type]


def test_message_bytes_counts_tensor_bytes_and_ignores_what_is_not_a_tensor() -> None:
    m = Message(kind="forward", meta={}, tensors=(torch.zeros(2, 3, 4), torch.zeros(5).half()))
    assert message_bytes(m) == 2 * 3 * 4 * 4 + 5 * 2
    assert message_bytes(object()) == 0
    assert message_bytes(Message(kind="x", meta={}, tensors=("no",))) == 0  # type: ignore


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 300), st.booleans()),
                max_size=200), st.integers(1, 5), st.integers(1, 400))
def test_in_flight_never_exceeds_the_budget_and_releases_add_up(
        ops: list[tuple[str, int, bool]], max_requests: int, max_bytes: int) -> None:
    b = PeerBudgets(BudgetConfig(max_requests=max_requests, max_bytes=max_bytes))
    held: dict[str, list[Ticket]] = {p: [] for p in "abc"}
    rng = random.Random(0)
    for peer, nbytes, release in ops:
        if release and held[peer]:
            b.release(held[peer].pop(rng.randrange(len(held[peer]))))
        else:
            t = b.admit(peer, nbytes)
            if isinstance(t, Ticket):
                held[peer].append(t)
        for p, ts in held.items():
            requests, nb = b.in_flight(p)
            assert requests == len(ts) <= max_requests
            assert nb == sum(t.nbytes for t in ts)
            assert len(ts) <= 1 or nb <= max_bytes
