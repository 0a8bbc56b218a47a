"""Histograms of durations (hop and step times) for ``/metrics``: pure, thread-safe.

A :class:`Histogram` keeps cumulative counts over fixed upper bounds (seconds), their sum and
count, as Prometheus' histogram type does; :class:`Histograms` is a daemon's set of them by
name (``hop_seconds.forward``, ``step_seconds``). Observations come from the event loop (the
routers' hops) and from the compute thread (a stage's steps), so every method holds a lock.
A value that is not a finite number >= 0 is not observed (``rejected`` counts it): a clock
that steps back must not make a negative bucket.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass

__all__ = ["HOP_BOUNDS_S", "STEP_BOUNDS_S", "Histogram", "HistogramSnapshot", "Histograms"]

#: a hop's round trip: milliseconds on loopback, seconds over a WAN, the 60 s hop deadline
HOP_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
#: the time between a stage peer's optimizer steps: a tiny model on loopback steps several
#: times a second, a WAN swarm's round of 64 microbatches takes tens of seconds
STEP_BOUNDS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """``buckets``: (upper bound, observations <= it), cumulative, the last bound ``inf``."""

    buckets: tuple[tuple[float, int], ...]
    sum: float
    count: int

    def to_json(self) -> dict[str, object]:
        return {"buckets": [["+Inf" if math.isinf(b) else b, n] for b, n in self.buckets],
                "sum": self.sum, "count": self.count}


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)) or not all(
                math.isfinite(b) and b > 0 for b in bounds):
            raise ValueError("bounds must be finite, > 0 and strictly increasing")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last: > max
        self._sum = 0.0
        self._lock = threading.Lock()
        self.rejected = 0

    def observe(self, seconds: float) -> None:
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            with self._lock:
                self.rejected += 1
            return
        i = bisect.bisect_left(self.bounds, seconds)  # the first bound >= seconds
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, math.inf), counts):
            cumulative += n
            buckets.append((bound, cumulative))
        return HistogramSnapshot(tuple(buckets), total, cumulative)


class Histograms:
    """Histograms by dotted name, each made on its first observation with ``bounds``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, Histogram] = {}

    def observe(self, name: str, seconds: float, bounds: tuple[float, ...]) -> None:
        with self._lock:
            histogram = self._by_name.get(name)
            if histogram is None:
                histogram = self._by_name[name] = Histogram(bounds)
        histogram.observe(seconds)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        with self._lock:
            items = sorted(self._by_name.items())
        return {name: h.snapshot() for name, h in items}
