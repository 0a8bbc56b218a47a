"""A token bucket for byte rates: pure, time passed in.

``TokenBucket(rate_bytes_s, burst)`` starts full (``burst`` tokens) and refills at
``rate_bytes_s`` up to ``burst``. ``take(n, now)`` *reserves* ``n`` bytes at once and returns how
long the caller must wait before sending (or, for a receiver, before reading more): the balance
may go negative, so a take larger than ``burst`` works, and concurrent callers are served in the
order they asked (a later take waits for the earlier ones' debt too). A caller that waits the
returned time is granted; bytes granted by time ``t`` (counted from the first ``now``) never
exceed ``burst + rate_bytes_s * t``.

``now`` must come from one monotonic clock; a ``now`` earlier than the last one is treated as
the last one (no refill, never a negative wait).

The bucket keeps its own accounting (``granted_bytes``, ``throttled_bytes``, ``waited_s``) so
tests and status pages can check the cap without timing anything.
"""

from __future__ import annotations

import math

__all__ = ["TokenBucket", "default_burst"]

#: smallest default burst: a few yamux frames' worth of headers and small messages
MIN_BURST_BYTES = 16 * 1024
#: the default burst is this many seconds of the rate
BURST_SECONDS = 0.25


def default_burst(rate_bytes_s: float) -> int:
    """The burst a cap gets when none is given: a quarter second of the rate, at least 16 KiB."""
    return max(MIN_BURST_BYTES, int(rate_bytes_s * BURST_SECONDS))


class TokenBucket:
    """Bytes per second with a burst allowance. Not thread-safe: one owner (the trio thread)."""

    __slots__ = ("rate", "burst", "_tokens", "_last", "granted_bytes", "throttled_bytes",
                 "waited_s", "takes", "started_at", "paid_until")

    def __init__(self, rate_bytes_s: float, burst: int | None = None) -> None:
        if not (isinstance(rate_bytes_s, (int, float)) and math.isfinite(rate_bytes_s)
                and rate_bytes_s > 0):
            raise ValueError(f"TokenBucket rate must be a positive number of bytes per second, "
                             f"got {rate_bytes_s!r}")
        burst = default_burst(rate_bytes_s) if burst is None else burst
        if not isinstance(burst, int) or isinstance(burst, bool) or burst < 1:
            raise ValueError(f"TokenBucket burst must be a positive integer, got {burst!r}")
        self.rate = float(rate_bytes_s)
        self.burst = burst
        self._tokens = float(burst)
        self._last: float | None = None
        #: bytes reserved so far (all takes)
        self.granted_bytes = 0
        #: bytes of the takes that had to wait
        self.throttled_bytes = 0
        #: sum of the waits returned
        self.waited_s = 0.0
        self.takes = 0
        #: the ``now`` of the first take (None before it)
        self.started_at: float | None = None
        #: when the last reservation is paid: ``granted_bytes <= burst + rate * (paid_until -
        #: started_at)``, so a capped transfer of N bytes spans at least (N - burst) / rate
        self.paid_until: float | None = None

    def _refill(self, now: float) -> None:
        if self._last is None:
            self._last = self.started_at = now
            return
        if now > self._last:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
            self._last = now

    def take(self, n: int, now: float) -> float:
        """Reserve ``n`` bytes at ``now``; the seconds to wait before using them (0: go now)."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of bytes ({n})")
        self._refill(now)
        self.takes += 1
        self.granted_bytes += n
        self._tokens -= n
        now = self._last  # a clock that went back counts as the last time seen
        wait = 0.0 if self._tokens >= 0 else -self._tokens / self.rate
        if wait > 0:
            self.throttled_bytes += n
            self.waited_s += wait
        self.paid_until = max(self.paid_until or now, now + wait)
        return wait

    def available(self, now: float) -> float:
        """Tokens at ``now`` (negative: debt still to be waited out). Does not take any."""
        if self._last is None:
            return float(self.burst)
        if now <= self._last:
            return self._tokens
        return min(float(self.burst), self._tokens + (now - self._last) * self.rate)
