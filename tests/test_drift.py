"""Weights drifting within a stage (issue 14): rounds taken from mates a lagging view lists no
more (``swarmd.averaging.authority.RecentMates``), and the same-step divergence check
(``same_step_verdict``, ``Start.digest``, ``StageSync`` over a fake host: no network)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.averaging import messages as m
from swarmd.averaging.authority import (ADOPT, KEEP, IdleDrift, RecentMates, idle_adopt_from,
                                        same_step_verdict)
from swarmd.averaging.stage_sync import RoundRefused, StageSync, SyncSettings
from swarmd.averaging.trigger import RoundTrigger
from swarmd.errors import BadRoundMessage
from swarmd.state.messages import DigestReply, parse_digest, parse_request
from swarmd.state.transfer import BadStateRequest
from transport.frames import Message

D1, D2 = "0" * 32, "f" * 32

# ---- same_step_verdict ----------------------------------------------------------------------


def test_the_higher_id_adopts_at_the_same_step_with_other_weights() -> None:
    assert same_step_verdict(me="b", our_step=3, our_digest=D1, them="a", their_step=3,
                             their_digest=D2) == ADOPT
    assert same_step_verdict(me="a", our_step=3, our_digest=D1, them="b", their_step=3,
                             their_digest=D2) == KEEP


@pytest.mark.parametrize("ours,theirs,our_step,their_step", [
    (D1, D1, 3, 3),      # equal weights
    (None, D2, 3, 3),    # our digest unknown
    (D1, None, 3, 3),    # an older leader sends none
    (D1, D2, 3, 4),      # other steps: the step rules (catch up) handle those
    (D1, D2, 4, 3),
])
def test_nothing_is_adopted_without_two_known_digests_at_one_step(
        ours: str | None, theirs: str | None, our_step: int, their_step: int) -> None:
    assert same_step_verdict(me="b", our_step=our_step, our_digest=ours, them="a",
                             their_step=their_step, their_digest=theirs) == KEEP


_ids = st.text(alphabet="abcdef0123", min_size=1, max_size=6)
_digests = st.none() | st.sampled_from([D1, D2, "1" * 32])
_steps = st.integers(0, 3)


@settings(max_examples=300, deadline=None)
@given(me=_ids, them=_ids, our_step=_steps, their_step=_steps, ours=_digests, theirs=_digests)
def test_two_peers_never_both_adopt_and_a_drift_always_has_one_adopter(
        me: str, them: str, our_step: int, their_step: int, ours: str | None,
        theirs: str | None) -> None:
    mine = same_step_verdict(me=me, our_step=our_step, our_digest=ours, them=them,
                             their_step=their_step, their_digest=theirs)
    other = same_step_verdict(me=them, our_step=their_step, our_digest=theirs, them=me,
                              their_step=our_step, their_digest=ours)
    assert not (mine == ADOPT and other == ADOPT)
    drifted = (me != them and our_step == their_step and None not in (ours, theirs)
               and ours != theirs)
    assert (ADOPT in (mine, other)) == drifted
    if mine == ADOPT:
        assert them < me  # the lowest id wins: every peer of the stage converges on one


# ---- RecentMates ----------------------------------------------------------------------------


def test_a_mate_stays_known_for_the_grace_after_its_last_listing() -> None:
    recent = RecentMates(grace_s=60.0)
    assert recent.known({"a": ("/a",), "b": ()}, now=0.0) == {"a": ("/a",), "b": ()}
    recent.observe({"b": ("/b2",)}, now=30.0)        # a's announcement is overdue now
    assert recent.known({}, now=59.0) == {"a": ("/a",), "b": ("/b2",)}
    assert recent.known({}, now=61.0) == {"b": ("/b2",)}
    assert recent.known({}, now=91.0) == {}
    recent.observe({"c": ()}, now=100.0)
    recent.forget("c")
    assert len(recent) == 0


def test_a_known_mate_heard_from_just_now_is_alive_and_an_unknown_one_never() -> None:
    recent = RecentMates(grace_s=60.0, heard_s=10.0)
    recent.observe({"a": ("/a",), "b": ()}, now=0.0)
    recent.heard("a", now=20.0)
    recent.heard("stranger", now=20.0)              # never listed: not remembered
    assert recent.alive({"c": ()}, now=25.0) == {"a": ("/a",), "c": ()}
    assert recent.alive({}, now=31.0) == {}         # not heard from for 11 s
    recent.heard("a", now=70.0)                     # past the grace: no mate any more
    assert recent.alive({}, now=70.0) == {}


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 5), st.sets(_ids, max_size=5)), max_size=30),
       grace=st.integers(0, 20), cap=st.integers(1, 8))
def test_known_holds_the_live_ones_and_only_peers_ever_listed_recently(
        events: list[tuple[int, set[str]]], grace: int, cap: int) -> None:
    recent = RecentMates(grace_s=grace, max_peers=cap)
    now, last_seen = 0, dict[str, int]()
    for gap, live in events:
        now += gap
        known = recent.known({p: () for p in live}, now)
        for p in live:
            last_seen[p] = now
        assert len(known) <= max(cap, len(live))
        for p in known:
            assert p in last_seen and now - last_seen[p] <= grace  # never an outsider
        if len(live) <= cap:
            assert live <= set(known)


# ---- the digest in ``start`` ----------------------------------------------------------------


def test_a_start_carries_the_digest_and_an_old_start_without_it_still_parses() -> None:
    meta = {"stage": 1, "step": 3, "round": "1:3:ab", "group": ["a", "b"],
            "bandwidths": [None, None]}
    old = m.parse_round("start", meta)
    assert isinstance(old, m.Start) and old.digest is None and "digest" not in old.to_meta()
    new = m.parse_round("start", {**meta, "digest": D2})
    assert isinstance(new, m.Start) and new.digest == D2
    assert m.parse_round("start", new.to_meta()) == new
    for bad in ("", "XYZ", "g" * 32, "0" * 65, 7, ["0"]):
        with pytest.raises(BadRoundMessage) as info:
            m.parse_round("start", {**meta, "digest": bad})
        assert info.value.reason == "bad_digest"


# ---- StageSync: who may start, and the drift check --------------------------------------------

class FakeHost:
    def __init__(self, me: str) -> None:
        self.peer_id = me
        self.sent: list[tuple[str, Message]] = []

    async def ensure_connected(self, peer: str, *a: Any, **k: Any) -> bool:
        return True

    async def ping(self, peer: str, **k: Any) -> float:
        return 0.001

    async def request(self, peer: str, protocol: str, message: Message, **k: Any) -> Message:
        self.sent.append((peer, message))
        if message.kind == "prepare":
            return Message(kind="ok", meta={"step": message.meta["step"], "free": True})
        return Message(kind="ok")

    def set_request_handler(self, *a: Any, **k: Any) -> None:
        pass

    def remove_handler(self, *a: Any) -> None:
        pass


class Stage:
    """A StageSync whose live mates, weights digest and steps the test sets."""

    def __init__(self, me: str, mates: dict[str, tuple[str, ...]], digest: str | None = D1,
                 grace_s: float = 60.0) -> None:
        self.live = dict(mates)
        self.weights = digest
        self.diverged: list[tuple[str, int]] = []
        self.applied = 0

        async def snapshot() -> tuple[torch.Tensor, int]:
            return torch.zeros(4), 1

        async def apply(vector: torch.Tensor, source: object = None) -> None:
            self.applied += 1

        async def give_back(*a: Any) -> None:
            pass

        async def our_digest() -> str:
            assert self.weights is not None
            return self.weights

        self.sync = StageSync(
            FakeHost(me), swarm="t", stage=1,
            trigger=RoundTrigger(me=me, target=8, heard=set(self.live)),
            averager=None, mates=lambda: self.live, snapshot=snapshot, apply=apply,
            give_back=give_back, on_behind=lambda p, s: None, samples_now=lambda: 0,
            settings=SyncSettings(mate_grace_s=grace_s),
            digest=our_digest if digest is not None else None,
            on_diverged=lambda p, s: self.diverged.append((p, s)))

    async def serve(self, kind: str, meta: dict[str, Any], peer: str) -> str:
        try:
            reply = await self.sync._serve(Message(kind=kind, meta=meta), peer)
        except (BadRoundMessage, RoundRefused) as exc:
            return getattr(exc, "reason", exc.code)
        for _ in range(20):  # let the spawned round run
            await asyncio.sleep(0)
        return reply.kind


def start_meta(group: list[str], step: int = 0, digest: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"stage": 1, "step": step, "round": f"1:{step}:x", "group": group,
                            "bandwidths": [None] * len(group)}
    if digest is not None:
        meta["digest"] = digest
    return meta


def test_a_leader_our_lagging_view_no_longer_lists_is_still_taken_but_an_outsider_is_not() -> None:
    stage = Stage("m", {"a": (), "b": ()})

    async def scenario() -> list[str]:
        stage.sync._consider()        # the view lists a and b: remembered
        stage.live.clear()            # their announcements are overdue here now
        out = [await stage.serve("prepare", {"stage": 1, "step": 0}, "a"),
               await stage.serve("start", start_meta(["a", "b", "m"]), "a"),
               await stage.serve("start", start_meta(["m", "outsider"]), "outsider"),
               await stage.serve("progress", {"stage": 1, "step": 0, "samples": 1},
                                 "outsider"),
               await stage.serve("start", start_meta(["a", "m", "zz"]), "a")]
        await stage.sync.close()
        return out

    assert asyncio.run(scenario()) == ["ok", "ok", "not_a_mate", "not_a_mate",
                                       "group_not_mates"]
    assert stage.applied == 1  # the leader's round ran (alone here: no averager)


def test_past_the_grace_a_mate_the_view_dropped_is_refused() -> None:
    stage = Stage("m", {"a": ()}, grace_s=0.0)

    async def scenario() -> str:
        stage.sync._consider()
        stage.live.clear()
        await asyncio.sleep(0.01)
        got = await stage.serve("start", start_meta(["a", "m"]), "a")
        await stage.sync.close()
        return got

    assert asyncio.run(scenario()) == "not_a_mate"


def test_a_member_whose_weights_differ_from_the_leaders_at_its_step_takes_its_state() -> None:
    async def scenario(ours: str | None, theirs: str | None) -> Stage:
        stage = Stage("m", {"a": ()}, digest=ours)
        assert await stage.serve("start", start_meta(["a", "m"], digest=theirs), "a") == "ok"
        await stage.sync.close()
        return stage

    drifted = asyncio.run(scenario(D1, D2))
    assert drifted.diverged == [("a", 0)] and drifted.sync.counters["diverged"] == 1
    assert drifted.applied == 1 and drifted.sync.step == 1  # it still averaged the round
    for ours, theirs in ((D1, D1), (D1, None), (None, D2)):  # equal, an old leader, no digest
        same = asyncio.run(scenario(ours, theirs))
        assert same.diverged == [] and same.sync.counters["diverged"] == 0


def test_the_leader_sends_the_digest_of_its_weights_before_the_step() -> None:
    stage = Stage("a", {"m": ()}, digest=D2)  # "a" leads

    async def scenario() -> None:
        stage.sync.trigger.report("m", 0, 8)
        stage.sync.progressed(1)
        for _ in range(50):
            await asyncio.sleep(0)
        await stage.sync.close()

    asyncio.run(scenario())
    starts = [msg for _, msg in stage.sync.host.sent if msg.kind == "start"]
    assert len(starts) == 1 and starts[0].meta["digest"] == D2 and starts[0].meta["step"] == 0


# ---- a state server offers the step it is at ------------------------------------------------


def test_a_cached_snapshot_is_not_offered_once_the_stage_stepped_past_it() -> None:
    """A drifted (or lagging) mate asks for our state right after a round: the snapshot cached
    a moment ago, one step older, would be refused as "not newer" and the repair never land."""
    from swarmd.state import encoding as ss
    from swarmd.state.serve import StateServer

    module = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(module.parameters())
    step = [3]

    async def snapshot() -> ss.StageState:
        return ss.capture(module, optimizer, stage=1, step=step[0], model_hash="h")

    server = StateServer(FakeHost("a"), "p", snapshot, stage=1, model_hash="h",
                         step=lambda: step[0])

    async def scenario() -> list[int]:
        offered = [(await server._info()).meta["step"]]
        offered.append((await server._info()).meta["step"])  # fresh and current: reused
        step[0] = 4
        offered.append((await server._info()).meta["step"])
        return offered

    assert asyncio.run(scenario()) == [3, 3, 4]
    assert server.counters["snapshots"] == 2


def test_a_leader_whose_view_dropped_a_reporting_mate_leads_the_round_with_it() -> None:
    """The lagging view is the leader's: its mate still reports progress, so the leader
    averages with it instead of stepping alone."""
    stage = Stage("a", {"m": ()})

    async def scenario() -> None:
        stage.sync._consider()   # "m" listed: remembered
        stage.live.clear()       # its announcements are overdue here now
        assert await stage.serve("progress", {"stage": 1, "step": 0, "samples": 7}, "m") == "ok"
        stage.sync.progressed(1)  # 7 + 1 samples: the target
        for _ in range(50):
            await asyncio.sleep(0)
        await stage.sync.close()

    asyncio.run(scenario())
    kinds = [(peer, msg.kind) for peer, msg in stage.sync.host.sent]
    assert ("m", "prepare") in kinds and ("m", "start") in kinds
    assert stage.sync.counters["local_steps"] == 1  # averager None: the fake round is local


def test_every_fuzz_case_of_the_round_protocol_gets_a_typed_answer_with_the_grace() -> None:
    """tests/fuzz_cases.py's round cases (weird digests among them), from a mate the view
    dropped within the grace and from an outsider: typed refusals or ordinary replies only."""
    from fuzz_cases import cases

    from swarmd.errors import SwarmdError

    round_cases = [c for c in cases("t", "h") if c.protocol.endswith("/round") and c.raw is None]
    assert len(round_cases) >= 10
    stage = Stage("m", {"a": (), "b": ()})
    outcomes: dict[str, int] = {}

    async def scenario() -> None:
        stage.sync._consider()
        stage.live.clear()
        for case in round_cases:
            for peer in ("a", "outsider"):
                try:
                    await stage.sync._serve(Message(kind=case.kind, meta=case.meta,
                                                    tensors=case.tensors), peer)
                    key = "ok"
                except SwarmdError as exc:
                    key = getattr(exc, "reason", exc.code)
                outcomes[key] = outcomes.get(key, 0) + 1
        for _ in range(20):
            await asyncio.sleep(0)
        await stage.sync.close()

    asyncio.run(scenario())
    assert outcomes.get("not_a_mate", 0) >= 1 and "internal_error" not in outcomes, outcomes


def test_the_round_digest_is_equal_for_equal_weights_and_differs_once_they_drift() -> None:
    from collections import Counter

    from swarmd.pipeline.stepping import DIGEST_PIECE_BYTES, DIGEST_PIECES, Stepper

    def stage(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)  # a big layer (sampled) and a small one (hashed whole)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))

    a, b, other = stage(0), stage(0), stage(1)
    assert a[0].weight.numel() * 4 > DIGEST_PIECES * DIGEST_PIECE_BYTES
    digest = {name: Stepper(m, None, None, Counter()).round_digest()
              for name, m in (("a", a), ("b", b), ("other", other))}
    assert digest["a"] == digest["b"] != digest["other"]
    optimizer = torch.optim.AdamW(b.parameters(), lr=1e-3)  # b steps once alone: drifted
    b(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    assert Stepper(b, None, None, Counter()).round_digest() != digest["a"]
    # parsed as a start's digest
    m.Start(stage=0, step=0, round_id="r", group=("a", "b"), bandwidths=(None, None),
            digest=digest["a"])


# ---- drift while no rounds run: the idle check ------------------------------------------------



def test_an_idle_peer_adopts_the_lowest_id_mate_at_its_step_when_their_weights_differ() -> None:
    assert idle_adopt_from(me="b", our_step=5, our_digest=D1, mates={"a": (5, D2)}) == "a"
    assert idle_adopt_from(me="a", our_step=5, our_digest=D1, mates={"b": (5, D2)}) is None
    assert idle_adopt_from(me="b", our_step=5, our_digest=D1, mates={"a": (5, D1)}) is None
    # the reference is the lowest id at our step, even where a higher one holds other weights:
    # c does not chase b, which itself adopts a
    assert idle_adopt_from(me="c", our_step=5, our_digest=D1,
                           mates={"a": (5, D1), "b": (5, D2)}) is None
    assert idle_adopt_from(me="b", our_step=5, our_digest=D2,
                           mates={"a": (5, D1), "c": (5, D1)}) == "a"
    # other steps, unknown digests and ourselves do not count
    assert idle_adopt_from(me="b", our_step=5, our_digest=D1,
                           mates={"a": (4, D2), "0": (5, None), "b": (5, D2)}) is None
    assert idle_adopt_from(me="b", our_step=5, our_digest=None, mates={"a": (5, D2)}) is None


_views = st.dictionaries(_ids, st.tuples(_steps, st.sampled_from([D1, D2, "1" * 32])),
                         min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(peers=_views)
def test_idle_peers_never_adopt_each_other_and_each_drifted_one_adopts_the_reference(
        peers: dict[str, tuple[int, str]]) -> None:
    """Every peer of the stage sees all the others (step, digest): the lowest id at a step
    never adopts, no two peers adopt each other, and every other peer at that step whose
    weights differ from the lowest id's adopts exactly that one."""
    adopts = {me: idle_adopt_from(me=me, our_step=step, our_digest=dig,
                                  mates={p: v for p, v in peers.items() if p != me})
              for me, (step, dig) in peers.items()}
    for me, target in adopts.items():
        if target is not None:
            assert adopts[target] is None and target < me
            assert peers[target][0] == peers[me][0] and peers[target][1] != peers[me][1]
    for step in {s for s, _ in peers.values()}:
        at = sorted(p for p, (s, _) in peers.items() if s == step)
        ref = at[0]
        assert adopts[ref] is None
        for p in at[1:]:
            assert adopts[p] == (ref if peers[p][1] != peers[ref][1] else None)


def test_the_idle_check_is_due_only_once_the_step_stood_still_and_then_not_too_often() -> None:
    idle = IdleDrift(idle_s=10, every_s=15)
    assert not idle.due(3, 0.0)   # first look: the step is new
    assert not idle.due(3, 9.0)
    assert idle.due(3, 10.0)
    assert not idle.due(3, 20.0)  # asked 10 s ago
    assert idle.due(3, 25.0)
    assert not idle.due(4, 26.0)  # a round stepped: idle again from now
    assert not idle.due(4, 35.0)
    assert idle.due(4, 36.0)
    with pytest.raises(ValueError):
        IdleDrift(idle_s=1, every_s=0)


def test_digest_requests_and_replies_are_typed_and_malformed_ones_refused() -> None:
    ask = parse_request("state_digest", {"stage": 1, "model_hash": "h", "junk": 1})
    assert type(ask).__name__ == "DigestRequest" and ask.to_meta() == {"stage": 1,
                                                                       "model_hash": "h"}
    reply = parse_digest("a", "state_digest", {"step": 4, "digest": D1, "junk": [1]})
    assert reply == DigestReply(peer="a", step=4, digest=D1)
    for kind, meta, tensors in [("state_info", {"step": 4, "digest": D1}, ()),
                                ("state_digest", {"step": -1, "digest": D1}, ()),
                                ("state_digest", {"step": True, "digest": D1}, ()),
                                ("state_digest", {"step": 4, "digest": "xyz"}, ()),
                                ("state_digest", {"step": 4}, ()),
                                ("state_digest", [], ()),
                                ("state_digest", {"step": 4, "digest": D1},
                                 (torch.zeros(1),))]:
        with pytest.raises(BadStateRequest):
            parse_digest("a", kind, meta, tensors)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(meta=st.dictionaries(st.sampled_from(["step", "digest", "x"]),
                            st.none() | st.integers() | st.text(max_size=40) | st.booleans()))
def test_arbitrary_digest_replies_parse_or_raise_only_the_typed_error(meta: dict[str, Any]) -> None:
    try:
        reply = parse_digest("a", "state_digest", meta)
    except BadStateRequest:
        return
    assert reply.step >= 0 and len(reply.digest) == 32


class DigestHost(FakeHost):
    """Answers ``state_digest`` as the table says: a reply's meta, or an exception to raise."""

    def __init__(self, me: str, answers: dict[str, Any]) -> None:
        super().__init__(me)
        self.answers = answers
        self.asked: list[str] = []

    async def ensure_connected(self, peer: str, addrs: Any, timeout: float) -> bool:
        return True

    async def request(self, peer: str, protocol: str, message: Message, **kw: Any) -> Message:
        self.asked.append(peer)
        answer = self.answers[peer]
        if isinstance(answer, BaseException):
            raise answer
        return Message(kind="state_digest", meta=answer)


def _idle_keeper(host: DigestHost, step: int, ours: str, mates: list[str]) -> Any:
    from swarmd.state.keeper import StageKeeper

    class Server:
        stage = 1
        module = torch.nn.Linear(2, 2)

    Server.step = step  # type: ignore[attr-defined]

    async def weights() -> tuple[int, str]:
        return step, ours

    keeper = StageKeeper(host, Server(), swarm="t", home=None, model_hash="h", every_steps=0,
                         sources=lambda: [(p, ("/ip4/127.0.0.1/tcp/1",)) for p in mates],
                         weights_digest=weights)
    keeper._ready = True
    keeper.repairs = []
    keeper.diverged = lambda peer, at: keeper.repairs.append((peer, at))  # type: ignore
    return keeper


def test_an_idle_keeper_takes_the_lowest_mates_state_and_survives_bad_or_missing_answers() -> None:
    from transport.errors import PeerUnavailable, RemoteError

    host = DigestHost("c", {
        "a": {"step": 7, "digest": D2},
        "b": {"step": 7, "digest": "nonsense"},   # malformed: counted, ignored
        "d": RemoteError("bad_state_request", "unknown request kind"),  # an older peer
        "e": PeerUnavailable("gone"),
    })
    keeper = _idle_keeper(host, 7, D1, ["a", "b", "d", "e"])
    asyncio.run(keeper._idle_drift())
    assert keeper.repairs == [("a", 7)]
    assert keeper.counters["idle_checks"] == 1 and keeper.counters["idle_diverged"] == 1
    assert keeper.counters["bad_digest_replies"] == 1
    # equal weights, or we are the lowest id: nothing taken
    same = _idle_keeper(DigestHost("c", {"a": {"step": 7, "digest": D1}}), 7, D1, ["a"])
    asyncio.run(same._idle_drift())
    lowest = _idle_keeper(DigestHost("a", {"b": {"step": 7, "digest": D2}}), 7, D1, ["b"])
    asyncio.run(lowest._idle_drift())
    assert same.repairs == lowest.repairs == []


def test_a_state_server_answers_a_digest_request_with_its_step_and_weights_digest() -> None:
    from swarmd.state.serve import StateServer
    from swarmd.state.transfer import NoState

    async def snapshot() -> None:
        return None

    found: list[tuple[int, str] | None] = [None]

    async def weights() -> tuple[int, str] | None:
        return found[0]

    server = StateServer(FakeHost("a"), "p", snapshot, stage=1, model_hash="h",
                         weights_digest=weights)
    ask = Message(kind="state_digest", meta={"stage": 1, "model_hash": "h"})

    async def scenario() -> Message:
        with pytest.raises(NoState):  # no settled weights yet
            await server.serve(ask, "b")
        found[0] = (9, D2)
        return await server.serve(ask, "b")

    reply = asyncio.run(scenario())
    assert parse_digest("a", reply.kind, reply.meta) == DigestReply(peer="a", step=9, digest=D2)
    assert server.counters["digests"] == 2
