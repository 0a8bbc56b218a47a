"""The gate a step closes: a new forward waits for it only briefly (then is refused with busy),
so a step that waits out a lost microbatch does not make new ones miss their deadlines; with
``serving.step_drains`` as long as the recent step closes lasted (bounded)."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.pipeline import stepping
from swarmd.pipeline.stepping import Gate


class _Worker:
    """``held``: the microbatches saved here, forwarded at ``born`` (a time; those not in it:
    just now)."""

    def __init__(self, held: str = "lost") -> None:
        self.held = {held}  # by default a microbatch whose backward never comes
        self.born: dict[str, float] = {}
        self.samples_accumulated = 0
        self.slowest_backward_s = 0.0

    @property
    def saved(self) -> int:
        return len(self.held)

    def saved_within(self, now: float, age_s: float) -> int:
        return sum(1 for mb in self.held if now - self.born.get(mb, now) <= age_s)

    def holds(self, mb: str) -> bool:
        return mb in self.held

    def drop_forwarded_before(self, when: float, keep: Any = ()) -> list[str]:
        gone = [mb for mb in self.held if self.born.get(mb, when) < when and mb not in keep]
        self.held -= set(gone)
        return gone

    def expire(self, now: float) -> list[str]:
        gone, self.held = list(self.held), set()
        return gone


class _Compute:
    queued = 0  # calls waiting for or in the compute thread

    async def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def test_a_forward_at_a_closed_gate_gives_up_after_its_wait_and_a_step_drops_the_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stepping, "DRAIN_S", 0.5)
    counters: Counter[str] = Counter()
    gate = Gate(_Worker(), _Compute(), counters, stage=0)  # type: ignore[arg-type]

    async def scenario() -> list[Any]:
        step = asyncio.ensure_future(gate.when_drained(lambda: "stepped"))
        await asyncio.sleep(0)
        waited = await gate.wait_open(0.05)   # the step still waits for the lost one
        stepped = await step
        return [waited, stepped, await gate.wait_open(0.05)]

    assert asyncio.run(scenario()) == [False, "stepped", True]
    assert counters["dropped_for_step"] == 1


@pytest.mark.parametrize("drain_steps", [False, True])
def test_a_step_drains_first_only_when_asked(drain_steps: bool) -> None:
    """``serving.step_drains``: a draining step runs once the microbatch in flight came back
    (and new forwards wait meanwhile); a plain step runs at once beside it."""
    worker, counters = _Worker("in flight"), Counter[str]()  # its backward comes back
    gate = Gate(worker, _Compute(), counters, stage=0,  # type: ignore[arg-type]
                drain_steps=drain_steps)

    async def scenario() -> tuple[list[int], bool]:
        seen: list[int] = []
        step = asyncio.ensure_future(gate.between(lambda: seen.append(worker.saved)))
        for _ in range(5):
            await asyncio.sleep(0)
        closed = not await gate.wait_open(0.01)
        worker.held.clear()  # its backward came back
        await asyncio.wait_for(step, 5)
        return seen, closed

    seen, closed = asyncio.run(scenario())
    assert seen == ([0] if drain_steps else [1]) and closed == drain_steps
    assert counters["dropped_for_step"] == 0


def test_step_drains_chooses_the_stages() -> None:
    from swarmd.config.stage import ServingSection

    assert [ServingSection(step_drains=v).drains(s) for v in ("off", "first", "all")
            for s in (0, 1)] == [False, False, True, False, True, True]
    assert ServingSection().max_batch("cpu", 8) == 1
    assert ServingSection().max_batch("cuda", 8) == 8
    assert ServingSection(batch_forwards="on").max_batch("cpu", 8) == 8


def test_a_draining_gate_closes_after_a_steps_worth_and_opens_at_the_step() -> None:
    """``step_samples``: once a step's worth was forwarded the next forwards wait for that
    step, which then applies exactly those (no overshoot: the stage steps as often as
    without draining); the step opens the gate. A cap whose microbatches were all lost opens
    again by itself, but not while a backward is still in the compute thread."""
    worker, compute = _Worker("in flight"), _Compute()
    gate = Gate(worker, compute, Counter(), stage=0,  # type: ignore[arg-type]
                drain_steps=True, step_samples=4)

    async def scenario() -> list[bool]:
        seen = []
        with gate.admitted(2):
            assert gate.in_flight == 2  # the one held and this forward
        seen.append(await gate.wait_open(0.01))      # 2 of 4: open
        with gate.admitted(2):
            assert gate.in_flight == 2  # the one held and this forward
        seen.append(await gate.wait_open(0.1))       # 4 of 4, one held here: closed
        worker.held.clear()
        compute.queued = 1                           # its backward runs, not counted yet
        seen.append(await gate.wait_open(0.1))       # still closed: the step will come
        compute.queued, worker.samples_accumulated = 0, 4
        step = asyncio.ensure_future(gate.between(lambda: None))
        await asyncio.wait_for(step, 5)
        seen.append(await gate.wait_open(0.01))      # the step opened the gate
        worker.samples_accumulated = 0
        with gate.admitted(4):
            assert gate.in_flight == 1  # only this forward: nothing is held any more
        seen.append(await gate.wait_open(1.0))       # capped, nothing left: opens again
        return seen

    assert asyncio.run(scenario()) == [True, False, False, True, True]


def test_a_forward_waits_at_a_draining_gate_as_long_as_its_recent_closes_lasted() -> None:
    """With ``step_drains`` the gate closes for every step: each close (cap to reopen) is
    timed, and a new forward waits up to twice the longest recent one, so a drain as long as
    the usual ones refuses nobody with busy; a restore's drain is not timed."""
    now = [100.0]
    worker = _Worker("in flight")
    counters: Counter[str] = Counter()
    gate = Gate(worker, _Compute(), counters, stage=0,  # type: ignore[arg-type]
                clock=lambda: now[0], drain_steps=True, step_samples=4)
    assert gate.wait_s() == stepping.GATE_WAIT_S  # nothing measured yet

    async def one_step(lasting: float) -> None:
        with gate.admitted(4):  # a step's worth: the gate closes
            assert gate.in_flight == 2  # the one held and this forward
        now[0] += lasting
        worker.held.clear()
        worker.samples_accumulated = 4
        await gate.between(lambda: None)
        worker.samples_accumulated = 0
        worker.held.add("in flight")

    async def scenario() -> list[float]:
        seen = []
        await one_step(2.0)
        seen.append(gate.wait_s())
        await one_step(1.0)
        seen.append(gate.wait_s())  # the longest of the recent ones counts
        worker.held.clear()
        await gate.when_drained(lambda: None)  # a restore: not timed
        worker.held.add("in flight")
        seen.append(gate.wait_s())
        for _ in range(stepping.CLOSED_KEEP):
            await one_step(0.5)
        seen.append(gate.wait_s())  # the 2 s close is forgotten; the floor holds
        return seen

    assert asyncio.run(scenario()) == [4.0, 4.0, 4.0, stepping.GATE_WAIT_S]
    # what draining cost, in status: the step closes only (2 + 1 + 8 x 0.5 s)
    assert counters["step_gate_closed_ms"] == 7000


@given(st.lists(st.floats(0, 1e6, allow_nan=False), max_size=10))
def test_the_wait_at_a_draining_gate_stays_within_its_floor_and_cap(closes: list[float]) -> None:
    wait = stepping.gate_wait_s(closes)
    assert stepping.GATE_WAIT_S <= wait <= stepping.GATE_WAIT_MAX_S
    longest = max(closes, default=0.0)
    assert wait == stepping.GATE_WAIT_MAX_S or wait >= stepping.CLOSED_FACTOR * longest


def test_a_forward_refused_after_the_gate_counts_toward_no_step() -> None:
    """A forward counted toward the cap and then refused (``busy`` from the compute queue)
    or lost below will not come back: the cap forgets it and the gate it closed opens, so the
    step still applies a whole step's worth (else it waited, reopened empty, and overshot: the
    stage stepped 136 times in 150 trainer steps with 64 microbatches a step)."""
    worker = _Worker("in flight")
    gate = Gate(worker, _Compute(), Counter(), stage=0,  # type: ignore[arg-type]
                drain_steps=True, step_samples=4)

    async def scenario() -> list[bool]:
        seen = []
        with gate.admitted(2):
            assert gate.in_flight == 2  # the one held and this forward
        with pytest.raises(RuntimeError):
            with gate.admitted(2):  # closes the gate, then is refused
                raise RuntimeError("busy")
        seen.append(await gate.wait_open(0.01))   # open again: 2 of 4 still to come
        gate.uncount(2)                           # the first one's chain failed below
        with gate.admitted(4):
            assert gate.in_flight == 2  # the one held and this forward
        seen.append(await gate.wait_open(0.01))   # 4 of 4: closed for the step
        gate._draining = True                     # a step drains: it opens the gate itself
        gate.uncount(4)
        seen.append(await gate.wait_open(0.01))
        return seen

    assert asyncio.run(scenario()) == [True, False, False]
    assert gate.closes == deque()  # the cap that did not hold was no close


def test_a_microbatch_saved_too_long_holds_neither_a_capped_gate_nor_a_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A microbatch whose chain died after its result reached the trainer never comes back
    here, yet the cap counted it: once it is saved longer than ``LOST_MIN_S`` (or 3 x the
    slowest recent forward-to-backward wait) it is taken for lost, the capped gate opens
    with the samples in hand counted toward the step, and a drain does not wait for such a
    one (before: the gate stayed closed until it expired, 2 minutes; a drain waited 20 s)."""
    monkeypatch.setattr(stepping, "DRAIN_S", 60.0)
    now = [100.0]
    worker = _Worker("dead")
    worker.born["dead"] = 100.0
    counters: Counter[str] = Counter()
    gate = Gate(worker, _Compute(), counters, stage=0,  # type: ignore[arg-type]
                clock=lambda: now[0], drain_steps=True, step_samples=4)

    async def scenario() -> list[bool]:
        seen = []
        with gate.admitted(4):  # 2 for "dead", 2 for one that came back
            pass
        worker.samples_accumulated = 2
        now[0] = 105.0
        seen.append(await gate.wait_open(0.05))    # 5 s: it may still come back
        worker.slowest_backward_s = 4.0            # backwards here took up to 4 s lately
        now[0] = 111.0
        seen.append(await gate.wait_open(0.05))    # 11 s < 3 x 4 s: still waited for
        now[0] = 113.0
        seen.append(await gate.wait_open(0.05))    # taken for lost: the gate opens
        seen.append("dead" in worker.held)
        with gate.admitted(2):                     # 2 in hand + 2: a step's worth again
            worker.held.add("new")                 # saved here, its backward to come
        seen.append(await gate.wait_open(0.01))    # closed for the step
        worker.held, worker.born = {"dead too"}, {"dead too": 90.0}
        worker.samples_accumulated = 4
        await asyncio.wait_for(gate.between(lambda: None), 5)  # no wait for the dead one
        seen.append(await gate.wait_open(0.01))
        return seen

    assert asyncio.run(scenario()) == [False, False, True, False, False, True]
    assert counters["dropped_lost"] == 2 and counters["dropped_for_step"] == 0


def test_a_microbatch_whose_output_is_still_being_passed_on_is_never_taken_for_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its hop went to a stage-1 peer whose link stalled: the hop is rerouted at its derived
    deadline (over ``LOST_MIN_S`` on a slow link) and the microbatch comes back through the
    other peer. Dropping it meanwhile cost a restart of it (seen in the lab: two per 20 s
    stall, their backwards refused with ``unknown_microbatch``). A step's drain waits for it
    (``DRAIN_S`` at most, then it is dropped for the step, as any that did not come back)."""
    monkeypatch.setattr(stepping, "DRAIN_S", 60.0)
    now, ticking = [100.0], [False]

    def clock() -> float:  # while a step drains, each look at the clock is a second later
        now[0] += 1.0 if ticking[0] else 0.0
        return now[0]

    worker = _Worker("rerouted")
    worker.born["rerouted"] = 100.0
    counters: Counter[str] = Counter()
    gate = Gate(worker, _Compute(), counters, stage=0,  # type: ignore[arg-type]
                clock=clock, drain_steps=True, step_samples=2)

    async def scenario() -> list[bool]:
        seen = []
        with gate.admitted(2):
            gate.passing_on.add("rerouted")
            assert gate.in_flight == 2  # the one held and this forward
        now[0] = 100.0 + 3 * stepping.LOST_MIN_S
        seen.append(await gate.wait_open(0.05))    # its hop is still tried: waited for
        seen.append("rerouted" in worker.held)
        ticking[0] = True
        await asyncio.wait_for(gate.between(lambda: None), 30)
        ticking[0] = False
        seen.append(now[0] >= 100.0 + 3 * stepping.LOST_MIN_S + 60.0)  # drained DRAIN_S
        worker.held, worker.born = {"gone"}, {"gone": now[0]}
        with gate.admitted(2):                     # the cap closes the gate again
            gate.passing_on.add("gone")
        now[0] += 3 * stepping.LOST_MIN_S
        seen.append(await gate.wait_open(0.05))
        gate.passing_on.discard("gone")            # its hop ended (had it failed, the
        seen.append(await gate.wait_open(0.05))    # handler forgets it) and nothing came back
        return seen

    assert asyncio.run(scenario()) == [False, True, True, False, True]
    assert counters["dropped_for_step"] == 1 and counters["dropped_lost"] == 1


def test_a_rounds_snapshot_holds_the_draining_gate_closed_until_its_step_or_its_end() -> None:
    """With ``step_drains`` a round's snapshot waits for the microbatch in flight, and the
    gate stays closed until the round steps (a backward landing between snapshot and step
    would count toward the step after); a round that fails, or a snapshot that raises, opens
    it again."""
    worker = _Worker("in flight")
    gate = Gate(worker, _Compute(), Counter(), stage=0,  # type: ignore[arg-type]
                drain_steps=True, step_samples=4)

    async def scenario() -> list[Any]:
        seen: list[Any] = []
        snap = asyncio.ensure_future(gate.hold_for_round(lambda: "snapshot"))
        await asyncio.sleep(0)                         # it closes the gate
        seen.append(await gate.wait_open(0.05))        # closed while it drains
        seen.append(snap.done())                       # waits for the one in flight
        worker.held.clear()
        seen.append(await asyncio.wait_for(snap, 5))
        seen.append(await gate.wait_open(0.05))        # held through the all-reduce
        await gate.between(lambda: None)               # the round's step opens it
        seen.append(await gate.wait_open(0.01))
        gate.round_over()                              # (after the step: nothing to do)
        seen.append(await gate.wait_open(0.01))
        await gate.hold_for_round(lambda: None)
        gate.round_over()                              # failed round: no step, open again
        seen.append(await gate.wait_open(0.01))

        def broken() -> None:
            raise RuntimeError("snapshot failed")
        with pytest.raises(RuntimeError):
            await gate.hold_for_round(broken)
        seen.append(await gate.wait_open(0.01))
        return seen

    assert asyncio.run(scenario()) == [False, False, "snapshot", False, True, True, True, True]
