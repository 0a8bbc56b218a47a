"""An empty stage is filled whatever the throughputs: before any training every peer announces
0, so the totals say "balanced", yet a stage with no peer keeps the swarm from ever training
(and so from ever measuring a throughput). Pure."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from test_balancing import CONFIG, Swarm, decisions, load_of, movers

from swarmd.balancing.policy import (
    Balancer, BalancingConfig, PeerLoad, SwarmLoad, decide, fill_plan, swarm_gain,
)


def test_two_peers_on_one_stage_of_two_with_no_throughput_yet_one_moves() -> None:
    # two --stage auto daemons raced onto stage 0: stage 1 has nobody, nothing is measured
    load = load_of([[0.0, 0.0], []])
    assert swarm_gain(load) == math.inf       # a caller must not skip the checks
    assert movers(load) == {"s0-001": 1}      # the same plan for both: the larger peer id
    assert decide(load, "s0-000", CONFIG).reason == "not_chosen"
    d = decide(load, "s0-001", CONFIG)
    assert (d.move_to, d.reason, d.gain) == (1, "fill", math.inf)
    # through the same hysteresis as any move
    bal = Balancer("s0-001", BalancingConfig(confirmations=3))
    assert [bal.check(load, t) for t in (0.0, 10.0, 20.0)] == [None, None, 1]


def test_all_throughputs_zero_one_peer_per_empty_stage_from_the_most_crowded() -> None:
    load = SwarmLoad.from_peers(4, [
        PeerLoad(peer_id=p, stage=s, throughput=0.0, state=st_)
        for p, s, st_ in [("a", 0, "online"), ("b", 0, "online"), ("c", 0, "online"),
                          ("d", 1, "online"), ("e", 1, "online"), ("f", 2, "joining")]])
    # stage 3 has nobody; stage 2 has a peer on its way (not empty); stage 0 spares the most
    assert fill_plan(load) == {"c": 3}
    assert movers(load) == {"c": 3}
    assert decide(load, "f", CONFIG).reason == "not_online"
    # once the mover announces it is migrating there, nobody else follows
    load.set(PeerLoad(peer_id="c", stage=3, throughput=0.0, state="migrating"))
    assert fill_plan(load) == {} and movers(load) == {}


def test_several_empty_stages_are_filled_at_once_without_emptying_a_stage() -> None:
    load = load_of([[0.0, 0.0, 0.0], [0.0, 0.0], [], [], [], []])
    plan = fill_plan(load)
    assert movers(load) == plan and sorted(plan.values()) == [2, 3, 4]   # one per empty stage
    assert sorted(plan) == ["s0-001", "s0-002", "s1-001"]               # as far as spares go
    assert decide(load, "s0-000", CONFIG).reason == "not_chosen"


def test_the_smallest_peer_of_the_donor_moves_and_a_lone_peer_never() -> None:
    load = load_of([[30.0, 5.0, 12.0], [40.0], []])
    assert movers(load) == {"s0-001": 2}        # stage 0 is the one with a spare: its 5 goes
    assert movers(load_of([[7.0], [3.0], []])) == {}   # nobody can spare a peer: as before


def test_a_chosen_peer_that_cannot_hold_the_empty_stage_stays() -> None:
    load = load_of([[0.0, 0.0], []])
    d = decide(load, "s0-001", CONFIG, fits={0})
    assert (d.move_to, d.reason) == (None, "does_not_fit")


def test_a_swarm_that_starts_with_empty_stages_fills_them_and_then_settles() -> None:
    peers = [(f"p{i}", 0, 0.0) for i in range(5)] + [("q0", 1, 0.0), ("q1", 1, 0.0)]
    swarm = Swarm(4, peers, seed=4)
    swarm.run(600.0)
    assert all(n >= 1 for n in swarm.load.online_counts())
    assert len(swarm.moves) == 2                 # one move per empty stage, no more
    assert {to for *_, to in swarm.moves} == {2, 3}
    swarm.run(3600.0)
    assert len(swarm.moves) == 2


@st.composite
def views_with_an_empty_stage(draw: st.DrawFn) -> SwarmLoad:
    """Any view with at least one empty stage and one stage with >= 2 online peers."""
    stages = draw(st.integers(2, 6))
    empty = draw(st.integers(0, stages - 1))
    donor = draw(st.integers(0, stages - 2))
    donor += donor >= empty
    peers = [PeerLoad(peer_id=f"d{i}", stage=donor, state="online",
                      throughput=draw(st.sampled_from([0.0, 1.0, 40.0]))) for i in range(2)]
    for s in range(stages):
        if s == empty:
            continue
        for i in range(draw(st.integers(0, 5))):
            peers.append(PeerLoad(
                peer_id=draw(st.sampled_from(["", "x", "y"])) + f"p{s}-{i}", stage=s,
                throughput=draw(st.sampled_from([0.0, 0.0, 1.0, 2.0, 7.5, 40.0])),
                state=draw(st.sampled_from(["online"] * 3 + ["joining", "migrating"]))))
    return SwarmLoad.from_peers(stages, peers)


@settings(max_examples=400, deadline=None)
@given(views_with_an_empty_stage(), st.sampled_from([0.0, 0.05, 0.3, 100.0]))
def test_exactly_the_planned_peers_move_to_the_empty_stages(
        load: SwarmLoad, threshold: float) -> None:
    config = BalancingConfig(threshold=threshold)
    counts, online = load.planned_counts(), load.online_counts()
    empty = [s for s, n in enumerate(counts) if n == 0]
    spare = sum(max(0, n - 1) for n in online)
    assert empty and spare >= 1
    chosen = movers(load, config)           # every peer's own decision, counted
    assert len(chosen) == min(len(empty), spare)
    assert sorted(chosen.values()) == empty[:len(chosen)]      # distinct empty stages
    assert chosen == fill_plan(load)
    assert swarm_gain(load) == math.inf
    leaving = [0] * load.stages
    for pid in chosen:
        me = load.get(pid)
        assert me is not None and me.state == "online"
        leaving[me.stage] += 1
    assert all(leaving[s] < online[s] for s in range(load.stages) if leaving[s])
    assert all(d.reason in ("fill", "not_chosen", "not_online")
               for d in decisions(load, config).values())
