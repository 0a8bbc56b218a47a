"""Where a new peer goes (``--stage auto``): the stage that limits the pipeline. Pure.

The pipeline runs at the speed of its slowest stage, so a newcomer joins the stage with the
lowest total throughput. Before anyone has measured anything (all totals 0), the stage with the
fewest peers wins, so that the first peers of a swarm spread over all stages; remaining ties are
broken at random so that simultaneous newcomers do not all pick the same stage. Only stages the
peer can hold count (``fits``: those its ``limits.device_memory_bytes`` holds; None: all).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence


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
