"""Penalties that fit the fault (issue 14 item 3): a protocol violation bans longer than a
transport failure, is remembered with its reason (even while the peer is not listed), and one
misbehaving peer never bans the good ones. Pure cores (wiring, penalties) and the router with
a fake host and a virtual clock, then a real daemon's ``/api/v0/peers`` against a hostile
peer built on our own transport."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import pytest
import torch
import uvloop
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarmd.api.types import ConnectedPeer, peer_rows, to_json
from swarmd.config import load_config
from swarmd.errors import BadActivation, NotOnPath, OutputRefused
from swarmd.local.demo import DEMO_ENV
from swarmd.membership import Announcement, PeerState, encode_signed
from swarmd.protocols import Protocols
from swarmd.pipeline.penalties import MAX_REASON_CHARS, ViolationBook, clean_reason
from swarmd.pipeline.router import Verdict, judge
from swarmd.pipeline.wiring import PEER_ROUTING_STATES, Wiring, WiringConfig
from test_router import OK, _router, _send
from transport import identity
from transport.errors import PeerUnavailable, RemoteError
from transport.frames import Message
from transport.host import Host, HostOptions
from transport.signing import signer
from swarmd.models.registry import model_config_of, model_hash_of

PEERS = {"a": (1.0, 0), "b": (1.0, 0), "bad": (1.0, 0)}


async def _code(call: Any) -> str:
    try:
        await call
    except RemoteError as exc:
        return exc.code
    return "ok"


def _state(w: Wiring, peer: str, now: float) -> Any:
    return next(s for s in w.snapshot(now) if s.peer_id == peer)


# ---- the pure cores ------------------------------------------------------------------------
def test_a_violation_bans_longer_than_an_error_and_doubles_up_to_an_hour() -> None:
    cfg = WiringConfig()
    assert cfg.violation_s(1) == 60.0 > cfg.ban_s(1) == 15.0
    assert [cfg.violation_s(n) for n in (2, 3)] == [120.0, 240.0]
    assert cfg.violation_s(50) == 3600.0 and cfg.ban_s(50) == 300.0
    w = Wiring(cfg)
    w.update_peers(PEERS, 0.0)
    w.violation("bad", "backward_shape", 0.0)
    s = _state(w, "bad", 10.0)
    assert s.state == "banned" and s.ban_reason == "violation:backward_shape"
    assert s.ban_left_s == 50.0 and s.violations == 1
    assert {x.state for x in w.snapshot(10.0) if x.peer_id != "bad"} == {"ok"}
    w.violation("bad", "backward_dtype", 30.0)  # during the ban: counted, not lengthened
    s = _state(w, "bad", 30.0)
    assert s.violations == 2 and s.ban_left_s == 30.0 and s.violation_reason == "backward_dtype"
    assert w.choose("forward", 1, 59.0, random.Random(0)) != "bad"
    w.update_peers(PEERS, 60.0)
    assert _state(w, "bad", 60.0).state == "ok"
    assert _state(w, "bad", 60.0).violation_reason == "backward_dtype"  # remembered
    w.violation("bad", "reply", 61.0)  # a second episode: twice as long
    assert _state(w, "bad", 61.0).ban_left_s == 120.0


def test_a_violation_is_not_lifted_by_an_announcement_nor_forgiven_by_a_success() -> None:
    w = Wiring()
    w.update_peers(PEERS, 0.0)
    w.error("a", 0.0)
    w.violation("bad", "shape", 0.0)
    assert w.reannounced("a", 20.0)           # a failure: lifted once ban_base_s is served
    assert not w.reannounced("bad", 20.0)     # a violation: served in full
    assert _state(w, "bad", 20.0).state == "banned"
    w.success("bad", 1, 1.0, "forward", 20.0)  # (a reply to a task sent before the ban)
    assert _state(w, "bad", 20.0).state == "banned"
    assert _state(w, "a", 20.0).ban_reason is None


def test_a_violator_that_leaves_and_comes_back_is_still_banned() -> None:
    w = Wiring()
    w.update_peers(PEERS, 0.0)
    w.violation("bad", "sender", 0.0)
    w.update_peers({"a": (1.0, 0), "b": (1.0, 0)}, 1.0)  # it left
    (gone,) = [s for s in w.snapshot(1.0) if not s.listed]
    assert gone.peer_id == "bad" and gone.state == "banned" and gone.ban_left_s == 59.0
    w.update_peers(PEERS, 2.0)  # and re-announced
    s = _state(w, "bad", 2.0)
    assert s.listed and s.state == "banned" and s.ban_reason == "violation:sender"
    assert all(w.choose("forward", 1, 2.0 + i, random.Random(i)) != "bad" for i in range(50))
    # a violation of a peer never listed is remembered too, and bans it once it is listed
    w.violation("newcomer", "shape", 3.0)
    w.update_peers({**PEERS, "newcomer": (5.0, 0)}, 4.0)
    assert _state(w, "newcomer", 4.0).state == "banned"


def test_snapshot_states_and_error_reasons() -> None:
    w = Wiring()
    w.update_peers({"a": (1.0, 0), "b": (1.0, 0), "c": (1.0, 0), "d": (1.0, 0)}, 0.0)
    w.busy("a", 0.0)
    w.timeout("b", 0.0)
    w.error("c", 0.0, "remote_internal_error")
    states = {s.peer_id: s for s in w.snapshot(0.1)}
    assert [states[p].state for p in "abcd"] == ["paused", "slow", "banned", "ok"]
    assert states["c"].ban_reason == "error:remote_internal_error"
    assert states["c"].violations == 0 and states["d"].ban_left_s is None
    assert set(s.state for s in states.values()) <= set(PEER_ROUTING_STATES)


def test_the_book_is_bounded_and_keeps_reasons_short_and_printable() -> None:
    book = ViolationBook(lambda n: 10.0 * n, capacity=3)
    for i, peer in enumerate("wxyz"):
        book.record(peer, "r", float(i))
    assert len(book) == 3 and "w" not in set(book) and book.forgotten == 1
    assert clean_reason("\x00\n" + "x" * 500) == "x" * (MAX_REASON_CHARS - 2)
    assert clean_reason("\x1b") == "unspecified"


events = st.lists(st.tuples(
    st.sampled_from(["success", "busy", "timeout", "error", "violation", "choose",
                     "update", "leave", "reannounce"]),
    st.booleans(),  # whether the bad peer (True) or a good one is the subject
    st.integers(0, 2),  # which good peer
    st.floats(0.0, 40.0)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(events)
@example([("error", True, 0, 0.0), ("success", False, 0, 15.0), ("error", True, 0, 0.0),
          ("success", False, 0, 30.0), ("error", True, 0, 0.0), ("violation", True, 0, 0.0)])
def test_one_misbehaving_peer_never_bans_the_good_ones(seq: list[Any]) -> None:
    """Good peers only succeed, answer busy or time out; the bad one does anything, a
    violation included, and comes and goes. No good peer is ever banned, one is always chosen
    when none is paused, and the bad one is never chosen during its violation ban."""
    good = ["g0", "g1", "g2"]
    w = Wiring()
    listed = {p: (1.0, 0) for p in [*good, "bad"]}
    now, rng = 0.0, random.Random(0)
    w.update_peers(listed, now)
    violated_until = 0.0
    for what, bad, which, dt in seq:
        now += dt
        peer = "bad" if bad else good[which]
        if what == "update":
            w.update_peers(listed, now)
        elif what == "leave":
            if bad:
                listed.pop("bad", None)
                w.update_peers(listed, now)
        elif what == "reannounce":
            listed["bad"] = (1.0, 0)
            w.update_peers(listed, now)
            w.reannounced(peer, now)
        elif what == "choose":
            got = w.choose("forward", 4, now, rng)
            paused = any(s.busy_until is not None for s in w.snapshot(now) if s.peer_id in good)
            assert got is not None or paused
            assert not (got == "bad" and now < violated_until)
        elif what in ("error", "violation") and not bad:
            continue  # good peers do not fail here
        elif what == "violation":
            before = w.book.banned_until("bad", now)
            w.violation("bad", "shape", now)
            violated_until = before or w.book.banned_until("bad", now) or 0.0
        elif what == "error":
            w.error(peer, now)
        elif what == "success":
            w.success(peer, 4, 0.5, "forward", now)
        else:
            getattr(w, what)(peer, now)
        for s in w.snapshot(now):
            if s.peer_id in good:
                assert s.state != "banned" and s.banned_until is None and s.violations == 0
            elif now < violated_until:
                assert s.state == "banned" and (s.ban_reason or "").startswith("violation:")


# ---- the router ----------------------------------------------------------------------------
def test_judge_calls_a_reply_that_fails_validation_a_violation() -> None:
    assert judge(BadActivation("reply", "not ok")) is Verdict.VIOLATION
    assert judge(NotOnPath("sender", "x")) is Verdict.VIOLATION
    assert judge(PeerUnavailable("x")) is Verdict.BROKEN
    assert judge(RemoteError("busy", "")) is Verdict.BUSY


def test_a_peer_answering_garbage_is_banned_as_a_violator_and_its_stage_mate_takes_over(
        ) -> None:
    garbage = Message(kind="result", meta={})
    router, host, clock = _router({"bad": lambda n: garbage, "good": lambda n: OK},
                                  tput={"bad": 100.0, "good": 1.0})
    for _ in range(5):
        peer, _reply = _send(router)
        assert peer == "good"
    assert host.requests.count("bad") == 1 and router.counters["hop_violation"] == 1
    states = {s.peer_id: s for s in router.wiring.snapshot(clock.now)}
    assert states["bad"].ban_reason == "violation:forward_reply"
    assert 59.0 < states["bad"].ban_left_s <= 60.0 and states["good"].state == "ok"


def test_penalise_charges_only_peers_of_its_stage() -> None:
    router, _host, clock = _router({"a": lambda n: OK, "b": lambda n: OK})
    assert not router.penalise("stranger", "backward_shape")
    assert router.penalise("a", "backward_shape")
    assert asyncio.run(router.send(Message(kind="forward", meta={}, tensors=(
        torch.zeros(1, 1, 1),)), timeout=5.0))[0] == "b"
    names = {s.peer_id: s for s in router.wiring.snapshot(clock.now)}
    assert names["a"].state == "banned" and "stranger" not in names
    assert router.counters["violations"] == 1


def test_peer_rows_join_connections_membership_routing_and_budget_refusals() -> None:
    w = Wiring()
    w.update_peers(PEERS, 0.0)
    w.violation("bad", "backward_shape", 0.0)
    w.violation("gone", "sender", 0.0)  # not listed, not connected: still shown
    rows = {r.peer_id: r for r in peer_rows({"a", "trainer"}, {"a": (1, "online")},
                                            w.snapshot(1.0), {"trainer": 3})}
    assert set(rows) == {"a", "b", "bad", "gone", "trainer"}
    assert rows["a"].connected and rows["a"].routing == "ok" and rows["a"].stage == 1
    assert not rows["bad"].connected and rows["bad"].routing == "banned"
    assert rows["bad"].ban_reason == "violation:backward_shape" and rows["bad"].ban_left_s == 59
    assert rows["gone"].violations == 1 and rows["trainer"].routing is None
    assert rows["trainer"].budget_refusals == 3
    again = [ConnectedPeer.from_json({**to_json(r), "newer": 1}) for r in rows.values()]
    assert again == list(rows.values())


# ---- a real daemon against a hostile stage-1 peer ------------------------------------------
ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "penalties-test"}


@pytest.mark.integration
def test_a_daemon_bans_a_peer_that_sends_a_wrong_shaped_backward_and_shows_why(
        daemons: Any) -> None:
    """The hostile peer announces itself as a stage-1 peer of our model, takes a forward from
    stage 0 and answers it with a backward of the wrong shape: stage 0 bans it as a violator
    (``/api/v0/peers`` says why and for how long), routes to the honest stage-1 peer, which
    stays ok, and goes on serving."""
    from daemon_harness import wait_until

    d0, d1 = daemons(0, 1)

    def d1_online() -> bool:  # (still syncing, d1 takes no forward: a ban of the hostile
        # peer would leave d0 no stage-1 peer, and a forward gets stage_unavailable)
        row = {r["peer_id"]: r for r in d0.get("/api/v0/peers")}.get(d1.peer_id)
        return bool(row) and row["stage"] == 1 and row["state"] == "online" and \
            d0.get("/api/v0/status")["state"] == "online"

    wait_until(d1_online, 60, "d0 to see the honest stage-1 peer d1 online")
    config = load_config(None, {**os.environ, **ENV})
    width, model = model_config_of(config).width, model_hash_of(config)
    proto = Protocols(config.swarm.name)
    pipe = proto.pipeline()
    outcomes: dict[str, list[str]] = {"forwards": [], "backward": []}

    async def scenario() -> None:
        opts = HostOptions(pubsub=None)
        async with Host(identity.generate(), opts) as hostile, \
                Host(identity.generate(), opts) as trainer:
            got, took = asyncio.Event(), asyncio.Event()  # a forward; its backward answered
            sent: list[asyncio.Task[Any]] = []

            async def bad_backward(mb: str) -> None:
                meta = {"mb": mb, "stage": 0, "step": 0, "path": [d0.peer_id, hostile.peer_id],
                        "trainer": trainer.peer_id, "model": model}
                outcomes["backward"].append(await _code(hostile.request(
                    d0.peer_id, pipe["backward"], Message(kind="backward", meta=meta, tensors=(
                        torch.randn(2, 8, width + 1),)), timeout=30)))
                took.set()

            async def on_forward(message: Message, peer: str) -> Message:
                got.set()
                sent.append(asyncio.create_task(bad_backward(message.meta["mb"])))
                return Message(kind="ok")

            async def on_result(message: Message, peer: str) -> Message:
                return Message(kind="ok")

            hostile.set_request_handler(pipe["forward"], on_forward)
            trainer.set_request_handler(pipe["result"], on_result)
            await trainer.dial(d0.addr)
            await trainer.dial(d1.addr)  # connected: d1 reaches it without an announcement
            await hostile.dial(d0.addr)
            # the hostile peer announces stage 1 of our model, 100x faster than anyone
            ann = Announcement(peer_id=hostile.peer_id, addrs=tuple(hostile.addrs)[:8],
                               stage=1, state=PeerState.ONLINE, throughput=1e4, queue=0,
                               version="test", model_hash=model, timestamp=time.time(),
                               period=30.0)
            reply = await hostile.request(d0.peer_id, proto.announce, Message(
                kind="announce", meta={"a": encode_signed(ann, signer(hostile.identity))}))
            assert reply.meta["outcome"] == "added"
            for i in range(8):  # the hostile peer is chosen first (fastest), or soon after
                meta = {"mb": f"{trainer.peer_id}/{i}", "stage": 0, "step": 0, "path": [],
                        "trainer": trainer.peer_id, "model": model}
                outcomes["forwards"].append(await _code(trainer.request(
                    d0.peer_id, pipe["forward"], Message(kind="forward", meta=meta, tensors=(
                        torch.randint(0, 256, (2, 8), dtype=torch.int32),)),  # token ids
                    timeout=60)))
                if got.is_set():
                    await asyncio.wait_for(took.wait(), 30)
            await asyncio.gather(*sent)

    uvloop.run(asyncio.wait_for(scenario(), 150))
    rows = {r["peer_id"]: r for r in d0.get("/api/v0/peers")}
    assert outcomes["forwards"] == ["ok"] * 8, rows
    assert outcomes["backward"] == ["bad_activation"], rows  # banned after its first
    bad = next(r for r in rows.values() if r["routing"] == "banned")
    assert bad["ban_reason"] == "violation:backward_shape" and bad["violations"] == 1
    assert 0 < bad["ban_left_s"] <= 60 and bad["stage"] == 1
    assert rows[d1.peer_id]["routing"] == "ok" and rows[d1.peer_id]["violations"] == 0
    assert [r["peer_id"] for r in rows.values() if r["routing"] is not None] == sorted(
        [bad["peer_id"], d1.peer_id])
    status = wait_until(lambda: d0.get("/api/v0/status"), 10, "d0's status")
    assert status["state"] == "online"
    assert status["counters"]["stage.penalised.backward_shape"] == 1
    assert status["counters"]["stage.violations"] == 1


def test_a_peer_refusing_what_its_stage_mate_takes_is_banned_not_believed() -> None:
    """A hostile next-stage peer answering ``bad_activation`` would make us raise
    ``OutputRefused``, and our senders ban us for it: a second peer decides."""
    liar = RemoteError("bad_activation", "not finite (a lie)")
    router, host, clock = _router({"liar": lambda n: liar, "good": lambda n: OK},
                                  tput={"liar": 100.0, "good": 1.0})
    assert _send(router)[0] == "good"
    assert host.requests == ["liar", "good"] and router.counters["false_refusals"] == 1
    states = {s.peer_id: s for s in router.wiring.snapshot(clock.now)}
    assert states["liar"].ban_reason == "error:refused_forward_others_took"
    assert states["good"].state == "ok"


def test_a_refusal_two_peers_agree_on_is_ours_and_bans_nobody() -> None:
    refuse = RemoteError("bad_activation", "nan")
    router, host, _ = _router({"a": lambda n: refuse, "b": lambda n: refuse, "c": lambda n: OK},
                              tput={"a": 100.0, "b": 50.0, "c": 1.0})
    with pytest.raises(OutputRefused):
        _send(router)
    assert host.requests == ["a", "b"] and router.wiring.banned == 0


@pytest.mark.integration
def test_the_trainer_bans_a_stage_peer_that_answers_with_a_wrong_shape() -> None:
    """In this process over real libp2p: a one-stage swarm whose peer sends its result once
    with a wrong shape, then right; the trainer takes the right one and bans that peer as a
    violator in its wiring."""
    from swarmd.trainer.trainer import Trainer
    from swarmd.models.gpt import ModelConfig
    from transport.codecs import CodecSpec

    cfg = ModelConfig(width=32, heads=2, layers=2, seq_len=16)
    opts = HostOptions(pubsub=None, codec=CodecSpec(name="none"))
    proto = Protocols("penalties-inproc").pipeline()

    async def scenario() -> Any:
        async with Host(identity.generate(), opts) as h, Host(identity.generate(), opts) as t:
            table = {0: {h.peer_id: (1.0, 0, tuple(h.addrs))}}
            trainer = Trainer(t, swarm="penalties-inproc", num_stages=1, model_config=cfg,
                              model_hash=cfg.model_hash(), codec=opts.codec, lr=1e-3, seed=0,
                              peers_of=lambda s: table.get(s, {}))
            trainer.start()
            codes: list[str] = []

            async def on_forward(message: Message, peer: str) -> Message:
                # the only stage holds the embedding: token ids in, activations out
                mb, ids = message.meta["mb"], message.tensors[0]
                x = torch.randn(*ids.shape, cfg.width)
                for y in (x[:, :-1], x):
                    codes.append(await _code(h.request(t.peer_id, proto["result"], Message(
                        kind="result", meta={"mb": mb, "path": [h.peer_id]}, tensors=(y,)),
                        timeout=30)))
                return Message(kind="ok")

            async def on_backward(message: Message, peer: str) -> Message:
                empty = torch.zeros(*message.tensors[0].shape[:2], 0)  # no gradient to ids
                await h.request(t.peer_id, proto["grad"], Message(
                    kind="grad", meta={"mb": message.meta["mb"]}, tensors=(empty,)),
                    timeout=30)
                return Message(kind="ok")

            h.set_request_handler(proto["forward"], on_forward)
            h.set_request_handler(proto["backward"], on_backward)
            x = torch.randint(0, 256, (2, 16))
            await trainer.accumulate([(x, x)])
            rows = trainer.wiring.snapshot(time.monotonic())
            trainer.close()
            return codes, rows, trainer.stats

    codes, rows, stats = uvloop.run(asyncio.wait_for(scenario(), 60))
    assert codes == ["bad_activation", "ok"] and stats.lost == 0
    (row,) = rows
    assert row.state == "banned" and row.ban_reason == "violation:result_shape"


def test_swarmd_peers_prints_routing_states_and_bans_with_their_reason() -> None:
    from swarmd.cli.client import text_peers

    text = text_peers([
        ConnectedPeer(peer_id="a", stage=1, state="online", routing="ok"),
        ConnectedPeer(peer_id="b", stage=1, state="online", connected=False, routing="banned",
                      ban_reason="violation:backward_shape", ban_left_s=42.2, violations=1),
        ConnectedPeer(peer_id="t")])
    lines = text.splitlines()
    assert lines[0].split() == ["PEER", "ID", "STAGE", "STATE", "ROUTING"]
    assert lines[2].split()[3:] == ["banned", "(violation:backward_shape,", "42", "s", "left)"]
    assert lines[3].split() == ["t", "-", "-", "-"]
    assert lines[-1] == "2 connected peers, 1 more our router knows"
