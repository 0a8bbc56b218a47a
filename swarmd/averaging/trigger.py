"""When the peers of a stage average and step, and who calls the round. Pure: no I/O.

Every peer of a stage accumulates gradients from the microbatches it serves. The stage steps
once its peers together hold ``target`` samples at the current step. One peer calls each round:
the *leader*, the smallest peer id among the stage's live peers that this peer has *heard from*
(it answered one of this peer's round messages, or an honest leader's round counted it in) and
does not suspect (a peer is suspected for a while after a message to it failed). The others
report their progress (step, samples) to the leader, which adds them up. A report for a later
step than the leader's is kept: the leader may simply not have finished its own last round yet.

A smaller mate not yet heard from (a *stranger*: new, or a liar that takes messages and never
answers) is probed off the critical path (``strangers``: the peer sends it its progress report
too, and waits for nobody): an honest newcomer answers within a round trip and leads from then
on; a silent one never leads anyone, so it costs the stage's steps nothing. By id alone, a peer
that announces itself at a stage with an id that sorts first and never answers held every
round of that stage for the whole patience, again after each suspicion ran out. A mate that
refuses every report of ours (a typed error: it is there, and its view may lag ours for a
moment) for ``REFUSING_S`` is suspected too: one answering only errors held its stage forever.

A leader found ``PASS_OVER_BEHIND`` or more steps behind this peer (its answer to a report
says so: it froze, or restarted, and is catching up) is passed over *at this step*
(``passed_over``): this peer
leads, or reports to the next; at its next step it tries the smallest id again, so a leader
that caught up leads again without a timer.

Every peer computes the leader from the same membership view, so they agree without an
election; when they briefly disagree (a view not yet converged), two leaders may each call a
round with part of the stage, and the peers left out catch up from their neighbours' state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["RoundTrigger", "exact_step", "PASS_OVER_BEHIND", "REFUSING_S", "SUSPECT_S"]

#: how long a peer that failed us is passed over as leader
SUSPECT_S = 10.0
#: a mate that refused every report of ours this long (its view of the stage may lag ours
#: for a few announcement periods; a liar answering with errors would lag forever) fails us
REFUSING_S = 10.0
#: a leader this many steps or more behind ours is passed over at our step (it froze, or
#: restarted: a download and a replay away); one step behind is a leader replaying that step
#: (``swarmd.state.catchup``: one gradient fetched and applied), waited for as any leader is,
#: or a newcomer that just caught up would chase a stage that no longer waits for it
PASS_OVER_BEHIND = 2


@dataclass(slots=True)
class RoundTrigger:
    me: str
    #: samples the stage accumulates, over all its peers, per step
    target: int
    step: int = 0
    #: samples this peer accumulated at ``step``
    samples: int = 0
    #: the latest (step, samples) each other peer reported
    reports: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: peer -> until when it is passed over as leader
    suspects: dict[str, float] = field(default_factory=dict)
    #: peer -> the step of ours at which it was found behind us (passed over at that step)
    behind: dict[str, int] = field(default_factory=dict)
    #: mates that answered one of our round messages, or were in a round we took part in
    heard: set[str] = field(default_factory=set)
    #: peer -> when it began refusing our reports (none taken since)
    refusing: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target < 1:
            raise ValueError("RoundTrigger needs a target of at least 1 sample")

    def leader(self, mates: Iterable[str], now: float) -> str:
        """The peer that calls rounds: the smallest live id heard from and not suspected
        (maybe this one)."""
        live = [p for p in mates if p in self.heard and self.suspects.get(p, 0.0) <= now
                and self.behind.get(p) != self.step]
        return min([self.me, *live])

    def strangers(self, mates: Iterable[str], now: float) -> list[str]:
        """The mates to probe: those not heard from yet, not suspected, whose ids sort before
        the leader's (each would lead once heard from), smallest first."""
        leader = self.leader(mates, now)
        return sorted(p for p in mates if p < leader and p not in self.heard
                      and self.suspects.get(p, 0.0) <= now)

    def may_lead(self, peer: str, mates: Iterable[str], now: float) -> bool:
        """Whether this peer takes a round ``start`` from ``peer``: only from a mate heard
        from that leads by this peer's view, with or without the suspicions held here (a
        leader this peer suspects after one failed message is still the leader of the
        others)."""
        mates = list(mates)
        if peer == self.me or peer not in mates or peer not in self.heard:
            return False
        return peer == self.leader(mates, now) or \
            peer == min([self.me, *(p for p in mates if p in self.heard)])

    def suspect(self, peer: str, now: float) -> None:
        self.suspects[peer] = now + SUSPECT_S

    def heard_from(self, peers: Iterable[str]) -> None:
        """``peers`` answered a round message of ours, or were counted in a round by a leader
        that answered us: they may lead."""
        self.heard.update(p for p in peers if p != self.me)

    def took_report(self, peer: str) -> None:
        """``peer`` took a report of ours."""
        self.refusing.pop(peer, None)
        self.heard_from([peer])

    def refused_report(self, peer: str, now: float) -> bool:
        """``peer`` refused a report of ours (a typed error: it is there). True when it has
        refused every one for ``REFUSING_S``: it is suspected (passed over as leader) from
        now, as a mate that does not answer is."""
        since = self.refusing.setdefault(peer, now)
        self.heard_from([peer])
        if now - since < REFUSING_S:
            return False
        self.suspect(peer, now)
        return True

    def answered(self, peer: str) -> None:
        """``peer``, suspected for not answering in time, answered after all: slow, not gone."""
        self.suspects.pop(peer, None)
        self.heard_from([peer])

    def passed_over(self, peer: str, their_step: int) -> bool:
        """``peer`` said it is at ``their_step``: when that is ``PASS_OVER_BEHIND`` or more
        before ours it does not lead us at our step (True); else it may (False)."""
        if their_step <= self.step - PASS_OVER_BEHIND:
            self.behind[peer] = self.step
            return True
        self.behind.pop(peer, None)
        return False

    def report(self, peer: str, step: int, samples: int) -> None:
        held = self.reports.get(peer)
        if held is None or (step, samples) >= held:
            self.reports[peer] = (step, samples)

    def total(self, mates: Iterable[str]) -> int:
        """Samples the stage holds at this peer's step, as far as this peer knows."""
        mates = set(mates)
        return self.samples + sum(s for p, (st, s) in self.reports.items()
                                  if st == self.step and p in mates)

    def ready(self, mates: Iterable[str], now: float) -> bool:
        """True when this peer should call a round now: it leads and the target is reached."""
        mates = list(mates)
        return self.leader(mates, now) == self.me and self.total(mates) >= self.target

    def stepped(self, step: int, carried: int = 0) -> None:
        """The stage moved to ``step``; ``carried`` samples already count toward it."""
        self.step, self.samples = step, carried
        self.reports = {p: r for p, r in self.reports.items() if r[0] >= step}
        self.behind = {p: s for p, s in self.behind.items() if s >= step}

    def forget(self, present: Iterable[str]) -> None:
        """Drop what is held about peers no longer in the stage (bounded memory)."""
        keep = set(present)
        self.reports = {p: r for p, r in self.reports.items() if p in keep}
        self.suspects = {p: t for p, t in self.suspects.items() if p in keep}
        self.behind = {p: s for p, s in self.behind.items() if p in keep}
        self.heard &= keep
        self.refusing = {p: t for p, t in self.refusing.items() if p in keep}


def exact_step(sources: Iterable[tuple[str, int]], samples: int, target: int
               ) -> tuple[tuple[str, int], ...] | None:
    """The trainer steps a stage step's samples all came from, one per trainer (sorted), when
    the step is exactly one target batch of them; None otherwise: that step is not reported
    to the trainers and each part clips its own gradient (``swarmd.pipeline.exact``).

    With several trainers a target batch is split between them (``swarmd.trainer.shares``): each
    sends its share of every step, and the stage holds exactly ``target`` samples once every
    trainer's share of the step came in. A trainer named twice (two of its steps mixed in),
    ``("", -1)`` ("more sources than were kept"), or a sample count other than ``target`` (a
    step that took part of another step's samples, or is missing some) is not exact."""
    distinct = sorted(set(sources))
    if not distinct or samples != target:
        return None
    trainers = [t for t, _ in distinct]
    if len(set(trainers)) != len(trainers) or not all(t and s >= 0 for t, s in distinct):
        return None
    return tuple(distinct)
