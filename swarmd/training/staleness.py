"""Staleness compensation of a stage's optimizer step: pure decision logic (no I/O, no clock).

With the pipeline kept full, a stage's gradients are late: a microbatch's backward arrives a
few optimizer steps after its forward (``StageWorker`` measures it exactly, per backward, in
steps), so the gradient a step applies was computed on weights a few steps old. "Asynchrony
begets momentum" (Mitliagkas et al., 2016): a gradient applied ``tau`` steps late keeps acting
like momentum of its own, so the total momentum of a stale schedule is higher than the
optimizer's. The answer is to lower the optimizer's explicit momentum (Adam's ``beta1``) as the
lateness grows, so that explicit and implicit momentum together stay near what the
synchronous schedule has:

    beta1(tau) = 1 - (1 - beta1) x (1 + k x tau),  within [MIN_BETA1, beta1]

``tau`` the samples-weighted mean lateness (in steps) of the gradients the step applies,
``k`` ``training.stale_momentum`` (0: off; Mitliagkas et al.'s model is k = 1). No lateness,
no change: the synchronous schedule and its exactness are untouched. Measured in
docs/pipeline.md ("Staleness compensation").
"""

from __future__ import annotations

import math

#: ``training.stale_momentum``'s default: k in beta1(tau) above
STALE_MOMENTUM = 0.5
#: beta1 is never lowered below this
MIN_BETA1 = 0.0


def stale_beta1(base: float, lateness: float, *, k: float = STALE_MOMENTUM) -> float:
    """Adam's beta1 for a step whose gradients are ``lateness`` steps late on average, the
    optimizer's own being ``base``. ``base`` when nothing is late, ``k`` is 0, or either is
    not a finite number (a bad measurement changes nothing)."""
    if not (math.isfinite(base) and math.isfinite(lateness) and math.isfinite(k)):
        return base
    if lateness <= 0 or k <= 0 or not 0 <= base < 1:
        return base
    return max(min(MIN_BETA1, base), min(base, 1.0 - (1.0 - base) * (1.0 + k * lateness)))


def mean_lateness(late_samples: float, samples: int) -> float:
    """The samples-weighted mean lateness of an accumulated gradient: ``late_samples`` is the
    sum over its backwards of (steps late x samples); 0 without samples."""
    if samples <= 0 or not math.isfinite(late_samples) or late_samples <= 0:
        return 0.0
    return late_samples / samples
