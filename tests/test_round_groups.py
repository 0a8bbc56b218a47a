"""What a round's leader counts about its group (issue 28): members, live mates left out.

``sync.group_members`` over ``sync.rounds_led`` is a stage's mean all-reduce group, and
``sync.mates_left_out`` / ``sync.rounds_short`` say whether its rounds include every live mate
(``tools/bench_scale.py`` reports them for a swarm of 24 daemons)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import pytest
import torch

from swarmd.averaging.stage_sync import StageSync
from swarmd.averaging.trigger import REFUSING_S, RoundTrigger
from transport.errors import DeadlineExceeded, RemoteError
from transport.frames import Message


#: a mate that never answers (frozen: SIGSTOPped, its connection still open)
FROZEN = "frozen"
#: a mate that answers every round message with a typed error
REFUSES = "refuses"


class Host:
    """Answers ``prepare`` for each mate as ``answers`` says: free, busy, silent (None: a
    deadline at once), ``FROZEN`` (no answer, ever) or free after that many seconds (a
    float)."""

    def __init__(self, me: str, answers: dict[str, bool | str | float | None],
                 steps: dict[str, int] | None = None) -> None:
        self.peer_id = me
        self.answers = answers
        #: the step a mate says it is at (default: the step it is asked about)
        self.steps = steps or {}
        #: (mate, kind, step) of every request, in order
        self.asked: list[tuple[str, str, int]] = []

    async def ensure_connected(self, peer: str, *a: Any, **k: Any) -> bool:
        return True

    async def ping(self, peer: str, **k: Any) -> float:
        return 0.001

    async def request(self, peer: str, protocol: str, message: Message, **k: Any) -> Message:
        self.asked.append((peer, message.kind, message.meta.get("step")))
        free = self.answers[peer]
        if free is None:
            raise DeadlineExceeded(f"{peer} did not answer")
        if free == FROZEN:
            await asyncio.Event().wait()
        if free == REFUSES:
            raise RemoteError("bad_round_message", "no")
        if isinstance(free, float):  # slow: answers (free) after that many seconds
            await asyncio.sleep(free)
            free = True
        step = self.steps.get(peer, message.meta["step"])
        if message.kind == "prepare":
            return Message(kind="ok", meta={"step": step, "free": free})
        if message.kind == "progress":
            return Message(kind="ok", meta={"step": step})
        return Message(kind="ok")

    def set_request_handler(self, *a: Any, **k: Any) -> None:
        pass

    def remove_handler(self, *a: Any) -> None:
        pass


def lead_one_round(answers: dict[str, bool | None],
                   suspected: tuple[str, ...] = ()) -> dict[str, int]:
    """Leader "a" (the smallest id) with mates ``answers``' keys, at its target: one round.
    ``suspected``: mates that failed it a moment ago. Its group counters."""
    sync = led_round(answers, suspected)
    return {k: v for k, v in sync.counters.items() if k in (
        "rounds_led", "group_members", "mates_left_out", "rounds_short") or k.startswith(
        "left_out.")}


def led_round(answers: dict[str, bool | None], suspected: tuple[str, ...] = ()) -> StageSync:
    """The leader of ``lead_one_round``, after its round."""
    sync = stage_sync("a", answers)
    for p in suspected:
        sync.trigger.suspect(p, time.monotonic())

    async def scenario() -> None:
        sync.progressed(1)
        for _ in range(100):
            await asyncio.sleep(0)
        await sync.close()

    asyncio.run(scenario())
    return sync


def stage_sync(me: str, answers: dict[str, bool | str | float | None],
               steps: dict[str, int] | None = None, heard: bool = True,
               clock: Callable[[], float] = time.monotonic,
               behind: list[tuple[str, int]] | None = None) -> StageSync:
    """Peer ``me`` of stage 1 (target: 1 sample), its mates answering as ``answers`` says
    (at the step ``steps`` says, if it says one). ``heard``: every mate answered it before
    (a stage that has run a while); else all are strangers to it (it just joined).
    ``behind`` collects the (mate, step) it is told to catch up to."""
    async def snapshot() -> tuple[torch.Tensor, int]:
        return torch.zeros(4), 1

    async def nothing(*a: Any) -> None:
        pass

    return StageSync(Host(me, answers, steps), swarm="t", stage=1,
                     trigger=RoundTrigger(me=me, target=1,
                                          heard=set(answers) if heard else set()),
                     averager=None,
                     mates=lambda: {p: () for p in answers}, snapshot=snapshot, apply=nothing,
                     give_back=nothing,
                     on_behind=lambda p, s: None if behind is None else behind.append((p, s)),
                     samples_now=lambda: 0,
                     clock=clock)


def step_with_a_frozen_mate(me: str, frozen: str, answers: dict[str, bool | str | None]
                            ) -> dict[str, int]:
    """``me`` reaches its target while ``frozen`` (whose last answers took 10 ms) never answers
    again: the counters once ``me``'s stage stepped (within 10 s: a wait of the mate's
    patience, not forever)."""
    sync = stage_sync(me, {**answers, frozen: FROZEN})
    for _ in range(8):
        sync.patience.observe(frozen, 0.01)

    async def scenario() -> None:
        sync.progressed(1)
        async with asyncio.timeout(10):
            while sync.step == 0:
                await asyncio.sleep(0.01)
        await sync.close()

    asyncio.run(scenario())
    return {k: v for k, v in sync.counters.items()
            if k.startswith(("left_out.", "answer_late.", "rounds_led", "local_steps"))}


def test_a_round_with_every_live_mate_counts_its_whole_group_and_leaves_none_out() -> None:
    assert lead_one_round({"b": True, "c": True, "d": True}) == {
        "rounds_led": 1, "group_members": 4, "mates_left_out": 0, "rounds_short": 0}


def test_busy_silent_or_suspected_live_mates_are_counted_as_left_out_and_why() -> None:
    assert lead_one_round({"b": True, "c": False, "d": None, "e": True}, suspected=("e",)) == {
        "rounds_led": 1, "group_members": 2, "mates_left_out": 3, "rounds_short": 1,
        "left_out.busy": 1, "left_out.silent": 1, "left_out.suspected": 1}


def test_the_mates_answer_times_are_kept_by_kind_and_a_silent_mate_is_not_one() -> None:
    """``round_ask_seconds.<kind>`` (``/metrics``): what a shorter wait than ``ASK_TIMEOUT_S``
    for a mate's answer would be chosen from."""
    sync = led_round({"b": True, "c": False, "d": None})
    seen = sync.histograms.snapshot()
    assert seen["round_ask_seconds.prepare"].count == 2  # b and c answered; d did not
    assert seen["round_ask_seconds.start"].count == 1    # the round's start, to b


def test_a_frozen_mate_that_answered_fast_is_left_out_after_its_patience() -> None:
    """The leader's ``prepare`` to a mate that froze (issue 28: one stage peer SIGSTOPped held
    the stage's step for ``ASK_TIMEOUT_S``, 3 s): its answers so far took 10 ms, so it is left
    out after its patience (``swarmd.averaging.patience``) and the stage steps without it."""
    assert step_with_a_frozen_mate("a", frozen="c", answers={"b": True}) == {
        "answer_late.prepare": 1, "left_out.silent": 1, "rounds_led": 1, "local_steps": 1}


def test_a_frozen_leader_is_suspected_after_its_patience_and_the_next_mate_leads() -> None:
    """A mate's ``progress`` report to a leader that froze: the mate suspects it after the
    leader's patience, leads the stage itself and steps."""
    assert step_with_a_frozen_mate("b", frozen="a", answers={}) == {
        "answer_late.progress": 1, "left_out.suspected": 1, "rounds_led": 1,
        "local_steps": 1}


def until(sync: StageSync, done: Callable[[], bool],
          before: Callable[[StageSync], None] = lambda sync: None) -> dict[str, int]:
    """``sync`` at step 5 takes a sample; its counters once ``done()`` (within 10 s)."""
    async def scenario() -> None:
        sync.trigger.stepped(5)
        before(sync)
        sync.progressed(1)
        async with asyncio.timeout(10):
            while not done():
                await asyncio.sleep(0.01)
        await sync.close()

    asyncio.run(scenario())
    return {k: v for k, v in sync.counters.items() if not k.startswith("group_members")}


def test_a_leader_that_says_it_is_behind_is_passed_over_and_the_next_mate_leads() -> None:
    """Issue 28: a frozen leader, thawed, is at step 0 while its mate is at 5; it answers the
    mate's progress at once but calls no round until it caught up (seconds). The mate passes
    it over at this step and leads; at its next step it reports to it again."""
    sync = stage_sync("b", {"a": True}, steps={"a": 0})
    counters = until(sync, lambda: sync.step == 6)
    assert counters == {"reports_sent": 1, "leader_behind": 1, "left_out.behind": 1,
                        "mates_left_out": 1, "rounds_short": 1, "rounds_led": 1,
                        "local_steps": 1, "nudged_behind": 1}
    assert sync.trigger.leader(["a"], time.monotonic()) == "a"  # at step 6: tried again


def test_a_mate_left_out_as_behind_is_told_the_step_the_round_took_at_once() -> None:
    """A mate that caught up (by replay) to the step the leader was stepping from found it
    one step on by the next round, and was left out as behind again, every round: it never
    served (a livelock CI saw). The leader tells it the new step right after stepping."""
    sync = stage_sync("a", {"b": True, "c": True}, steps={"b": 4})
    counters = until(sync, lambda: ("b", "prepare", 6) in sync.host.asked)
    assert counters["left_out.behind"] == 1 and counters["nudged_behind"] == 1
    assert sync.step == 6 and sync.host.asked.count(("b", "prepare", 5)) == 1
    assert ("c", "prepare", 6) not in sync.host.asked  # it was in the round: nothing to say


def test_a_passed_over_leader_that_caught_up_leads_again_at_once() -> None:
    """The mate passed the leader over at step 5; leading, it finds the leader at step 5 now:
    it calls no round of its own and reports to the leader instead."""
    sync = stage_sync("b", {"a": True})
    counters = until(sync, lambda: sync.counters["reports_sent"] >= 1,
                     before=lambda sync: sync.trigger.passed_over("a", 0))
    assert counters["leader_caught_up"] == 1 and "rounds_led" not in counters
    assert sync.step == 5 and sync.trigger.leader(["a"], time.monotonic()) == "a"


def test_a_mate_that_answers_after_its_patience_is_slow_not_gone() -> None:
    """A mate whose answers took 10 ms answers a ``prepare`` after 0.6 s (a loaded machine):
    the round goes on without it, but its late answer still counts: it is not suspected any
    more, and it is waited for 4 times that long from then on."""
    sync = stage_sync("a", {"b": True, "c": 0.6})
    for _ in range(8):
        sync.patience.observe("c", 0.01)
    counters = until(sync, lambda: sync.counters["answer_came_late.prepare"] >= 1)
    assert counters["answer_late.prepare"] == 1 and counters["left_out.silent"] == 1
    assert "c" not in sync.trigger.suspects
    assert sync.patience.seconds("c") >= 4 * 0.6
    assert sync.histograms.snapshot()["round_ask_seconds.prepare"].count == 2  # b's and c's


# ---- strangers: mates never heard from (issue 28: a silent liar whose id sorts first) ------

def test_a_silent_stranger_that_sorts_first_is_probed_and_never_waited_for() -> None:
    """A peer listed at the stage with the smallest id that takes round messages and never
    answers (a liar, or frozen before it ever answered): by id alone it led, and each mate's
    step waited ``ASK_TIMEOUT_S`` for its answer, again after every suspicion. Never heard
    from, it leads nobody: the mate leads at once, its step waits for no answer, and the
    stranger gets the mate's progress as a probe, still unanswered when the step is taken."""
    sync = stage_sync("b", {"a": FROZEN}, heard=False)
    counters = until(sync, lambda: sync.step == 6)
    assert counters == {"probes": 1, "left_out.unheard": 1, "mates_left_out": 1,
                        "rounds_short": 1, "rounds_led": 1, "local_steps": 1}
    assert "probes_answered" not in counters and "answer_late.progress" not in counters


def test_a_stranger_that_answers_its_probe_leads_from_then_on() -> None:
    """An honest newcomer with the smallest id: it answers the probe, and the mate reports
    to it from then on (its step waits for that leader, as any stage's does)."""
    sync = stage_sync("b", {"a": True}, heard=False)

    def reported() -> bool:
        if sync.counters["probes_answered"] and not sync.counters["reports_sent"]:
            sync.progressed(2)  # the next backward: reported to the leader now
        return sync.counters["reports_sent"] >= 1

    counters = until(sync, reported)
    assert counters["probes"] == counters["probes_answered"] == 1
    assert sync.trigger.heard == {"a"} and sync.trigger.leader(["a"], time.monotonic()) == "a"


def test_a_leader_asks_a_stranger_that_reported_nothing_beside_the_round() -> None:
    """The leader's ``prepare`` to a mate it never heard from and that holds nothing at this
    step (it reported nothing) goes out with the others and is waited for no longer than
    they are: the stranger's later answer makes it one for the next round."""
    sync = stage_sync("a", {"b": True, "z": FROZEN}, heard=False)
    sync.trigger.heard_from(["b"])
    counters = until(sync, lambda: sync.step == 6)
    assert counters["left_out.unheard"] == 1 and counters["rounds_led"] == 1
    assert "z" in sync._probes  # its ask ran on beside, as a probe of it
    assert "answer_late.prepare" not in counters  # nobody was waited for past its patience


@pytest.mark.parametrize("heard", [True, False])
def test_a_mate_whose_leader_answers_from_a_later_step_catches_up(heard: bool) -> None:
    """The leader went on without this mate (a stranger to it then: a new trainer, whose
    first share it did not wait for) and asks it nothing at its new step. The leader's
    answer to the mate's report (or probe, before the mate heard from it) says where it
    is: the mate catches up from it (before: two trainers missed every round under load).
    The mate holds half the target (a trainer's share): it never leads a round of its own."""
    behind: list[tuple[str, int]] = []
    sync = stage_sync("b", {"a": True}, steps={"a": 7}, heard=heard, behind=behind)

    def half(sync: StageSync) -> None:
        sync.trigger.target = 2

    counters = until(sync, lambda: bool(behind), before=half)
    assert behind[0] == ("a", 7) and counters["behind_leader"] >= 1
    assert sync.step == 5 and "rounds_led" not in counters  # it led no round of its own


def test_a_leader_that_refuses_every_report_for_refusing_s_leads_nobody() -> None:
    """A refusal is an answer (a leader whose view lags ours for a moment refuses our
    reports, and is waited for): a mate that refused every report for ``REFUSING_S`` is
    suspected, and the stage steps without it (else one answering errors held it forever)."""
    now = [1000.0]
    sync = stage_sync("b", {"a": REFUSES}, clock=lambda: now[0])

    async def scenario() -> None:
        sync.trigger.stepped(5)
        sync.progressed(1)
        async with asyncio.timeout(10):
            while not sync.counters["refused.bad_round_message"]:
                await asyncio.sleep(0.01)
            assert sync.step == 5 and "a" not in sync.trigger.suspects  # waited for
            now[0] += REFUSING_S
            while sync._reporting is not None and not sync._reporting.done():
                await asyncio.sleep(0.01)
            sync.progressed(2)  # the next backward's report, refused again
            while sync.step == 5:
                await asyncio.sleep(0.01)
        await sync.close()

    asyncio.run(scenario())
    assert sync.counters["mates_refusing"] == 1 and sync.counters["rounds_led"] == 1
    assert "a" in sync.trigger.suspects


class _Missing:
    """An averager whose rounds end without the contribution of ``missing``."""

    def __init__(self, missing: tuple[str, ...], weight: float) -> None:
        self.missing, self.weight = missing, weight

    def decline(self, round_id: str) -> None:
        raise AssertionError(f"no start is refused in these rounds ({round_id})")

    async def all_reduce(self, round_id: str, group: Any, vector: torch.Tensor, *a: Any,
                         **k: Any) -> Any:
        from swarmd.averaging.rounds import AllReduceResult
        return AllReduceResult(vector=vector.clone(), weight=self.weight,
                               contributors=tuple(p for p in group if p not in self.missing),
                               missing=self.missing, part_weights=(1.0,),
                               repaired_parts=(0,) if self.missing else (), seconds=0.0,
                               bytes_sent=0, bytes_received=0)


def _recording(held: int) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """A StageSync's snapshot (``held`` samples), apply, give_back and failed ports that
    record what was applied and what ``failed`` was told."""
    told: list[Any] = []
    applied: list[Any] = []

    async def snapshot() -> tuple[torch.Tensor, int]:
        return torch.zeros(4), held

    async def apply(vector: torch.Tensor, exact: Any) -> None:
        applied.append(exact)

    async def failed(exact: Any) -> None:
        told.append(exact)

    async def nothing(*a: Any) -> None:
        return None

    return told, applied, dict(snapshot=snapshot, apply=apply, give_back=nothing,
                               failed=failed)


def _step_once(sync: StageSync, held: int, applied: list[Any]) -> None:
    """Tell ``sync`` it holds ``held`` samples, wait until it stepped and applied, close it."""
    async def scenario() -> None:
        sync.progressed(held)
        async with asyncio.timeout(10):
            while sync.step == 0 or not applied:
                await asyncio.sleep(0.01)
        for _ in range(20):
            await asyncio.sleep(0)
        await sync.close()

    asyncio.run(scenario())


def _short_round(answers: dict[str, bool | None],
                 missing: tuple[str, ...] | None = None, weight: float = 4.0
                 ) -> tuple[StageSync, list[Any], list[Any]]:
    """Leader "a" (target 4) holds 2 samples of trainer t's step 7 and its mates reported 2
    more at its step; they answer the prepare as ``answers`` says. What ``failed`` was told
    and what was applied, once it stepped."""
    told, applied, ports = _recording(held=2)
    sync = StageSync(Host("a", answers), swarm="t", stage=1,
                     trigger=RoundTrigger(me="a", target=4, heard=set(answers)),
                     averager=None, mates=lambda: {p: () for p in answers},
                     on_behind=lambda p, s: None, samples_now=lambda: 0,
                     sources=lambda: [("t", 7)], **ports)
    if missing is not None:
        sync.averager = _Missing(missing, weight)  # type: ignore[assignment]
    for mate in answers:
        sync.trigger.report(mate, 0, 2 // len(answers))
        sync._mate_sources[mate] = (0, (("t", 7),))

    _step_once(sync, 2, applied)
    return sync, told, applied


def test_a_round_short_of_the_target_tells_its_trainers_at_once_that_no_report_comes() -> None:
    """Mate b, holding half the step's samples, is busy: the round steps on 2 of 4 samples,
    not exact, so no report of it goes to trainer t, which is told now instead of waiting
    its patience (60 s) for one (``not_exact_told``)."""
    sync, told, applied = _short_round({"b": False})
    assert applied == [()] and told == [(("t", 7),)]
    assert sync.counters["not_exact_told"] == 1 and sync.counters["rounds_short"] == 1


def test_a_whole_round_tells_nobody() -> None:
    sync, told, applied = _short_round({"b": True})
    assert applied == [(("t", 7),)]  # exact: reported as it is applied
    assert told == [] and not sync.counters["not_exact_told"]


def _lone_step(sources: list[tuple[str, int]], held: int) -> tuple[StageSync, list[Any],
                                                                  list[Any]]:
    """A peer alone at its stage (target 4) holding ``held`` samples of ``sources`` steps
    alone once they reach the target: what ``failed`` was told and what was applied."""
    told, applied, ports = _recording(held)
    sync = StageSync(Host("a", {}), swarm="t", stage=0,
                     trigger=RoundTrigger(me="a", target=4), averager=None, mates=lambda: {},
                     on_behind=lambda p, s: None, samples_now=lambda: 0,
                     sources=lambda: list(sources), **ports)

    _step_once(sync, held, applied)
    return sync, told, applied


def test_a_step_alone_on_two_steps_samples_tells_their_trainer_at_once() -> None:
    """A lone peer whose step took samples of two of trainer t's steps (a flush that ran
    after the first backwards of t's next step came in) is not exact and never reported:
    t is told now for both, where it waited out its patience (60 s) for step 8's report
    (the stall after a trainer was killed: ``tools/bench_trainer_crash.py``)."""
    sync, told, applied = _lone_step([("t", 7), ("t", 8)], 4)
    assert applied == [()] and told == [(("t", 7), ("t", 8))]
    assert sync.counters["not_exact_told"] == 1 and sync.counters["local_steps"] == 1
    sync, told, applied = _lone_step([("t", 7)], 4)  # exact: reported as it is applied
    assert applied == [(("t", 7),)] and told == [] and not sync.counters["not_exact_told"]


def test_a_member_missing_from_the_all_reduce_leaves_the_step_as_planned() -> None:
    """b was in the group but its contribution is missing from the round (it refused the
    start, or died in it): the step is the mean over the samples that arrived, reported as
    the exact step it was planned as, so that every part still steps once per target batch
    and nobody is told otherwise (telling cost a swarm with a kill exact steps and an extra
    stage step from the flush)."""
    for missing, weight in (((), 4.0), (("b",), 2.0), (("b",), 4.0)):
        sync, told, applied = _short_round({"b": True}, missing=missing, weight=weight)
        assert applied == [(("t", 7),)] and told == []
