"""Where a new peer goes (``--stage auto``): the stage that limits the pipeline. Pure.

The pipeline runs at the speed of its slowest stage, so a newcomer joins the stage with the
lowest total throughput. Before anyone has measured anything (all totals 0), the stage with the
fewest peers wins, so that the first peers of a swarm spread over all stages; remaining ties are
broken at random so that simultaneous newcomers do not all pick the same stage.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def choose_stage(totals: Sequence[float], peers: Sequence[int], rng: random.Random) -> int:
    """Index of the stage to serve, given each stage's total throughput and peer count."""
    if not totals or len(totals) != len(peers):
        raise ValueError("choose_stage needs one total and one peer count per stage")
    return min(range(len(totals)), key=lambda s: (totals[s], peers[s], rng.random()))
