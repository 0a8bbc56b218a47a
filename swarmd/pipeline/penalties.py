"""Protocol violations remembered per peer: the long bans of ``swarmd.pipeline.wiring``. Pure.

A violation is what no network fault explains: a reply or message that fails validation, a
wrong shape or dtype from a peer that announced our model, a forged sender (``BadPeerMessage``
and its kinds in swarmd/errors.py). Each *episode* (a violation after the last ban ended) bans
for longer; violations during a ban are counted but do not lengthen it (they were sent before
the ban was known). The book outlives a peer's listing in the wiring (a peer that leaves and
re-announces is still banned) and holds at most ``capacity`` peers: beyond it the one whose
ban ended first is forgotten. Time is a parameter (``now``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["CONTENT_REASONS", "MAX_REMEMBERED", "MAX_REASON_CHARS", "Violations",
           "ViolationBook", "clean_reason"]

#: reasons of a refused message (``BadPeerMessage.reason``) that are its sender's violation
#: whatever the timing: its content is wrong (an honest peer of our model never sends these);
#: authority mismatches an honest race can cause (a path, an expired microbatch) are not here
CONTENT_REASONS = frozenset({"shape", "dtype", "type", "not_finite", "too_large", "malformed",
                             "out_of_range"})
#: violators remembered
MAX_REMEMBERED = 1024
#: a reason is kept to this many characters (it may come from a remote peer's message)
MAX_REASON_CHARS = 64


def clean_reason(reason: object) -> str:
    """A short printable reason."""
    text = "".join(c for c in str(reason)[:MAX_REASON_CHARS] if c.isprintable())
    return text or "unspecified"


@dataclass(slots=True)
class Violations:
    """One peer's record: violations counted, ban episodes, when the ban ends, last reason."""

    count: int = 0
    episodes: int = 0
    until: float = 0.0
    reason: str = ""


class ViolationBook:
    """Violations by peer id; ``ban_s(episodes)`` is the length of an episode's ban."""

    def __init__(self, ban_s: Callable[[int], float], capacity: int = MAX_REMEMBERED) -> None:
        if capacity < 1:
            raise ValueError("ViolationBook needs capacity >= 1")
        self._ban_s = ban_s
        self.capacity = capacity
        self._records: dict[str, Violations] = {}
        #: violations recorded, peers forgotten to make room
        self.recorded = 0
        self.forgotten = 0

    def record(self, peer_id: str, reason: object, now: float) -> float | None:
        """Count a violation of ``peer_id``; returns when its new ban ends, or None when a ban
        is already in force (the same episode)."""
        v = self._records.get(peer_id)
        if v is None:
            if len(self._records) >= self.capacity:
                oldest = min(self._records, key=lambda i: self._records[i].until)
                del self._records[oldest]
                self.forgotten += 1
            v = self._records[peer_id] = Violations()
        v.count += 1
        v.reason = clean_reason(reason)
        self.recorded += 1
        if v.until > now:
            return None
        v.episodes += 1
        v.until = now + self._ban_s(v.episodes)
        return v.until

    def banned_until(self, peer_id: str, now: float) -> float | None:
        """When ``peer_id``'s violation ban ends; None when none is in force."""
        v = self._records.get(peer_id)
        return v.until if v is not None and v.until > now else None

    def get(self, peer_id: str) -> Violations | None:
        return self._records.get(peer_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)
