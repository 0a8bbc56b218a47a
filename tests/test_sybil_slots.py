"""Sybil saved slots (issue 14): several hostile identities fill a stage worker's 64 saved
slots with forwards never followed by a backward; an honest trainer's forwards still get slots
(``swarmd.pipeline.slots.SlotShares``: the slot of an owner that does not answer, or of one
over its fair share, is taken once it is ``min_age_s`` old). Pure rule: unit + hypothesis;
then hostile peers on our own transport against a real ``swarmd join`` daemon."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import torch
import uvloop
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.pipeline.budgets import BudgetConfig
from swarmd.pipeline.slots import MIN_AGE_S, Held, SlotShares
from swarmd.protocols import Protocols
from transport import identity
from transport.errors import RemoteError
from transport.frames import Message
from transport.host import Host, HostOptions
from swarmd.models.registry import model_config_of, model_hash_of


def _held(owner: str, n: int, since: float, start: int = 0) -> list[Held]:
    return [Held(f"{owner}/{i}", owner, since) for i in range(start, start + n)]


# ---- the rule ---------------------------------------------------------------------------------

def test_nothing_is_taken_while_the_worker_has_room() -> None:
    shares = SlotShares(4, min_age_s=10)
    assert shares.victim("h", _held("x", 3, 0.0), 100.0) is None


def test_a_silent_owner_s_oldest_ripe_slot_is_taken_but_never_a_young_one() -> None:
    shares = SlotShares(4, min_age_s=10)
    held = _held("x", 2, 5.0) + [Held("x/old", "x", 1.0)] + _held("y", 1, 2.0)
    assert shares.victim("h", held, 10.0) is None          # all younger than 10 s
    assert shares.victim("h", held, 11.5) == "x/old"        # the oldest ripe one
    shares.answered("x", 11.0)                               # x answers: y is the silent one
    assert shares.victim("h", held, 12.5) == "y/0"
    assert shares.victim("x", _held("x", 4, 0.0), 50.0) is None  # never its own


def test_an_owner_under_its_fair_share_takes_from_the_one_holding_most_when_all_answer() -> None:
    shares = SlotShares(6, min_age_s=1)
    for owner in ("a", "b", "h"):
        shares.answered(owner, 0.0)
    held = _held("a", 4, 0.0) + _held("b", 2, 0.0)
    assert shares.victim("h", held, 5.0) == "a/0"           # share 6 // 3 = 2, a holds 4
    held = _held("a", 3, 0.0) + _held("h", 3, 0.0)
    assert shares.victim("h", held, 5.0) is None             # h holds its share (3) already
    held = _held("a", 2, 0.0) + _held("b", 2, 0.0) + _held("h", 2, 0.0)
    assert shares.victim("h", held, 5.0) is None             # everyone at its share
    assert shares.victim("h", held, 100.0) == "a/0"          # 60 s later nobody answers


def test_answers_are_remembered_for_a_while_and_for_a_bounded_number_of_owners() -> None:
    shares = SlotShares(2, answered_s=60, max_owners=3)
    shares.answered("a", 0.0)
    assert shares.answers("a", 60.0) and not shares.answers("a", 60.5)
    for owner in "bcd":
        shares.answered(owner, 1.0)
    assert not shares.answers("a", 2.0) and shares.answers("d", 2.0)
    with pytest.raises(ValueError):
        SlotShares(0)


_owners = st.sampled_from(["a", "b", "c", "h"])


@settings(max_examples=400, deadline=None)
@example(slots=[("a", 0.0), ("a", 0.0), ("c", 1.0)], answering={"a"}, requester="b", now=10.0)
@given(slots=st.lists(st.tuples(_owners, st.floats(0, 100)), min_size=1, max_size=12),
       answering=st.sets(_owners), requester=_owners, now=st.floats(0, 200))
def test_a_victim_is_always_another_owner_s_ripe_slot_and_a_share_is_respected(
        slots: list[tuple[str, float]], answering: set[str], requester: str,
        now: float) -> None:
    shares = SlotShares(len(slots), min_age_s=10, answered_s=1e9)
    for owner in answering:
        shares.answered(owner, 0.0)
    held = [Held(f"{o}/{i}", o, t) for i, (o, t) in enumerate(slots)]
    victim = shares.victim(requester, held, now)
    if victim is None:
        return
    taken = next(h for h in held if h.mb == victim)
    assert taken.owner != requester and now - taken.since >= 10
    if taken.owner in answering:  # an answering owner loses a slot only above its share
        counts = {o: sum(h.owner == o for h in held) for o in {h.owner for h in held}}
        share = len(held) // len(counts.keys() | {requester})
        assert counts[taken.owner] > share and counts.get(requester, 0) < share
        # and no silent owner had a ripe slot (a silent owner's unripe slot is not takeable)
        assert all(h.owner in answering for h in held
                   if h.owner != requester and now - h.since >= 10)


@settings(max_examples=200, deadline=None)
@given(hostile=st.integers(1, 8), capacity=st.integers(2, 64))
def test_an_honest_trainer_gets_slots_whatever_the_number_of_silent_identities(
        hostile: int, capacity: int) -> None:
    """Silent identities fill every slot; an honest trainer asking again and again (time going
    on) takes a slot each time once theirs are ripe, until it holds as many as it asks for."""
    shares = SlotShares(capacity, min_age_s=10)
    held = [Held(f"s{i % hostile}/{i}", f"s{i % hostile}", 0.0) for i in range(capacity)]
    want = max(1, capacity // 2)
    for k in range(want):
        victim = shares.victim("h", held, 20.0 + k)
        assert victim is not None and not victim.startswith("h/")
        held = [h for h in held if h.mb != victim] + [Held(f"h/{k}", "h", 20.0 + k)]
        shares.answered("h", 20.0 + k)
    assert sum(h.owner == "h" for h in held) == want


# ---- hostile identities against a real daemon -------------------------------------------------

ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_MODEL_LAYERS": "2", "SWARMD_DATA_MAX_BYTES": "2000000",
       "SWARMD_SWARM_NAME": "sybil-test", "SWARMD_SWARM_STAGES": "1"}
PIPE = Protocols(ENV["SWARMD_SWARM_NAME"]).pipeline()
#: how long the honest trainer asks again at most (the hostile slots ripen in 10 s)
HONEST_WITHIN_S = 90.0


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_hostile_identities_filling_every_saved_slot_do_not_lock_an_honest_trainer_out(
        daemons: Any) -> None:
    """Two hostile identities each keep their whole budget (32) of forwards never followed by
    a backward: the worker's 64 slots are full. An honest trainer is refused busy at first,
    then (the hostile slots ripe) its forwards take their slots, one each; its backward works;
    a hostile microbatch whose slot was taken gets unknown_microbatch."""
    (d0,) = daemons(0)
    config = load_config(None, {**os.environ, **ENV})
    model, width = model_hash_of(config), model_config_of(config).width
    per = BudgetConfig().max_saved

    async def scenario() -> dict[str, Any]:
        opts = HostOptions(pubsub=None)
        out: dict[str, Any] = {"hostile": [], "honest": [], "first_honest": None}
        async with Host(identity.generate(), opts) as h1, \
                Host(identity.generate(), opts) as h2, \
                Host(identity.generate(), opts) as honest:
            async def on_result(message: Message, peer: str) -> Message:
                return Message(kind="ok")

            async def call(h: Host, kind: str, i: int, tensor: torch.Tensor) -> str:
                meta = {"mb": f"{h.peer_id}/{i}", "stage": 0, "step": 0, "path": [],
                        "trainer": h.peer_id, "model": model}
                if kind == "backward":
                    meta["path"] = [d0.peer_id]
                try:
                    await h.request(d0.peer_id, PIPE[kind], Message(
                        kind=kind, meta=meta, tensors=(tensor,)), timeout=60)
                except RemoteError as exc:
                    return exc.code
                return "ok"

            x = torch.randint(0, 256, (1, 8), dtype=torch.int32)  # stage 0 takes token ids
            for h in (h1, h2, honest):
                h.set_request_handler(PIPE["result"], on_result)
                h.set_request_handler(PIPE["grad"], on_result)
                await h.dial(d0.addr)
            t0 = time.monotonic()
            for h in (h1, h2):
                for i in range(per):
                    out["hostile"].append(await call(h, "forward", i, x))
            out["fill_s"] = time.monotonic() - t0
            out["first_honest"] = await call(honest, "forward", 0, x)
            deadline = time.monotonic() + HONEST_WITHIN_S
            for i in range(1, 5):  # each asked again (bounded) until a slot is taken for it
                code = "busy"
                while code == "busy" and time.monotonic() < deadline:
                    code = await call(honest, "forward", i, x)
                    if code == "busy":
                        await asyncio.sleep(0.5)  # backoff between asks, not a wait for a state
                out["honest"].append(code)
            out["honest_backward"] = await call(honest, "backward", 1, torch.randn(1, 8, width))
            # the oldest hostile microbatch's slot was taken first
            out["evicted_backward"] = await call(h1, "backward", 0, torch.randn(1, 8, width))
        return out

    out = uvloop.run(asyncio.wait_for(scenario(), 240))
    assert out["hostile"] == ["ok"] * (2 * per), out["hostile"]
    if out["fill_s"] < 0.8 * MIN_AGE_S:  # full, and no hostile slot ripe yet
        assert out["first_honest"] == "busy", out
    assert out["honest"] == ["ok"] * 4, out
    assert out["honest_backward"] == "ok"
    assert out["evicted_backward"] == "unknown_microbatch"
    status = d0.get("/api/v0/status")
    assert status["state"] == "online"
    assert status["counters"]["stage.saved_evicted"] == 4
