"""The typed messages of rounds and all-reduce (swarmd/averaging/messages.py), and who may send
them to a stage (StageSync's authority rules, over a fake host: no network)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.averaging import messages as m
from swarmd.averaging.plan import BadAllReduceMessage, RoundPlan, parse_part
from swarmd.averaging.stage_sync import RoundRefused, StageSync
from swarmd.averaging.trigger import RoundTrigger
from swarmd.errors import BadPeerMessage, BadRoundMessage
from transport.frames import Message

DIGEST = "0123456789abcdef"

# ---- parsing ---------------------------------------------------------------------------------


def test_a_start_is_parsed_and_unknown_keys_are_dropped() -> None:
    start = m.parse_round("start", {"stage": 1, "step": 3, "round": "1:3:ab", "group": ["a", "b"],
                                    "bandwidths": [None, 5e6], "evil": "x" * 1000})
    assert start == m.Start(stage=1, step=3, round_id="1:3:ab", group=("a", "b"),
                            bandwidths=(None, 5e6))
    again = m.parse_round("start", start.to_meta())
    assert again == start


@pytest.mark.parametrize("kind,meta,reason", [
    ("progress", {"stage": 1, "step": 0, "samples": -1}, "bad_samples"),
    ("progress", {"stage": 1, "step": 0, "samples": True}, "bad_samples"),
    ("progress", {"stage": 1, "step": 0, "samples": 2.5}, "bad_samples"),
    ("progress", {"stage": 1, "step": -1, "samples": 1}, "bad_step"),
    ("prepare", {"stage": "1", "step": 0}, "bad_stage"),
    ("start", {"stage": 1, "step": 0, "round": "", "group": ["a", "b"],
               "bandwidths": [1, 1]}, "bad_round_id"),
    ("start", {"stage": 1, "step": 0, "round": "r", "group": ["a", "a"],
               "bandwidths": [1, 1]}, "bad_group"),
    ("start", {"stage": 1, "step": 0, "round": "r", "group": ["a"], "bandwidths": [1]},
     "bad_group"),
    ("start", {"stage": 1, "step": 0, "round": "r", "group": ["a", 7], "bandwidths": [1, 1]},
     "bad_group"),
    ("start", {"stage": 1, "step": 0, "round": "r", "group": ["a", "b"], "bandwidths": [1]},
     "bad_bandwidths"),
    ("start", {"stage": 1, "step": 0, "round": "r", "group": "ab", "bandwidths": [1, 1]},
     "bad_group"),
    ("finish", {"stage": 1, "step": 0}, "unknown_kind"),
])
def test_malformed_round_messages_raise_the_typed_error(kind: str, meta: dict[str, Any],
                                                        reason: str) -> None:
    with pytest.raises(BadRoundMessage) as info:
        m.parse_round(kind, meta)
    assert info.value.reason == reason


def test_a_bandwidth_that_is_not_a_usable_number_is_unknown_not_an_error() -> None:
    start = m.parse_round("start", {"stage": 0, "step": 0, "round": "r", "group": ["a", "b"],
                                    "bandwidths": [float("nan"), "fast"]})
    assert isinstance(start, m.Start) and start.bandwidths == (None, None)


def test_a_prepare_reply_needs_a_step_and_a_boolean_free() -> None:
    assert m.parse_prepare_reply("ok", {"step": 2, "free": True, "bandwidth": -1}) == \
        m.PrepareReply(step=2, free=True, bandwidth=None)
    for meta in ({"step": 2, "free": 1}, {"step": "2", "free": True}, {}):
        with pytest.raises(BadRoundMessage):
            m.parse_prepare_reply("ok", meta)


def test_a_progress_reply_says_the_leaders_step_or_nothing() -> None:
    assert m.parse_progress_reply("ok", {"step": 7}) == m.ProgressReply(step=7)
    assert m.parse_progress_reply("ok", {}) == m.ProgressReply(step=None)  # an older peer
    for kind, meta in (("ok", {"step": -1}), ("ok", {"step": True}), ("ok", {"step": 2.5}),
                       ("ok", {"step": 1 << 60}), ("err", {"step": 1})):
        with pytest.raises(BadRoundMessage):
            m.parse_progress_reply(kind, meta)


def test_an_all_reduce_request_is_typed_and_waits_are_capped() -> None:
    t = torch.zeros(4)
    c = m.parse_request("contribute", {"r": "x", "d": DIGEST, "u": 0, "t": 1e9, "w": 3,
                                       "junk": 1}, (t,), max_wait=120)
    assert isinstance(c, m.Contribute) and c.wait == 120 and c.weight == 3
    p = m.parse_request("probe", {"r": "x", "d": DIGEST, "u": 1, "t": 5, "e": 1, "g": 50}, (),
                        max_wait=120)
    assert isinstance(p, m.Probe) and p.hold == 5


@pytest.mark.parametrize("kind,meta,tensors,reason", [
    ("contribute", {"r": "x", "d": DIGEST, "u": 0, "t": 1, "w": float("nan")},
     (torch.zeros(2),), "bad_contribution"),
    ("contribute", {"r": "x", "d": DIGEST, "u": 0, "t": 1, "w": 1},
     (torch.zeros(2, dtype=torch.float64),), "bad_contribution"),
    ("contribute", {"r": "x", "d": DIGEST, "u": 0, "t": 1, "w": 1}, (), "bad_contribution"),
    ("contribute", {"r": "x", "d": "short", "u": 0, "t": 1, "w": 1}, (torch.zeros(2),),
     "bad_meta"),
    ("probe", {"r": "x", "d": DIGEST, "u": 0, "t": 1, "e": 0}, (), "bad_epoch"),
    ("repair", {"r": "x", "d": DIGEST, "u": -1, "t": 1, "e": 1}, (), "bad_meta"),
    ("repair", {"r": "x", "d": DIGEST, "u": 0, "t": 1, "e": 1}, (torch.zeros(1),),
     "unexpected_tensors"),
    ("gossip", {"r": "x", "d": DIGEST, "u": 0, "t": 1}, (), "unknown_kind"),
])
def test_malformed_all_reduce_requests_raise_the_typed_error(kind: str, meta: dict[str, Any],
                                                             tensors: tuple[Any, ...],
                                                             reason: str) -> None:
    with pytest.raises(BadAllReduceMessage) as info:
        m.parse_request(kind, meta, tensors, max_wait=10)
    assert info.value.reason == reason


def test_a_contribution_reply_needs_the_units_length_and_a_sane_weight() -> None:
    ok = m.parse_contribution("contribution", {"w": 2}, (torch.zeros(3),), length=3,
                              max_weight=10)
    assert ok.weight == 2.0
    with pytest.raises(BadAllReduceMessage):
        m.parse_contribution("contribution", {"w": 2}, (torch.zeros(4),), length=3,
                             max_weight=10)
    with pytest.raises(BadAllReduceMessage) as info:
        m.parse_contribution("contribution", {"w": 11}, (torch.zeros(3),), length=3,
                             max_weight=10)
    assert info.value.reason == "bad_weight"


def test_a_part_claiming_more_weight_than_the_group_could_hold_is_refused() -> None:
    plan = RoundPlan.build("r", ["a", "b"], 8, parts=[4, 4])
    assert parse_part(plan, 0, "part", {"e": 0, "W": 20, "c": [0, 1]}, (torch.zeros(4),),
                      max_weight=10).weight == 20
    with pytest.raises(BadAllReduceMessage):
        parse_part(plan, 0, "part", {"e": 0, "W": 21, "c": [0, 1]}, (torch.zeros(4),),
                   max_weight=10)


_plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats()
                      | st.text(max_size=20),
                      lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_keys = st.sampled_from(["stage", "step", "samples", "round", "group", "bandwidths", "r", "d",
                         "u", "t", "w", "e", "g", "free", "bandwidth", "W", "c"])
_metas = st.dictionaries(_keys | st.text(max_size=6), _plain, max_size=10)
_tensors = st.lists(st.sampled_from([torch.zeros(3), torch.zeros(2, 2),
                                     torch.zeros(3, dtype=torch.int64)]), max_size=2)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(["progress", "prepare", "start", "contribute", "probe", "repair",
                             "part", "contribution", "ok", "x"]),
       meta=_metas, tensors=_tensors)
def test_arbitrary_well_framed_metadata_raises_only_the_typed_error(
        kind: str, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    plan = RoundPlan.build("r", ["a", "b", "c"], 9, parts=[3, 3, 3])
    calls = [lambda: m.parse_round(kind, meta, tensors),
             lambda: m.parse_prepare_reply(kind, meta),
             lambda: m.parse_progress_reply(kind, meta),
             lambda: m.parse_request(kind, meta, tensors, max_wait=30),
             lambda: m.parse_contribution(kind, meta, tensors, length=3, max_weight=64),
             lambda: parse_part(plan, 0, kind, meta, tensors, max_weight=64)]
    for call in calls:
        try:
            value = call()
        except BadPeerMessage:
            continue
        # whatever was accepted is in range
        for name in ("step", "samples", "weight", "wait", "unit", "epoch"):
            v = getattr(value, name, 0)
            if v is None and isinstance(value, m.ProgressReply):
                continue  # a leader that does not say its step
            assert v is not None and not isinstance(v, bool) and 0 <= v < math.inf


# ---- who may send what (StageSync over a fake host) ----------------------------------------

class FakeHost:
    peer_id = "m"
    #: the peers that answer a ping
    alive: set[str] = {"a", "b", "z"}

    async def ensure_connected(self, peer: str, *a: Any, **k: Any) -> bool:
        return peer in self.alive

    async def ping(self, peer: str, **k: Any) -> float:
        return 0.001

    def set_request_handler(self, *a: Any, **k: Any) -> None:
        pass

    def remove_handler(self, *a: Any) -> None:
        pass


def make_sync(mates: dict[str, tuple[str, ...]], me: str = "m", heard: bool = True
              ) -> tuple[StageSync, list[Any]]:
    """``heard``: every mate answered this peer before (a stage that has run a while)."""
    behind: list[Any] = []

    async def snapshot() -> tuple[torch.Tensor, int]:
        return torch.zeros(4), 1

    async def nothing(*a: Any) -> None:
        pass

    host = FakeHost()
    host.peer_id = me
    trigger = RoundTrigger(me=me, target=8, heard=set(mates) if heard else set())
    sync = StageSync(host, swarm="t", stage=1, trigger=trigger,
                     averager=None, mates=lambda: mates, snapshot=snapshot, apply=nothing,
                     give_back=nothing, on_behind=lambda p, s: behind.append((p, s)),
                     samples_now=lambda: 0)
    return sync, behind


def start_meta(group: list[str], step: int = 0) -> dict[str, Any]:
    return {"stage": 1, "step": step, "round": "1:0:x", "group": group,
            "bandwidths": [None] * len(group)}


async def _serve(sync: StageSync, kind: str, meta: dict[str, Any], peer: str) -> str:
    try:
        reply = await sync._serve(Message(kind=kind, meta=meta), peer)
    except (BadRoundMessage, RoundRefused) as exc:
        return getattr(exc, "reason", exc.code)
    await asyncio.sleep(0)
    return reply.kind


@pytest.mark.parametrize("peer,group,expected", [
    ("outsider", ["a", "m", "outsider"], "not_a_mate"),   # not a peer of the stage
    ("b", ["a", "b", "m"], "not_leader"),                  # a mate, but "a" leads
    ("a", ["a", "m", "zz"], "group_not_mates"),            # the leader names a stranger
    ("a", ["a", "b"], "bad_group"),                        # without this peer
    ("a", ["a", "m"], "ok"),                               # the leader
])
def test_a_start_is_taken_only_from_the_leader_with_a_group_of_mates(
        peer: str, group: list[str], expected: str) -> None:
    sync, _ = make_sync({"a": (), "b": ()})

    async def scenario() -> str:
        got = await _serve(sync, "start", start_meta(group), peer)
        await sync.close()
        return got

    assert asyncio.run(scenario()) == expected
    refused = sum(v for k, v in sync.counters.items() if k.startswith("bad_requests."))
    assert refused == (0 if expected == "ok" else 1)


class _Declines:
    """An averager that records the rounds declined and fails every round it is given."""

    def __init__(self) -> None:
        self.declined: list[str] = []

    def decline(self, round_id: str) -> None:
        self.declined.append(round_id)

    async def all_reduce(self, *a: Any, **k: Any) -> Any:
        from swarmd.averaging.allreduce import AllReduceFailed
        raise AllReduceFailed("not here")


@pytest.mark.parametrize("peer,group,expected", [
    ("b", ["a", "b", "m"], "not_leader"),
    ("a", ["a", "m", "zz"], "group_not_mates"),
    ("outsider", ["a", "m", "outsider"], "not_a_mate"),
    ("a", ["a", "m"], "ok"),
])
def test_a_refused_start_declines_its_round_and_a_taken_one_does_not(
        peer: str, group: list[str], expected: str) -> None:
    """A start this peer refuses is a round it never joins: its averager refuses the round's
    messages at once (``RoundTable.decline``), so the members repair its part now."""
    sync, _ = make_sync({"a": (), "b": ()})
    averager = sync.averager = _Declines()  # type: ignore[assignment]

    async def scenario() -> str:
        got = await _serve(sync, "start", start_meta(group), peer)
        for _ in range(20):
            await asyncio.sleep(0)
        await sync.close()
        return got

    assert asyncio.run(scenario()) == expected
    assert averager.declined == ([] if expected == "ok" else ["1:0:x"])
    assert sync.counters["starts_declined"] == (0 if expected == "ok" else 1)


def test_a_start_from_a_stranger_is_refused_whatever_its_id_and_its_group_is_heard_from() -> None:
    """A mate that never answered this peer does not lead it, however its id sorts (a liar
    that takes round messages and never answers would start rounds with a silent group);
    once heard from it does, and the members of a round taken count as heard from."""
    sync, _ = make_sync({"a": (), "b": (), "c": ()}, heard=False)

    async def scenario() -> tuple[str, str]:
        refused = await _serve(sync, "start", start_meta(["a", "m"]), "a")
        sync.trigger.heard_from(["a"])
        taken = await _serve(sync, "start", start_meta(["a", "c", "m"]), "a")
        await sync.close()
        return refused, taken

    assert asyncio.run(scenario()) == ("not_leader", "ok")
    assert sync.trigger.heard == {"a", "c"}


def test_a_start_from_the_next_mate_is_taken_once_the_smaller_ones_do_not_answer() -> None:
    sync, _ = make_sync({"a": (), "b": ()})
    sync.host.alive = {"b"}  # "a" just died: this peer does not suspect it yet

    async def scenario() -> str:
        got = await _serve(sync, "start", start_meta(["b", "m"]), "b")
        await sync.close()
        return got

    assert asyncio.run(scenario()) == "ok"
    assert "a" in sync.trigger.suspects and sync.counters["mates_unreachable"] == 1


@pytest.mark.parametrize("listed_elsewhere,expected", [(True, "ok"), (False, "not_leader")])
def test_a_leader_that_moved_to_another_stage_is_no_mate_here(listed_elsewhere: bool,
                                                               expected: str) -> None:
    """"a" led (the smallest id) and moved to another stage; "b" now starts the rounds. A
    mate the view lists elsewhere is forgotten at once, and "b"'s start is taken; one that
    only dropped out of the view stays a mate for the grace (a lagging view), alive, so
    "b" does not lead yet. Before, a mover with the smallest id was still its old stage's
    leader for a minute, and that stage's rounds were refused meanwhile."""
    mates = {"a": (), "b": ()}
    sync, _ = make_sync(mates)
    sync.known_mates()  # "a" listed once
    del mates["a"]
    sync.moved = lambda: {"a"} if listed_elsewhere else set()

    async def scenario() -> str:
        got = await _serve(sync, "start", start_meta(["b", "m"]), "b")
        await sync.close()
        return got

    assert asyncio.run(scenario()) == expected
    assert ("a" in sync.known_mates()) is not listed_elsewhere
    assert sync.counters["mates_moved_away"] == int(listed_elsewhere)


def test_a_suspected_leader_still_may_start_and_a_follower_becomes_one() -> None:
    t = RoundTrigger(me="m", target=4, heard={"a", "b", "c"})
    t.suspect("a", 0.0)
    assert t.may_lead("a", ["a", "b"], 1.0)      # the smallest id, though suspected here
    assert t.may_lead("b", ["a", "b"], 1.0)      # the leader by this peer's suspicions
    assert not t.may_lead("c", ["a", "b", "c"], 1.0)
    assert not t.may_lead("m", ["a"], 1.0) and not t.may_lead("zz", ["a"], 1.0)


def test_progress_only_from_mates_and_within_what_a_peer_can_hold() -> None:
    sync, behind = make_sync({"z": ()}, me="a")  # this peer leads

    async def scenario() -> list[str]:
        out = [await _serve(sync, "progress", {"stage": 1, "step": 0, "samples": 3}, "z"),
               await _serve(sync, "progress", {"stage": 1, "step": 0, "samples": 10 ** 6},
                            "z"),
               await _serve(sync, "progress", {"stage": 1, "step": 9, "samples": 1}, "evil"),
               await _serve(sync, "prepare", {"stage": 2, "step": 0}, "z")]
        await sync.close()
        return out

    assert asyncio.run(scenario()) == ["ok", "bad_samples", "not_a_mate", "round_refused"]
    assert sync.trigger.reports == {"z": (0, 3)}
    assert behind == []  # an outsider's claim of a later step makes nobody catch up


def test_a_refused_or_failed_report_is_sent_once_per_backward_and_a_dead_leader_suspected() -> None:
    from transport.errors import PeerUnavailable, RemoteError

    class Refusing(FakeHost):
        def __init__(self, error: Exception) -> None:
            self.error, self.asked = error, 0

        async def ensure_connected(self, *a: Any, **k: Any) -> bool:
            return True

        async def request(self, *a: Any, **k: Any) -> Message:
            self.asked += 1
            raise self.error

    async def scenario(error: Exception) -> tuple[int, StageSync]:
        sync, _ = make_sync({"a": ()}, me="m")  # "a" leads
        sync.host = host = Refusing(error)
        sync.progressed(1)
        for _ in range(50):
            await asyncio.sleep(0)
        await sync.close()
        return host.asked, sync

    asked, sync = asyncio.run(scenario(RemoteError("bad_round_message", "not a mate")))
    assert asked == 1 and sync.counters["refused.bad_round_message"] == 1
    asked, sync = asyncio.run(scenario(PeerUnavailable("gone")))
    assert asked == 1 and sync.counters["mates_unreachable"] == 1
    assert "a" in sync.trigger.suspects  # and this peer leads now (alone: it steps locally)


def test_a_mate_reports_again_to_the_new_leader_once_its_leader_left_the_stage() -> None:
    # all of a step's samples are in and reported to the leader "a"; then "a" moves to another
    # stage: no backward comes to report them again (the trainer waits for the step's report,
    # which only the round makes), so the change of leader itself must carry them to "b"
    class Answering(FakeHost):
        def __init__(self) -> None:
            self.asked: list[tuple[str, dict[str, Any]]] = []

        async def ensure_connected(self, *a: Any, **k: Any) -> bool:
            return True

        async def request(self, peer: str, protocol: str, message: Message,
                          **k: Any) -> Message:
            self.asked.append((peer, dict(message.meta)))
            return Message(kind="ok")

    mates: dict[str, tuple[str, ...]] = {"a": (), "b": ()}
    sync, _ = make_sync(mates, me="m")
    sync.host = host = Answering()

    async def scenario() -> list[bool]:
        sync.progressed(5)
        for _ in range(20):
            await asyncio.sleep(0)
        checks = [sync.leader_check()]  # the same leader: nothing to do
        del mates["a"]  # "a" moved to another stage
        checks += [sync.leader_check(), sync.leader_check()]  # once per change
        for _ in range(20):
            await asyncio.sleep(0)
        await sync.close()
        return checks

    assert asyncio.run(scenario()) == [False, True, False]
    assert [(peer, meta["samples"]) for peer, meta in host.asked] == [("a", 5), ("b", 5)]
    assert sync.counters["leader_changed"] == 1


def test_no_round_is_led_or_joined_while_held_and_the_held_one_is_waited_out() -> None:
    """A catch-up holds the rounds: the round in progress finishes first, a start or a
    prepare meanwhile is told the peer is busy, and the round due is led once it is let go."""
    sync, _ = make_sync({"z": ()}, me="a")  # this peer leads
    follower, _ = make_sync({"a": ()}, me="m")
    gate = asyncio.Event()
    led: list[str] = []

    async def slow_round() -> None:
        await gate.wait()

    async def lead(mates: Any) -> None:
        led.append("led")

    sync._lead = lead  # type: ignore[method-assign]

    async def scenario() -> list[Any]:
        sync._round = asyncio.ensure_future(slow_round())
        entered: list[bool] = []

        async def catch_up() -> None:
            async with sync.held():
                entered.append(sync._rounding)
                sync.trigger.report("z", 0, 8)
                sync.progressed(8)  # due now, but held
                prepared = await sync._serve(Message(kind="prepare", meta={
                    "stage": 1, "step": 0}), "z")
                entered.append(prepared.meta["free"])
                entered.append(list(led))
            async with follower.held():  # a follower held refuses its leader's start
                entered.append(await _serve(follower, "start", start_meta(["a", "m"]), "a"))

        task = asyncio.ensure_future(catch_up())
        for _ in range(5):
            await asyncio.sleep(0)
        assert entered == []  # still waiting out the round in progress
        gate.set()
        await task
        for _ in range(5):
            await asyncio.sleep(0)
        await sync.close()
        await follower.close()
        return [*entered, list(led)]

    assert asyncio.run(scenario()) == [False, False, [], "round_refused", ["led"]]
