"""Membership: who is in the swarm, which stage each peer serves and how loaded it is.

Pure core, no I/O: bytes, ``now`` and ``rng`` in; decisions, snapshots and bytes out. The
daemon's adapter moves the bytes (a pull stream ``/swarmd/1/view``, optionally gossipsub) and
calls these at the times the :class:`Schedule` gives.

Design (measured by ``tools/sim_membership.py``):

- **Every peer keeps a full view of individually signed entries**, one per peer, refreshed by
  **pull anti-entropy**: every P seconds a peer asks one random peer of its view for what it
  lacks among the entries signed in the last W seconds (its digest is 4 bytes per entry it
  holds from that window). A version thus reaches each peer about once: ~1x its size, where
  gossipsub costs ~D = 6x (mesh duplicates) plus IHAVE ids and silently drops under load. A
  neighbour relays others' signed bytes verbatim: it can withhold, never forge. A newcomer
  pulls the full view from one neighbour in pages of <= 64 KiB (2.7 MB, 43 pages at 10,000
  peers with tombstones: a one-off, outside the steady budget).
- **The announcement period adapts to the swarm size** so that the modelled inbound traffic
  (entries, digests, framing, and the extra announcements churn causes) stays within 80% of a
  2,000 B/s budget: 2 s up to 8 peers, 2.6 s at 10 (a small local swarm agrees within seconds
  and forgets a killed peer within ~8 s), 170 s at 1,000, 1,760 s at 10,000 (2,330 s with 20%
  of the swarm replaced per hour). Each announcement declares its period; receivers expire it
  3 of them after its signed timestamp (clamped to [2 s, 1 h]), so a SIGKILLed peer leaves
  every view within 3 of its periods. ~205 B per signed entry (compact positional msgpack, a
  64-byte signature) once per period is the floor that individually signed entries allow:
  the budget, not the protocol, sets the period.
- **Stage totals stay accurate although the period is long**, because what makes them wrong
  is handled apart from the refresh: ``leaving`` is announced and removes the peer at once
  (a tombstone that spreads like any entry), state changes are announced at once, a joiner's
  first announcement spreads in ~P ln n (under two minutes at 10,000 peers), and an entry
  that missed its refresh (older than a period + min(period, 120 s)) is "overdue": kept but
  out of routing and totals, so a killed peer inflates its stage's total for about half a
  period + 2 minutes instead of 2.5 periods. Drift of single peers averages out in a sum.
- **Gossip is an accelerator, never needed**: a peer may also gossip an event when a token
  bucket sized from the same budget allows (one per ~150 s at 10 peers, never at 10,000);
  the view accepts announcements from either channel alike.
- Everything dropped (forged, unsigned, stale, future, too old, oversized, malformed, too
  frequent...) is counted by reason; peers with another model hash or an unknown stage stay
  visible with the reason they are not routed to.
- Ages are measured from the signer's timestamp, so peers' clocks must agree to well within a
  period (NTP; a 2 s period in small swarms needs ~1 s): a signer whose clock is ahead by more
  than 30 s is dropped ("future"), one that is behind looks older (overdue, then expired).
"""

from swarmd.membership.announcement import (
    DOMAIN, DROP_REASONS, Announcement, Limits, PeerState, PullPage, PullRequest, decode_page,
    decode_request, decode_signed, encode_page, encode_request, encode_signed, fingerprint,
)
from swarmd.membership.schedule import (
    Plan, PullOrder, Schedule, ScheduleConfig, SwarmEstimate, plan,
)
from swarmd.membership.view import Applied, PeerInfo, Snapshot, StageInfo, View, ViewConfig

__all__ = [
    "DOMAIN", "DROP_REASONS", "Announcement", "Limits", "PeerState", "PullPage", "PullRequest",
    "decode_page", "decode_request", "decode_signed", "encode_page", "encode_request",
    "encode_signed", "fingerprint", "Plan", "PullOrder", "Schedule", "ScheduleConfig",
    "SwarmEstimate", "plan",
    "Applied", "PeerInfo", "Snapshot", "StageInfo", "View", "ViewConfig",
]
