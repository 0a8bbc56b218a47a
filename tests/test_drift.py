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
from swarmd.averaging.authority import ADOPT, KEEP, RecentMates, same_step_verdict
from swarmd.averaging.stage_sync import RoundRefused, StageSync, SyncSettings
from swarmd.averaging.trigger import RoundTrigger
from swarmd.errors import BadRoundMessage
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

        async def apply(vector: torch.Tensor) -> None:
            self.applied += 1

        async def give_back(*a: Any) -> None:
            pass

        async def our_digest() -> str:
            assert self.weights is not None
            return self.weights

        self.sync = StageSync(
            FakeHost(me), swarm="t", stage=1, trigger=RoundTrigger(me=me, target=8),
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
