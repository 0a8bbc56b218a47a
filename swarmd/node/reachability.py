"""Can peers dial us? Reachability from dial-backs (issue 12, "Reachability"). Pure.

A daemon asks a few peers to dial it back (``swarmd.node.dialback``): each tries a plain TCP
connection to the addresses of our signed announcement and answers which worked. This module
holds the messages and the verdict:

* ``public``: at least ``min_agree`` distinct peers reached at least one of our addresses
  within ``window_s`` (and more of the recent answers say reached than not);
* ``private``: at least ``min_agree`` distinct peers could reach none, and none reached any;
* ``unknown``: not enough answers yet, or they disagree.

The verdict is re-derived from scratch when our announced addresses change (:meth:`reset`).
A peer's answer counts once (its latest), so one peer cannot decide the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.errors import BadPeerMessage

__all__ = ["Reachability", "DialbackReply", "DialResult", "PUBLIC", "PRIVATE", "UNKNOWN",
           "MAX_RESULTS"]

PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"
#: addresses one dial-back tries at most (an announcement carries at most 8)
MAX_RESULTS = 8
_MAX_TEXT = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class DialResult:
    addr: str
    ok: bool
    #: why it failed (refused, timed out, ...); empty when ok
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class DialbackReply:
    results: tuple[DialResult, ...]

    def to_meta(self) -> dict[str, object]:
        return {"results": [{"addr": r.addr, "ok": r.ok, "reason": r.reason}
                            for r in self.results]}

    @classmethod
    def from_meta(cls, meta: object) -> DialbackReply:
        """Validated from the wire; unknown keys dropped; ``BadPeerMessage`` when unusable."""
        raw = meta.get("results") if isinstance(meta, dict) else None
        if not isinstance(raw, list) or len(raw) > MAX_RESULTS:
            raise BadPeerMessage("malformed", f"a dial-back reply lists at most {MAX_RESULTS} "
                                              f"results")
        out = []
        for item in raw:
            if not isinstance(item, dict):
                raise BadPeerMessage("malformed", "a dial-back result is a map")
            addr, ok, reason = item.get("addr"), item.get("ok"), item.get("reason", "")
            if not (isinstance(addr, str) and 0 < len(addr) <= _MAX_TEXT
                    and isinstance(ok, bool) and isinstance(reason, str)):
                raise BadPeerMessage("malformed", "a dial-back result needs addr (text), ok "
                                                  "(bool) and reason (text)")
            out.append(DialResult(addr=addr, ok=ok, reason=reason[:_MAX_TEXT]))
        return cls(results=tuple(out))


@dataclass(slots=True)
class Reachability:
    min_agree: int = 2
    window_s: float = 1800.0
    #: peer -> (reached any address, when)
    _answers: dict[str, tuple[bool, float]] = field(default_factory=dict)
    #: most peers remembered
    max_peers: int = 64

    def answered(self, peer: str, reply: DialbackReply, now: float) -> None:
        """``peer`` tried our addresses: at least one ``ok`` means it reached us."""
        self._answers.pop(peer, None)
        self._answers[peer] = (any(r.ok for r in reply.results), now)
        while len(self._answers) > self.max_peers:
            del self._answers[next(iter(self._answers))]

    def reset(self) -> None:
        """Our addresses changed: what peers found about the old ones no longer holds."""
        self._answers.clear()

    def verdict(self, now: float) -> str:
        recent = [ok for ok, t in self._answers.values() if now - t <= self.window_s]
        reached, not_reached = recent.count(True), recent.count(False)
        if reached >= self.min_agree and reached > not_reached:
            return PUBLIC
        if not_reached >= self.min_agree and reached == 0:
            return PRIVATE
        return UNKNOWN

    def asked(self, now: float) -> int:
        """How many peers answered within the window."""
        return sum(1 for _, t in self._answers.values() if now - t <= self.window_s)
