"""How the owner of a part combines the peers' contributions to it. Pure: tensors in, tensor out.

Each contribution is a flat float32 vector ``x_i`` (a peer's mean gradient over its slice of the
model) with a weight ``w_i`` (the samples it saw). Two aggregators:

* ``mean``: the weighted mean ``sum_i w_i x_i / sum_i w_i``.
* ``centered_clip``: CenteredClip (Karimireddy et al. 2021, as used by Gorbunov et al. 2022,
  "Secure Distributed Training at Scale"). Start from the coordinate-wise median ``v``, then
  repeat ``v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i`` where ``clip(z, tau)`` scales ``z``
  to norm at most ``tau``. Each step moves ``v`` by at most ``tau``, and a contribution's pull is
  at most ``w_i tau / sum w``, whatever its size: a peer sending gradients 1000x too large moves
  the result by about ``tau`` times its weight share, not by 1000x. When every contribution lies
  within ``tau`` of the weighted mean, the result is that mean. ``tau`` defaults to
  ``tau_factor`` times the median distance of the contributions to the start, so honest spread
  is kept and outliers are clipped; iterations are bounded and stop once a step is tiny.

Weights are trusted: a peer that claims a huge weight still dominates (weigh by samples that
were verified, or give equal weights, when peers are not trusted).

Non-finite contributions are refused before aggregating: :func:`check_finite` raises
:class:`BadGradient`; the owner leaves that contributor out and counts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from swarmd.errors import BadPeerMessage

__all__ = ["AGGREGATORS", "Aggregator", "AggregateFn", "BadGradient", "centered_clip",
           "check_finite", "weighted_mean"]

#: the signature every aggregator has: contributions and their weights -> one vector
AggregateFn = Callable[[Sequence[torch.Tensor], Sequence[float]], torch.Tensor]
AGGREGATORS = ("mean", "centered_clip")
#: elements per chunk when a coordinate-wise median needs the contributions stacked
_MEDIAN_CHUNK = 1 << 20


class BadGradient(BadPeerMessage):
    """A contribution that cannot be averaged (NaN/Inf, wrong size or dtype, bad weight)."""

    code = "bad_gradient"


def check_finite(vector: torch.Tensor, *, who: str = "a peer") -> None:
    """Raise :class:`BadGradient` unless every value of ``vector`` is finite."""
    # a finite sum proves every value finite, at ~1/30 the cost of isfinite().all(); only a
    # non-finite sum (NaN/Inf inside, or finite values overflowing) needs the exact check
    if math.isfinite(float(vector.sum())):
        return
    if not bool(torch.isfinite(vector).all()):
        bad = int((~torch.isfinite(vector)).sum())
        raise BadGradient("non_finite", f"{who} sent {bad} NaN/Inf values of {vector.numel()}")


def _check_inputs(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> float:
    """Validate shapes, dtypes and weights; return the total weight (positive)."""
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    if not vectors:
        raise ValueError("nothing to aggregate: no contributions")
    first = vectors[0]
    for i, v in enumerate(vectors):
        if v.dtype != torch.float32 or v.dim() != 1 or v.shape != first.shape:
            raise ValueError(f"contribution {i} is {v.dtype} {tuple(v.shape)}; expected flat "
                             f"float32 of {tuple(first.shape)}")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ValueError(f"weight {i} must be finite and non-negative, got {w!r}")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("the weights sum to zero: nothing to average")
    return total


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i x_i / sum_i w_i`` as a new float32 tensor (the inputs are not modified)."""
    total = _check_inputs(vectors, weights)
    out: torch.Tensor | None = None
    for v, w in zip(vectors, weights):
        if not w:
            continue
        if out is None:
            out = torch.mul(v, w / total)
        else:
            out.add_(v, alpha=w / total)
    assert out is not None  # the weights sum to more than zero
    return out


def coordinate_median(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median (the mean of the two middle values for an even count),
    computed in chunks so that at most ``len(vectors)`` x 1 Mi values are stacked at once."""
    n, out = len(vectors), torch.empty_like(vectors[0])
    for start in range(0, out.numel(), _MEDIAN_CHUNK):
        stop = min(start + _MEDIAN_CHUNK, out.numel())
        stacked = torch.stack([v[start:stop] for v in vectors])  # (n, chunk)
        ordered, _ = stacked.sort(dim=0)
        lo, hi = ordered[(n - 1) // 2], ordered[n // 2]
        torch.add(lo, hi, alpha=1.0, out=out[start:stop]).mul_(0.5)
    return out


def centered_clip(vectors: Sequence[torch.Tensor], weights: Sequence[float], *,
                  tau: float | None = None, iters: int = 20, tau_factor: float = 2.0,
                  tol: float = 1e-6) -> torch.Tensor:
    """CenteredClip (see the module doc). ``tau=None``: ``tau_factor`` x the median distance
    of the contributions to the coordinate-wise median. At most ``iters`` steps; stops once a
    step is shorter than ``tol`` x ``tau``."""
    total = _check_inputs(vectors, weights)
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    v = coordinate_median(vectors)
    if tau is None:
        dists = sorted(float(torch.dist(x, v)) for x in vectors)
        mid = len(dists) // 2
        median = dists[mid] if len(dists) % 2 else 0.5 * (dists[mid - 1] + dists[mid])
        tau = tau_factor * median
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be finite and non-negative, got {tau!r}")
    if tau == 0:  # at least half the contributions agree exactly with the median
        return v
    step, diff = torch.empty_like(v), torch.empty_like(v)
    for _ in range(iters):
        step.zero_()
        for x, w in zip(vectors, weights):
            if not w:
                continue
            torch.sub(x, v, out=diff)
            norm = float(diff.norm())
            scale = w / total * (1.0 if norm <= tau else tau / norm)
            step.add_(diff, alpha=scale)
        v.add_(step)
        if float(step.norm()) <= tol * tau:
            break
    return v


@dataclass(frozen=True, slots=True, kw_only=True)
class Aggregator:
    """An aggregator chosen by name, with its parameters; call it like an ``AggregateFn``."""

    #: ``"mean"`` or ``"centered_clip"``
    name: str = "mean"
    #: centered_clip: the clipping radius (None: chosen from the contributions' spread)
    tau: float | None = None
    #: centered_clip: most iterations
    iters: int = 20
    #: centered_clip: tau = this x the median distance to the coordinate-wise median
    tau_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.name not in AGGREGATORS:
            raise ValueError(f"unknown aggregator {self.name!r}: expected one of {AGGREGATORS}")
        if self.tau is not None and not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"tau must be positive, got {self.tau!r}")
        if not (isinstance(self.iters, int) and 1 <= self.iters <= 1000):
            raise ValueError(f"iters must be an integer in 1..1000, got {self.iters!r}")
        if not (math.isfinite(self.tau_factor) and self.tau_factor > 0):
            raise ValueError(f"tau_factor must be positive, got {self.tau_factor!r}")

    @classmethod
    def parse(cls, name: Literal["mean", "centered_clip"] | str) -> Aggregator:
        return cls(name=name.strip())

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        if self.name == "mean":
            return weighted_mean(vectors, weights)
        return centered_clip(vectors, weights, tau=self.tau, iters=self.iters,
                             tau_factor=self.tau_factor)
