"""RoundTrigger: who calls a stage's round, and when. Pure: no loop, no sleeps; time is a
parameter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.averaging.trigger import PASS_OVER_BEHIND, REFUSING_S, SUSPECT_S, RoundTrigger

NOW = 1_700_000_000.0
IDS = st.text(alphabet="abcdefgh", min_size=1, max_size=3)


def trigger(me: str = "m", target: int = 10, **kw: object) -> RoundTrigger:
    return RoundTrigger(me=me, target=target, **kw)  # type: ignore[arg-type]


# ---- the leader ----------------------------------------------------------------------------

@given(me=IDS, mates=st.sets(IDS, max_size=6), suspected=st.sets(IDS, max_size=6),
       heard=st.sets(IDS, max_size=6), ago=st.floats(0.0, 2 * SUSPECT_S))
def test_leader_is_the_smallest_unsuspected_id_heard_from(
        me: str, mates: set[str], suspected: set[str], heard: set[str], ago: float) -> None:
    t = trigger(me)
    t.heard_from(heard)
    for p in suspected:
        t.suspect(p, NOW - ago)
    now = NOW
    still = {p for p in suspected if NOW - ago + SUSPECT_S > now}
    mates -= {me}
    assert t.leader(mates, now) == min({me} | ((mates & heard) - still))
    assert t.leader(sorted(mates, reverse=True), now) == t.leader(mates, now)  # order-free
    # the strangers are exactly the unsuspected, unheard mates that sort before the leader
    assert t.strangers(mates, now) == sorted(p for p in mates - heard - still
                                             if p < t.leader(mates, now))


def test_a_stranger_leads_nobody_until_it_answers_and_is_probed_meanwhile() -> None:
    """A mate that sorts first but never answered us (new, or a liar that takes round
    messages and never answers) does not lead: the next heard mate, or this peer, does."""
    t = trigger("m", heard={"b"})
    assert t.leader(["a", "b", "z"], NOW) == "b"
    assert t.strangers(["a", "b", "z"], NOW) == ["a"]   # "z" sorts after the leader
    assert t.leader(["a", "z"], NOW) == "m" and t.strangers(["a", "z"], NOW) == ["a"]
    t.suspect("a", NOW)  # the probe failed: not probed again until the suspicion ran out
    assert t.strangers(["a", "z"], NOW) == []
    assert t.strangers(["a", "z"], NOW + SUSPECT_S) == ["a"]
    t.answered("a")  # it answered (late, or the next probe): it leads from now on
    assert t.leader(["a", "b", "z"], NOW) == "a" and t.strangers(["a", "b"], NOW) == []
    t.heard_from(["m", "z"])  # a round's group: this peer is not its own mate
    assert t.heard == {"a", "b", "z"}
    t.forget(["a"])
    assert t.heard == {"a"}


def test_a_mate_refusing_every_report_for_refusing_s_is_suspected_one_taking_one_is_not() -> None:
    t = trigger("m")
    assert not t.refused_report("a", NOW)          # there (a typed error), its view may lag
    assert t.leader(["a"], NOW) == "a"
    assert not t.refused_report("a", NOW + REFUSING_S / 2)
    t.took_report("a")                             # it took one: refusing starts over
    assert not t.refused_report("a", NOW + REFUSING_S)
    assert t.refused_report("a", NOW + 2 * REFUSING_S)
    assert t.leader(["a"], NOW + 2 * REFUSING_S) == "m"
    t.forget([])
    assert t.refusing == {}


def test_a_start_is_taken_only_from_a_mate_heard_from() -> None:
    t = trigger("m")
    assert not t.may_lead("a", ["a", "b"], NOW)          # the smallest id, never heard
    t.heard_from(["b"])
    assert t.may_lead("b", ["a", "b"], NOW) and not t.may_lead("a", ["a", "b"], NOW)
    t.heard_from(["a"])
    t.suspect("a", NOW)
    assert t.may_lead("a", ["a", "b"], NOW)   # suspected here, still the leader of others
    assert t.may_lead("b", ["a", "b"], NOW)   # the leader by this peer's suspicions


def test_leader_can_be_this_peer_and_it_is_never_passed_over() -> None:
    t = trigger("b", heard={"c", "d"})
    assert t.leader(["c", "d"], NOW) == "b"
    assert t.leader([], NOW) == "b"
    t.suspect("b", NOW)  # suspecting oneself changes nothing: this peer is alive
    assert t.leader(["c"], NOW) == "b"


def test_a_suspect_is_passed_over_until_suspect_s_has_passed() -> None:
    t = trigger("m", heard={"a", "z"})
    t.suspect("a", NOW)
    assert t.leader(["a", "z"], NOW) == "m"
    assert t.leader(["a", "z"], NOW + SUSPECT_S / 2) == "m"
    assert t.leader(["a", "z"], NOW + SUSPECT_S) == "a"
    assert t.leader(["a", "z"], NOW + 3 * SUSPECT_S) == "a"


def test_a_new_failure_extends_the_suspicion() -> None:
    t = trigger("m", heard={"a"})
    t.suspect("a", NOW)
    t.suspect("a", NOW + SUSPECT_S / 2)
    assert t.leader(["a"], NOW + SUSPECT_S) == "m"
    assert t.leader(["a"], NOW + 1.5 * SUSPECT_S) == "a"


# ---- counting samples -----------------------------------------------------------------------

def test_total_counts_own_samples_and_reports_at_the_current_step_from_mates_only() -> None:
    t = trigger("m", step=3, samples=2)
    t.report("a", 3, 5)
    t.report("b", 2, 100)   # an older step: those samples were averaged already
    t.report("c", 4, 100)   # a later step: not yet
    t.report("x", 3, 7)     # not a mate (any more)
    assert t.total(["a", "b", "c"]) == 2 + 5
    assert t.total([]) == 2
    assert t.total(["a", "x"]) == 2 + 5 + 7


def test_a_report_never_goes_back() -> None:
    t = trigger("m", step=1)
    t.report("a", 1, 6)
    t.report("a", 1, 4)  # an older report overtaken on the wire
    assert t.total(["a"]) == 6
    t.report("a", 2, 1)
    t.report("a", 1, 9)
    assert t.reports["a"] == (2, 1)


def test_a_report_for_a_later_step_counts_once_this_peer_stepped() -> None:
    t = trigger("m", step=0, samples=4)
    t.report("a", 1, 3)  # "a" stepped already; this peer is still finishing step 0
    assert t.total(["a"]) == 4
    t.stepped(1)
    assert t.reports == {"a": (1, 3)}
    assert t.total(["a"]) == 3


def test_stepped_carries_samples_and_drops_reports_of_past_steps() -> None:
    t = trigger("m", step=5, samples=9)
    t.report("a", 5, 4)
    t.report("b", 7, 2)
    t.stepped(6, carried=3)
    assert (t.step, t.samples) == (6, 3)
    assert t.reports == {"b": (7, 2)}
    assert t.total(["a", "b"]) == 3


def test_total_takes_any_iterable_of_mates() -> None:
    t = trigger("m", samples=1)
    t.report("a", 0, 3)
    t.report("b", 0, 4)
    assert t.total(iter(["a", "b"])) == t.total(["a", "b"]) == 8


@given(reports=st.lists(st.tuples(IDS, st.integers(0, 4), st.integers(0, 50)), max_size=20),
       steps=st.lists(st.integers(0, 4), max_size=4), mates=st.sets(IDS, max_size=8),
       own=st.integers(0, 50))
def test_total_matches_the_latest_report_of_each_mate(
        reports: list[tuple[str, int, int]], steps: list[int], mates: set[str],
        own: int) -> None:
    """Reports interleaved with steps: each mate counts with its greatest (step, samples) if
    that is at this peer's step and was not dropped by a step past it."""
    t = trigger("m", samples=own)
    latest: dict[str, tuple[int, int]] = {}
    plan = iter(sorted(steps))
    for i, (peer, step, samples) in enumerate(reports):
        t.report(peer, step, samples)
        latest[peer] = max(latest.get(peer, (step, samples)), (step, samples))
        if i % 5 == 4:  # now and then, the stage steps on
            new = max(next(plan, t.step), t.step)
            t.stepped(new, carried=own)
            latest = {p: r for p, r in latest.items() if r[0] >= new}
    assert t.reports == latest
    assert t.total(mates) == own + sum(s for p, (at, s) in latest.items()
                                       if p in mates and at == t.step)


# ---- ready ----------------------------------------------------------------------------------

def test_ready_once_the_stage_holds_the_target() -> None:
    t = trigger("a", target=10, samples=4)
    assert not t.ready(["b", "c"], NOW)
    t.report("b", 0, 5)
    assert not t.ready(["b", "c"], NOW)
    t.report("c", 0, 1)
    assert t.ready(["b", "c"], NOW)
    assert t.ready(iter(["b", "c"]), NOW)  # any iterable


def test_a_peer_alone_is_ready_with_its_own_samples() -> None:
    t = trigger("a", target=3, samples=3)
    assert t.ready([], NOW)


@given(me=IDS, mates=st.sets(IDS, min_size=1, max_size=6), samples=st.integers(0, 100),
       target=st.integers(1, 100))
def test_only_the_leader_is_ever_ready(me: str, mates: set[str], samples: int,
                                       target: int) -> None:
    mates -= {me}
    t = trigger(me, target=target, samples=samples, heard=set(mates))
    for p in mates:
        t.report(p, 0, samples)
    ready = t.ready(mates, NOW)
    leads = t.leader(mates, NOW) == me
    assert ready == (leads and t.total(mates) >= target)
    if not leads:
        assert not ready


def test_a_follower_becomes_ready_once_the_leader_is_suspected() -> None:
    t = trigger("b", target=2, samples=2, heard={"a"})
    assert not t.ready(["a"], NOW)
    t.suspect("a", NOW)
    assert t.ready(["a"], NOW)
    assert not t.ready(["a"], NOW + SUSPECT_S)


# ---- memory and configuration ---------------------------------------------------------------

@given(known=st.sets(IDS, max_size=10), present=st.sets(IDS, max_size=10))
def test_forget_keeps_only_present_peers(known: set[str], present: set[str]) -> None:
    t = trigger("m")
    for p in known:
        t.report(p, 0, 1)
        t.suspect(p, NOW)
    t.heard_from(known)
    t.forget(present)
    assert set(t.reports) == known & present
    assert set(t.suspects) == known & present
    assert t.heard == (known - {"m"}) & present


@pytest.mark.parametrize("target", [0, -1, -100])
def test_a_target_below_one_is_refused(target: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        RoundTrigger(me="m", target=target)


# ---- a leader behind us (issue 28: a frozen leader, thawed, catching up) ------------------

@given(me=IDS, mates=st.sets(IDS, min_size=1, max_size=6), step=st.integers(1, 100),
       their=st.integers(0, 200), data=st.data())
def test_a_mate_found_behind_never_leads_at_that_step_and_may_again_at_the_next(
        me: str, mates: set[str], step: int, their: int, data: st.DataObject) -> None:
    mates.discard(me)
    if not mates:
        return
    t = trigger(me, step=step, heard=set(mates))
    peer = data.draw(st.sampled_from(sorted(mates)))
    behind = t.passed_over(peer, their)
    assert behind == (their <= step - PASS_OVER_BEHIND)
    assert (t.leader(mates, NOW) == peer) == (not behind and peer == min([me, *mates]))
    t.stepped(step + 1)
    assert t.leader(mates, NOW) == min([me, *mates])


def test_a_leader_one_step_behind_is_replaying_that_step_and_still_leads() -> None:
    t = trigger("m", step=5, heard={"a"})
    assert not t.passed_over("a", 4)
    assert t.leader(["a"], NOW) == "a"


def test_a_mate_heard_at_our_step_after_being_found_behind_leads_again() -> None:
    t = trigger("m", step=5, heard={"a"})
    assert t.passed_over("a", 3)
    assert t.leader(["a"], NOW) == "m"
    assert not t.passed_over("a", 5)
    assert t.leader(["a"], NOW) == "a"
    t.passed_over("a", 3)
    t.forget([])
    assert t.behind == {}
