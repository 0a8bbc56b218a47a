"""Where a new peer goes (``--stage auto``): the stage that limits the pipeline. Pure.

The pipeline runs at the speed of its slowest stage, so a newcomer joins the stage with the
lowest total throughput. Before anyone has measured anything (all totals 0), the stage with the
fewest peers wins, so that the first peers of a swarm spread over all stages; remaining ties are
broken at random so that simultaneous newcomers do not all pick the same stage. Only stages the
peer can hold count (``fits``: those its ``limits.device_memory_bytes`` holds; None: all).

A peer restarting with checkpoints in its home (:func:`place`) serves its checkpoint's stage
again: after a whole swarm restarts, its checkpoints may be the only copy of that stage's
training. It goes elsewhere only when the swarm clearly needs it there: another stage has no
peer at all while the checkpoint's stage has one (which holds that stage's state).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass


def choose_stage(totals: Sequence[float], peers: Sequence[int], rng: random.Random,
                 fits: Collection[int] | None = None) -> int:
    """Index of the stage to serve, given each stage's total throughput and peer count (one
    of ``fits`` when given; ``ValueError`` when none of them is a stage)."""
    if not totals or len(totals) != len(peers):
        raise ValueError("choose_stage needs one total and one peer count per stage")
    stages = [s for s in range(len(totals)) if fits is None or s in fits]
    if not stages:
        raise ValueError("no stage fits this peer")
    return min(stages, key=lambda s: (totals[s], peers[s], rng.random()))


@dataclass(frozen=True, slots=True)
class Placement:
    """The stage to serve and why: ``"checkpoint"`` (the home's), ``"needed"`` (a stage with
    no peer, though the home holds a checkpoint of another) or ``"bottleneck"``."""

    stage: int
    reason: str


def place(saved: Collection[int], totals: Sequence[float], peers: Sequence[int],
          rng: random.Random, fits: Collection[int] | None = None,
          present: Sequence[int] | None = None) -> Placement:
    """Where a peer whose home holds checkpoints of the ``saved`` stages goes (see the module
    doc); with none that is a stage here and fits, :func:`choose_stage`. ``present``: the
    peers announced on each stage in any state (a peer still loading its state counts: the
    stage is not empty); defaults to ``peers`` (the routable ones)."""
    stages = len(totals)
    present = peers if present is None else present
    if len(peers) != stages or len(present) != stages:
        raise ValueError("place needs one total and one peer count per stage")
    own = [s for s in saved if 0 <= s < stages and (fits is None or s in fits)]
    if not own:
        return Placement(choose_stage(totals, peers, rng, fits), "bottleneck")
    home = min(own, key=lambda s: (present[s], totals[s], rng.random()))
    empty = [s for s in range(stages) if present[s] == 0 and (fits is None or s in fits)]
    if present[home] > 0 and empty:
        return Placement(choose_stage(totals, peers, rng, empty), "needed")
    return Placement(home, "checkpoint")
