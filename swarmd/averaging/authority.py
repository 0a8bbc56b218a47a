"""Who takes part in a stage's rounds, and whose weights win when two mates differ. Pure: no I/O.

Two decisions that keep a stage's peers on one set of weights (issue 14, "weights drifting
within a stage"):

- **Mates with a grace** (:class:`RecentMates`). A round message is taken only from a peer of
  the stage. "Of the stage" is what this peer's membership view lists as a live mate; but a view
  that lags (announcements overdue on a loaded machine) would refuse the stage's own leader as
  ``not_a_mate`` and step alone with its own gradients. So a peer listed as a live mate stays
  one for rounds ``grace_s`` after it was last listed (several of the view's expiries). An
  outsider, never listed as a peer of the stage, is refused as before. Such a mate that was
  *heard from* (a round message of it taken) within ``heard_s`` is alive, whatever the view
  says: it counts among the mates a round is led or reported to (``alive``), so a lagging
  view neither leads alone nor steps alone beside its stage.
- **Same step, other weights** (:func:`same_step_verdict`). The round's leader sends the digest
  of its weights before the step (``Start.digest``); a member at the same step whose digest
  differs has drifted (it stepped alone at some point). The lowest peer id wins, so two peers
  never both adopt the other's state: the other one adopts (downloads the winner's state even
  at an equal step). Unknown digests (old peers) change nothing.
- **Same step, other weights, no rounds** (:class:`IdleDrift`, :func:`idle_adopt_from`). While
  the stage takes no step (training paused), no ``start`` carries a digest; so a peer whose
  step has not moved for ``idle_s`` asks its mates for theirs (``state_digest``), at most once
  every ``every_s``. Of itself and the mates at its step, the lowest id is the stage's
  reference: a peer adopts that one's state when its digest differs. The reference never
  adopts (no mate at its step has a lower id), so two peers never both adopt each other.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ADOPT", "HEARD_S", "IDLE_CHECK_S", "IDLE_S", "IdleDrift", "KEEP", "MATE_GRACE_S",
           "MAX_REMEMBERED", "RecentMates", "idle_adopt_from", "same_step_verdict"]

#: how long a peer last listed as a live mate is still taken as one for rounds (seconds):
#: a view entry expires 3 announcement periods after it was signed (a period is 2-30 s on a
#: small swarm), so this covers two to three expiries of a lagging view
MATE_GRACE_S = 60.0
#: a mate heard from this recently (seconds) is alive, listed or not
HEARD_S = 10.0
#: the most peers remembered past their listing (bounded memory whatever the view holds)
MAX_REMEMBERED = 1024

#: a stage whose step has not moved this long (seconds) is idle: its mates' digests are asked
IDLE_S = 10.0
#: while idle, the digests are asked at most this often (seconds)
IDLE_CHECK_S = 15.0

KEEP = "keep"
ADOPT = "adopt"

Addrs = tuple[str, ...]


class RecentMates:
    """The peers a stage's rounds accept: the live mates now, and those listed as live mates
    within the last ``grace_s`` (with the addresses they were listed at)."""

    def __init__(self, grace_s: float = MATE_GRACE_S, max_peers: int = MAX_REMEMBERED,
                 heard_s: float = HEARD_S) -> None:
        if grace_s < 0 or max_peers < 1 or heard_s < 0:
            raise ValueError("need grace_s >= 0, heard_s >= 0 and max_peers >= 1")
        self.grace_s = grace_s
        self.heard_s = heard_s
        self.max_peers = max_peers
        #: peer -> (when it was last listed as a live mate, its addresses then)
        self._seen: dict[str, tuple[float, Addrs]] = {}
        #: known peer -> when a round message of it was last taken
        self._heard: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, live: Mapping[str, Addrs], now: float) -> None:
        """``live`` are the stage's live mates by the view at ``now``."""
        for peer, addrs in live.items():
            self._seen.pop(peer, None)  # re-inserted last: the dict stays oldest first
            self._seen[peer] = (now, tuple(addrs))
        self._prune(now)

    def known(self, live: Mapping[str, Addrs], now: float) -> dict[str, Addrs]:
        """The peers taken as mates at ``now``: ``live`` (observed first) and the recent ones."""
        self.observe(live, now)
        return {peer: addrs for peer, (_, addrs) in self._seen.items()}

    def heard(self, peer: str, now: float) -> None:
        """A round message of ``peer`` (a known mate: others are not remembered) was taken."""
        if peer in self._seen:
            self._heard[peer] = now

    def alive(self, live: Mapping[str, Addrs], now: float) -> dict[str, Addrs]:
        """``live`` and the known mates heard from within ``heard_s``: those a round is led
        with or reported to."""
        known = self.known(live, now)
        return {**{p: known[p] for p, t in self._heard.items()
                   if p in known and now - t <= self.heard_s}, **live}

    def remembered(self) -> list[str]:
        """The peers held as mates now, listed live or within the grace."""
        return list(self._seen)

    def forget(self, peer: str) -> None:
        """``peer`` is no mate any more (it left the stage for good)."""
        self._seen.pop(peer, None)
        self._heard.pop(peer, None)

    def _prune(self, now: float) -> None:
        horizon = now - self.grace_s
        stale = [p for p, (seen, _) in self._seen.items() if seen < horizon]
        for peer in stale:
            del self._seen[peer]
        while len(self._seen) > self.max_peers:  # the oldest first
            del self._seen[next(iter(self._seen))]
        self._heard = {p: t for p, t in self._heard.items()
                       if p in self._seen and now - t <= self.heard_s}


def same_step_verdict(*, me: str, our_step: int, our_digest: str | None, them: str,
                      their_step: int, their_digest: str | None) -> str:
    """Whether this peer (``me``) must take ``them``'s state: ``ADOPT`` when both are at the
    same step with known, different digests and ``them`` has the lower id; else ``KEEP`` (equal
    weights, a digest unknown, other steps: the step rules handle those, or ``them`` adopts
    ours)."""
    if our_digest is None or their_digest is None or our_step != their_step:
        return KEEP
    if our_digest == their_digest or them == me:
        return KEEP
    return ADOPT if them < me else KEEP


def idle_adopt_from(*, me: str, our_step: int, our_digest: str | None,
                    mates: Mapping[str, tuple[int, str | None]]) -> str | None:
    """The mate whose state this peer (``me``, at ``our_step`` with ``our_digest``) must take
    while no round runs, or None. ``mates`` maps a mate to its (step, digest), None where it
    gave none. Only mates at our step with a known digest count; the lowest id among them and
    us is the reference (``same_step_verdict`` against it): we adopt when it is not us and
    its digest differs from ours."""
    if our_digest is None:
        return None
    same = [p for p, (step, dig) in mates.items()
            if p != me and step == our_step and dig is not None]
    if not same:
        return None
    ref = min(same)
    their = mates[ref][1]
    verdict = same_step_verdict(me=me, our_step=our_step, our_digest=our_digest, them=ref,
                                their_step=our_step, their_digest=their)
    return ref if verdict == ADOPT else None


class IdleDrift:
    """When a peer whose step stands still asks its mates' digests: after the step has not
    moved for ``idle_s``, then at most once every ``every_s`` while it still stands."""

    def __init__(self, idle_s: float = IDLE_S, every_s: float = IDLE_CHECK_S) -> None:
        if idle_s < 0 or every_s <= 0:
            raise ValueError("need idle_s >= 0 and every_s > 0")
        self.idle_s = idle_s
        self.every_s = every_s
        self._step: int | None = None
        self._since = 0.0
        self._asked: float | None = None

    def due(self, step: int, now: float) -> bool:
        """Whether to ask now (the caller then asks); ``step`` is ours at ``now``."""
        if step != self._step:
            self._step, self._since, self._asked = step, now, None
            return False
        if now - self._since < self.idle_s:
            return False
        if self._asked is not None and now - self._asked < self.every_s:
            return False
        self._asked = now
        return True
