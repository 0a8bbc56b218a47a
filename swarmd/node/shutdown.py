"""How a daemon spends its shutdown grace (``node.shutdown_grace_s``): pure, ``now`` passed in.

A stop (SIGTERM, SIGINT, ``POST /api/v0/stop``) runs in phases, each with its own deadline
inside the grace::

    now ──── drain ────▶ drain_until ── save ──▶ save_until ── close ──▶ close_until (= now + grace)
         microbatches in flight here       the checkpoint       host, API, membership
         finish their backward             (abandoned at        (whatever is left; the
         (the rest are handed back)        save_until)          process exits 0)

``hard_until`` (``close_until`` + ``HARD_MARGIN_S``) is the last resort: a process still there
then is ended by a watchdog, still with status 0 (every file it writes is written atomically).

The drain ends early once nothing is in flight, and the save may then use everything up to
``save_until``. A second stop request during the grace hurries: no more waiting for
microbatches, a save in progress is abandoned, and the host is closed at once.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the longest the closing (API, membership, host) is given, and at most this share of the grace
CLOSE_RESERVE_S = 1.5
CLOSE_SHARE = 0.2
#: the save gets its measured duration times this, plus ``SAVE_SLACK_S``...
SAVE_SAFETY = 2.0
SAVE_SLACK_S = 0.5
#: ...but never more than this share of what is left after the close reserve
SAVE_MAX_SHARE = 0.5
#: past the grace, a watchdog ends the process (a stop that hangs must not outlive its budget)
HARD_MARGIN_S = 1.5
#: after a second stop request, at most this long to close what is still open
HURRY_S = 1.5


@dataclass(frozen=True, slots=True, kw_only=True)
class StopBudget:
    """Deadlines (monotonic seconds) of one stop's phases; see the module's doc."""

    started_at: float
    drain_until: float
    save_until: float
    close_until: float
    hard_until: float

    def left(self, now: float) -> float:
        """Seconds of the grace left at ``now`` (0 once it is over)."""
        return max(0.0, self.close_until - now)

    def hurried(self, now: float) -> StopBudget:
        """The budget after a second stop request at ``now``: nothing more to drain or save,
        at most ``HURRY_S`` to close (never later than planned)."""
        close = min(self.close_until, now + HURRY_S)
        return StopBudget(started_at=self.started_at, drain_until=min(self.drain_until, now),
                          save_until=min(self.save_until, now), close_until=close,
                          hard_until=min(self.hard_until, close + HARD_MARGIN_S))


def plan_stop(grace_s: float, *, now: float, save_estimate_s: float | None) -> StopBudget:
    """Split ``grace_s`` into the drain, the save and the close.

    ``save_estimate_s`` is how long the last checkpoint save took (None: none saved yet, the
    save gets ``SAVE_SLACK_S``). The close gets ``CLOSE_RESERVE_S`` (at most ``CLOSE_SHARE``
    of the grace); the save ``SAVE_SAFETY`` times its estimate plus ``SAVE_SLACK_S`` (at most
    ``SAVE_MAX_SHARE`` of the rest); the drain the remainder.
    """
    if not grace_s > 0:
        raise ValueError(f"the shutdown grace must be more than 0 s, got {grace_s!r}")
    estimate = max(0.0, save_estimate_s or 0.0)
    close_s = min(CLOSE_RESERVE_S, CLOSE_SHARE * grace_s)
    rest = grace_s - close_s
    save_s = min(SAVE_SAFETY * estimate + SAVE_SLACK_S, SAVE_MAX_SHARE * rest)
    close_until = now + grace_s
    save_until = close_until - close_s
    return StopBudget(started_at=now, drain_until=save_until - save_s, save_until=save_until,
                      close_until=close_until, hard_until=close_until + HARD_MARGIN_S)


#: what a stop request means, by how many came before it
BEGIN, HURRY, IGNORE = "begin", "hurry", "ignore"


class StopRequests:
    """Counts stop requests: the first begins the graceful stop, the second hurries it, any
    later one changes nothing."""

    def __init__(self) -> None:
        self.count = 0

    def request(self) -> str:
        self.count += 1
        return BEGIN if self.count == 1 else HURRY if self.count == 2 else IGNORE
