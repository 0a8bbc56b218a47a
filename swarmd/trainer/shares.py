"""How the trainers of a swarm split a step's microbatches between them. Pure.

A step of the swarm is one target batch (``training.microbatches`` microbatches of
``training.batch_size``, or ``averaging.target_batch_size`` samples), however many trainers
feed it: each trainer sends its share of every step, the stages step once they hold the whole
batch, and the trainers average their parts' gradients before stepping
(``swarmd.trainer.trainer_sync``). Every trainer computes the shares from the same list of
trainers (membership), so they add up to the step without a message; while two views differ
(a trainer joined or left just now) they may not, and that step is not exact
(``swarmd.averaging.trigger.exact_step``).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["share_of"]


def share_of(me: str, others: Iterable[str], microbatches: int) -> int:
    """The microbatches ``me`` sends of a step of ``microbatches``, among the trainers ``me``
    and ``others``: an equal split, the first trainers by id taking one more where it does not
    divide; at least one (more trainers than microbatches overshoot the batch)."""
    if microbatches < 1:
        raise ValueError(f"a step has at least one microbatch, not {microbatches}")
    trainers = sorted({me, *others})
    index, n = trainers.index(me), len(trainers)
    return max(1, microbatches // n + (index < microbatches % n))
