"""Per-peer budgets on the serving side (issue 14 item 2): at most N requests and B tensor
bytes in flight per remote peer, the excess refused at once and counted per reason. The pure
accounting, then a hostile peer flooding a real daemon beside an honest trainer."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.pipeline.budgets import BudgetConfig, PeerBudgets, Ticket, message_bytes
from swarmd.protocols import Protocols
from transport import identity
from transport.errors import RemoteError, TransportError
from transport.frames import Message
from transport.host import Host, HostOptions
from swarmd.local.zygote import swarmd_popen
from swarmd.models.registry import model_hash_of


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


def test_a_trainer_may_keep_at_most_max_saved_microbatches() -> None:
    b = PeerBudgets(BudgetConfig(max_saved=3))
    assert [b.may_save("t", n) for n in range(4)] == [None, None, None, "saved"]
    assert b.refused == {"saved": 1} and b.refused_by_peer == {"t": 1}


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
    for bad in ({"max_requests": 0}, {"max_bytes": 0}, {"max_requests": 1.5},
                {"max_saved": 0}):
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


# ---- a real daemon flooded by a hostile peer beside an honest trainer ----------------------
ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_MODEL_LAYERS": "2", "SWARMD_DATA_MAX_BYTES": "2000000",
       "SWARMD_SWARM_NAME": "budgets-test", "SWARMD_SWARM_STAGES": "1"}
#: forwards the hostile peer sends at most, and how long it keeps flooding at most (before
#: transport.Host.request freed refused requests' streams, the 257th on waited out its deadline:
#: this test spent two of its 2.5 minutes there)
FLOOD_MAX = 200
FLOOD_S = 400.0
#: seconds between forwards while the budget is full (the flood then covers ~15 s of training
#: with refusals; it keeps the budget full until the trainer is done)
FULL_GAP_S = 0.08
PIPE = Protocols(ENV["SWARMD_SWARM_NAME"]).pipeline()


def _ids(batch: int, tokens: int) -> torch.Tensor:
    """A forward's input at stage 0, which holds the built-in model's embedding: token ids."""
    return torch.randint(0, 256, (batch, tokens), dtype=torch.int32)


def _trainer_row(daemon: Any) -> dict[str, Any] | None:
    rows = daemon.get("/api/v0/swarm").get("excluded", ())
    return next((r for r in rows if r.get("reason") == "no_stage" and r["addrs"]), None)


async def _flood(d0: Any, model: str, trainer: subprocess.Popen[str]
                 ) -> Counter[str]:
    """Forwards naming the hostile peer as their trainer, whose results it never answers (the
    daemon holds each until its hop deadline): they pile up to the budget, then are refused
    busy. Kept up while the honest trainer runs."""
    seen: Counter[str] = Counter()
    release = asyncio.Event()
    held: set[Any] = set()  # results the daemon is waiting on us for, now
    async with Host(identity.generate(), HostOptions(pubsub=None)) as hostile:
        async def on_result(message: Message, peer: str) -> Message:
            held.add(message.meta.get("mb"))
            seen["max_held"] = max(seen["max_held"], len(held))
            try:
                await asyncio.wait_for(release.wait(), 90)
            finally:
                held.discard(message.meta.get("mb"))
            return Message(kind="ok")

        async def forward(i: int) -> None:
            meta = {"mb": f"{hostile.peer_id}/{i}", "stage": 0, "step": 0, "path": [],
                    "trainer": hostile.peer_id, "model": model}
            try:
                await hostile.request(d0.peer_id, PIPE["forward"], Message(
                    kind="forward", meta=meta, tensors=(_ids(2, 16),)),
                    timeout=120)
                seen["ok"] += 1
            except RemoteError as exc:
                budget = exc.code == "busy" and "budget" in exc.remote_message
                seen["busy_budget" if budget else exc.code] += 1
            except TransportError as exc:
                seen[f"transport:{type(exc).__name__}"] += 1

        hostile.set_request_handler(PIPE["result"], on_result)
        await hostile.dial(d0.addr)
        tasks: set[asyncio.Task[None]] = set()
        t0 = time.monotonic()
        limit = BudgetConfig().max_requests
        while trainer.poll() is None and time.monotonic() - t0 < FLOOD_S:
            if len(tasks) >= FLOOD_MAX:  # the held ones keep the budget full meanwhile
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(forward(len(tasks)))
            tasks.add(task)
            # a held one waits on, a refused one ends: the budget fills within a second,
            # however fast the honest trainer is
            await asyncio.wait({task}, timeout=0.02 if len(held) < limit else FULL_GAP_S)
        seen["sent"] = len(tasks)
        release.set()
        await asyncio.wait(tasks, timeout=150)
        for task in tasks:
            task.cancel()
    return seen


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_flooding_peer_gets_busy_and_an_honest_trainer_beside_it_loses_nothing(
        daemons: Any, tmp_path: Path) -> None:
    from daemon_harness import wait_until
    from swarmd.node.home import init_home

    (d0,) = daemons(0)
    config = load_config(None, {**os.environ, **ENV})
    home = tmp_path / "trainer"
    init_home(home)
    log = open(tmp_path / "trainer.stderr", "w")
    trainer = swarmd_popen(
        ["train", "--home", str(home), "--bootstrap", d0.addr,
         "--steps", "60", "--json"], stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, **ENV})
    try:
        wait_until(lambda: _trainer_row(d0), 120, "the trainer in d0's view")
        seen = uvloop.run(asyncio.wait_for(
            _flood(d0, model_hash_of(config), trainer), 600))
        out, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, (tmp_path / "trainer.stderr").read_text()[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["lost"] == 0 and result["final_val_loss"] < result["initial_val_loss"]
        limit = BudgetConfig().max_requests
        assert seen["busy_budget"] >= 1 and 1 <= seen["max_held"] <= limit, seen
        status = d0.get("/api/v0/status")
        assert status["state"] == "online"
        counters = status["counters"]
        assert counters.get("stage.busy_budget.requests", 0) >= 1, counters
        assert sum(v for k, v in counters.items()
                   if k.startswith("stage.busy_budget.")) == seen["busy_budget"]
        rows = {r["peer_id"]: r for r in d0.get("/api/v0/peers")}
        refused = {p: r["budget_refusals"] for p, r in rows.items() if r["budget_refusals"]}
        assert list(refused.values()) == [seen["busy_budget"]]  # the hostile peer alone
        print(f"flood: {dict(seen)}; trainer: lost {result['lost']}, "
              f"restarted {result['restarted']}")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        log.close()


@pytest.mark.integration
def test_a_trainer_that_never_sends_backwards_keeps_at_most_its_saved_budget(
        daemons: Any) -> None:
    """The hostile trainer takes every result and never sends the backward: the daemon keeps
    exactly ``max_saved`` of its microbatches, refuses the next busy at once, and still takes
    another trainer's forwards (the worker's other slots are free)."""
    (d0,) = daemons(0)
    config = load_config(None, {**os.environ, **ENV})
    model = model_hash_of(config)
    limit = BudgetConfig().max_saved

    async def scenario() -> dict[str, list[str]]:
        codes: dict[str, list[str]] = {"hostile": [], "other": []}
        opts = HostOptions(pubsub=None)
        async with Host(identity.generate(), opts) as hostile, \
                Host(identity.generate(), opts) as other:
            async def on_result(message: Message, peer: str) -> Message:
                return Message(kind="ok")

            async def forward(h: Host, i: int) -> str:
                meta = {"mb": f"{h.peer_id}/{i}", "stage": 0, "step": 0, "path": [],
                        "trainer": h.peer_id, "model": model}
                try:
                    await h.request(d0.peer_id, PIPE["forward"], Message(
                        kind="forward", meta=meta, tensors=(_ids(1, 8),)),
                        timeout=60)
                except RemoteError as exc:
                    budget = exc.code == "busy" and "budget" in exc.remote_message
                    return "busy_budget" if budget else exc.code
                return "ok"

            for h in (hostile, other):
                h.set_request_handler(PIPE["result"], on_result)
                await h.dial(d0.addr)
            for i in range(limit + 8):  # one at a time: nothing else limits them
                codes["hostile"].append(await forward(hostile, i))
            for i in range(4):
                codes["other"].append(await forward(other, i))
        return codes

    codes = uvloop.run(asyncio.wait_for(scenario(), 300))
    assert codes["hostile"] == ["ok"] * limit + ["busy_budget"] * 8
    assert codes["other"] == ["ok"] * 4
    counters = d0.get("/api/v0/status")["counters"]
    assert counters["stage.busy_budget.saved"] == 8
    rows = {r["peer_id"]: r for r in d0.get("/api/v0/peers")}
    assert max(r["budget_refusals"] for r in rows.values()) == 8
