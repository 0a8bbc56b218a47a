"""The membership view: who serves which stage and how loaded, built from signed announcements.

Pure: bytes and ``now`` in, outcomes, snapshots and bytes out. The daemon feeds it every
announcement it receives (its own included), whatever the channel (gossip or a pulled page),
and calls ``expire(now)`` now and then; the same code runs inside the simulator.

Rules, per peer id (one entry each):

- the entry is the announcement with the highest signed timestamp seen; an older one is dropped
  as "stale", a second one with the same timestamp and other bytes as "conflict" (the smaller
  wire form wins, so every view settles on the same bytes whatever the arrival order);
- a newer one less than ``min_gap_s`` after the held one is dropped as "too_frequent" (a
  chattering peer cannot make the swarm relay all its versions), except ``leaving``;
- an entry expires ``expiry_periods`` x its declared period (clamped to
  [``min_period_s``, ``max_period_s``]) after its signed timestamp: a peer killed with SIGKILL
  leaves every view within 3 of its periods, counted from its last announcement;
- ``leaving`` removes the peer from the view at once; the signed ``leaving`` stays as a
  tombstone until it would have expired, so that older copies still travelling are "stale",
  and it is served to pullers so the leave spreads like any announcement;
- a peer with another model hash, no stage, a stage >= ``stages``, a state other than online,
  or an "overdue" entry (older than one period + min(period, ``overdue_grace_s``): it missed
  its refresh, probably dead, not yet expired) stays in the view but is out of routing and out
  of the stage totals, with the reason in the snapshot;
- ``lateness_s`` (0 unless set; the service sets it from how long its pulls take) is added to
  both deadlines of an entry accepted from then on: on a congested link announcements reach
  us seconds after they were signed, and a peer that refreshes on time must not look overdue
  for it.

Pull (anti-entropy with a neighbour): ``pull_request(now, cutoff)`` is the puller's digest (the
fingerprints of the entries it holds signed at or after ``cutoff``); ``serve(request)`` is the
neighbour's answer: the entries it holds signed at or after ``cutoff`` that the puller lacks,
in peer-id order, paged by bytes. ``cutoff=None`` asks for the full view (a newcomer).
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from swarmd.errors import BadAnnouncement, BadPullMessage
from swarmd.membership.announcement import (
    Announcement, Limits, PeerState, PullPage, PullRequest, Verify, decode_page, decode_request,
    decode_signed, encode_page, fingerprint, page_size,
)
from swarmd.membership.schedule import SwarmEstimate

__all__ = ["ViewConfig", "View", "Applied", "PeerInfo", "StageInfo", "Snapshot"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewConfig:
    #: number of pipeline stages of the model; announced stages >= this are out of routing
    stages: int
    #: our model hash; peers announcing another are out of routing
    model_hash: str
    #: our swarm manifest's hash; peers announcing another are out of routing ("": none
    #: compared, nor is a peer's "")
    manifest: str = ""
    limits: Limits = field(default_factory=Limits)
    expiry_periods: float = 3.0
    min_period_s: float = 2.0
    max_period_s: float = 3600.0
    min_gap_s: float = 0.5
    #: an entry is overdue (out of routing) one period + min(period, this) after it was
    #: signed: its next version, promised within a period, should long have arrived
    overdue_grace_s: float = 120.0
    #: most entries (tombstones included); more are dropped as "view_full"
    max_peers: int = 100_000
    #: accepted versions remembered for building digests without scanning the whole view
    recent_horizon_s: float = 600.0
    #: events (joins, state or stage changes, leaves) are counted over this many seconds
    event_horizon_s: float = 900.0

    def __post_init__(self) -> None:
        if type(self.stages) is not int or self.stages < 1:
            raise ValueError("stages must be an int >= 1")
        if not 0 < self.min_period_s <= self.max_period_s:
            raise ValueError("need 0 < min_period_s <= max_period_s")
        if self.expiry_periods < 1:
            raise ValueError("expiry_periods must be >= 1")


@dataclass(frozen=True, slots=True)
class Applied:
    """What one announcement did. ``outcome``: added, updated, removed (it left), tombstone
    (a leave of a peer we did not list), duplicate, or dropped (``reason`` says why)."""

    outcome: str
    peer_id: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    peer_id: str
    addrs: tuple[str, ...]
    stage: int | None
    state: str
    throughput: float
    queue: int
    version: str
    model_hash: str
    age_s: float
    period_s: float
    routable: bool
    why_not: str | None
    step: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo:
    stage: int
    total_throughput: float
    routable_peers: int
    queue: int
    peers: tuple[PeerInfo, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The view at one instant, as ``/api/v0/swarm`` shows it."""

    now: float
    peers: int
    stages: tuple[StageInfo, ...]
    #: peers with no stage or an unknown one
    other_peers: tuple[PeerInfo, ...]
    #: lowest total throughput among stages 0..S-1 (a stage nobody serves: total 0)
    bottleneck_stage: int
    bottleneck_throughput: float
    counts: dict[str, int]
    dropped: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        def peer(p: PeerInfo) -> dict[str, Any]:
            return {f: getattr(p, f) for f in PeerInfo.__slots__}  # type: ignore[attr-defined]
        return {
            "now": self.now, "peers": self.peers,
            "stages": [{"stage": s.stage, "total_throughput": s.total_throughput,
                        "routable_peers": s.routable_peers, "queue": s.queue,
                        "peers": [peer(p) for p in s.peers]} for s in self.stages],
            "other_peers": [peer(p) for p in self.other_peers],
            "bottleneck": {"stage": self.bottleneck_stage,
                           "throughput": self.bottleneck_throughput},
            "counts": dict(self.counts), "dropped": dict(self.dropped),
        }


class _Entry:
    __slots__ = ("ann", "wire", "fp", "expires_at", "overdue_at")

    def __init__(self, ann: Announcement, wire: bytes, config: ViewConfig,
                 lateness_s: float = 0.0) -> None:
        period = min(max(ann.period, config.min_period_s), config.max_period_s)
        self.ann = ann
        self.wire = wire
        self.fp = fingerprint(wire)
        self.expires_at = ann.timestamp + config.expiry_periods * period + lateness_s
        self.overdue_at = min(ann.timestamp + period + min(period, config.overdue_grace_s)
                              + lateness_s, self.expires_at)


class View:
    """Every peer's latest signed announcement, with expiry, routing eligibility and paging."""

    def __init__(self, config: ViewConfig, verify: Verify) -> None:
        self.config = config
        self._verify = verify
        self._entries: dict[str, _Entry] = {}
        self._live = 0          # entries that are not tombstones
        self._wire_total = 0    # bytes of all entries' wire forms
        self._expiry: list[tuple[float, str]] = []            # heap, lazily cleaned
        self._recent: deque[tuple[float, float, str, int]] = deque()  # (accepted, ts, id, fp)
        self._events: deque[float] = deque()  # when we accepted each recent event
        self.counts: dict[str, int] = {k: 0 for k in ("added", "updated", "removed",
                                                       "duplicate", "expired")}
        self.dropped: dict[str, int] = {}
        #: seconds added to the deadlines of entries accepted from now on (the module doc)
        self.lateness_s = 0.0

    # ------------------------------------------------------------------------------- input

    def apply(self, data: bytes, now: float) -> Applied:
        """Take one signed announcement (gossip, a pulled page, or our own)."""
        try:
            ann = decode_signed(data, self._verify, self.config.limits, now)
        except BadAnnouncement as exc:
            return self._drop(exc.reason)
        return self._accept(ann, bytes(data), now)

    def _drop(self, reason: str, peer_id: str | None = None) -> Applied:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return Applied("dropped", peer_id, reason)

    def _accept(self, ann: Announcement, wire: bytes, now: float) -> Applied:
        pid = ann.peer_id
        entry = _Entry(ann, wire, self.config, self.lateness_s)
        if entry.expires_at <= now:
            return self._drop("expired", pid)
        held = self._entries.get(pid)
        if held is not None:
            ts, held_ts = ann.timestamp, held.ann.timestamp
            if ts < held_ts:
                return self._drop("stale", pid)
            if ts == held_ts:
                if wire == held.wire:
                    self.counts["duplicate"] += 1
                    return Applied("duplicate", pid)
                if wire > held.wire:
                    return self._drop("conflict", pid)
                self.dropped["conflict"] = self.dropped.get("conflict", 0) + 1
            elif ts - held_ts < self.config.min_gap_s and ann.state is not PeerState.LEAVING:
                return self._drop("too_frequent", pid)
            self._forget(held)
        elif len(self._entries) >= self.config.max_peers:
            return self._drop("view_full", pid)
        self._entries[pid] = entry
        self._wire_total += len(wire)
        heapq.heappush(self._expiry, (entry.expires_at, pid))
        self._recent.append((now, ann.timestamp, pid, entry.fp))
        self._prune_recent(now)
        was_live = held is not None and held.ann.state is not PeerState.LEAVING
        if (ann.state is not held.ann.state or ann.stage != held.ann.stage if was_live
                else ann.state is PeerState.JOINING):
            self._events.append(now)
        if ann.state is PeerState.LEAVING:
            outcome = "removed" if was_live else "tombstone"
        else:
            self._live += 1
            outcome = "updated" if was_live else "added"
        if outcome != "tombstone":
            self.counts[outcome] += 1
        return Applied(outcome, pid)

    def _forget(self, entry: _Entry) -> None:
        self._wire_total -= len(entry.wire)
        if entry.ann.state is not PeerState.LEAVING:
            self._live -= 1

    def _prune_recent(self, now: float) -> None:
        horizon = now - self.config.recent_horizon_s
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        horizon = now - self.config.event_horizon_s
        while self._events and self._events[0] < horizon:
            self._events.popleft()

    def heard_from(self, peer_id: str, at: float) -> bool:
        """We heard from ``peer_id`` directly at ``at`` (it answered a request of ours): its
        entry stays routable for one more of its periods from then, and lives one more after
        that, however late its own refreshes reach us. A peer that changes its state or
        stage says so in an announcement, which replaces the entry; a tombstone is left
        alone. True when the entry was extended."""
        entry = self._entries.get(peer_id)
        if entry is None or entry.ann.state is PeerState.LEAVING:
            return False
        period = min(max(entry.ann.period, self.config.min_period_s), self.config.max_period_s)
        if entry.overdue_at >= at + period:
            return False
        entry.overdue_at = at + period
        if entry.expires_at < at + 2 * period:
            entry.expires_at = at + 2 * period
            heapq.heappush(self._expiry, (entry.expires_at, peer_id))
        return True

    def expire(self, now: float) -> list[Announcement]:
        """Remove entries (and tombstones) past their expiry; returns the peers removed (their
        last announcement: the daemon may close connections to their addresses)."""
        gone = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, pid = heapq.heappop(heap)
            entry = self._entries.get(pid)
            if entry is not None and entry.expires_at <= now:
                del self._entries[pid]
                self._forget(entry)
                if entry.ann.state is not PeerState.LEAVING:
                    gone.append(entry.ann)
                    self.counts["expired"] += 1
        self._prune_recent(now)
        return gone

    # ------------------------------------------------------------------------------ queries

    def __len__(self) -> int:
        """Live peers (tombstones excluded; entries past expiry count until ``expire``)."""
        return self._live

    @property
    def mean_wire_bytes(self) -> float:
        return self._wire_total / len(self._entries) if self._entries else 0.0

    def estimate(self, now: float) -> SwarmEstimate:
        """The swarm as this view sees it, for the :class:`Schedule`: live peers, mean
        announcement size, and the rate of event announcements (a newcomer's first, a state or
        stage change, a leave) over the last ``event_horizon_s``."""
        self._prune_recent(now)
        return SwarmEstimate(peers=self._live, wire_bytes=self.mean_wire_bytes,
                             events_per_s=len(self._events) / self.config.event_horizon_s)

    def get(self, peer_id: str) -> Announcement | None:
        entry = self._entries.get(peer_id)
        if entry is None or entry.ann.state is PeerState.LEAVING:
            return None
        return entry.ann

    def announcements(self, now: float) -> list[Announcement]:
        """Live, unexpired entries, in no particular order."""
        return [e.ann for e in self._entries.values()
                if e.expires_at > now and e.ann.state is not PeerState.LEAVING]

    def peer_ids(self, now: float) -> list[str]:
        return [a.peer_id for a in self.announcements(now)]

    def why_not(self, peer_id: str, now: float) -> str | None:
        """Why a peer is out of routing ("not_listed" if we do not list it), None if it is
        routable."""
        entry = self._entries.get(peer_id)
        if entry is None or entry.expires_at <= now or entry.ann.state is PeerState.LEAVING:
            return "not_listed"
        return self._why_not(entry.ann, entry.overdue_at, now)

    def _other_manifest(self, ann: Announcement) -> bool:
        ours = self.config.manifest
        return bool(ours and ann.manifest and ann.manifest != ours)

    def _why_not(self, ann: Announcement, overdue_at: float, now: float) -> str | None:
        if ann.model_hash != self.config.model_hash:
            return "model_hash_mismatch"
        if self._other_manifest(ann):
            return "manifest_mismatch"
        if ann.stage is None:
            return "no_stage"
        if ann.stage >= self.config.stages:
            return "unknown_stage"
        if ann.state is not PeerState.ONLINE:
            return ann.state.value
        if overdue_at <= now:
            return "overdue"
        return None

    def stage_has_state(self, stage: int, now: float, *, besides: str) -> bool:
        """Whether a peer other than ``besides`` (ourselves) holds ``stage``'s state as far as
        the view shows: one of our model announcing the stage online (overdue too), or at a
        step > 0 in any state (syncing after a load, migrating there). A joiner of the stage
        should wait for it to become a state source, not start from the initial weights; a
        mate still syncing at step 0 holds nothing (two fresh joiners must not wait for each
        other)."""
        return any(a.stage == stage and a.peer_id != besides
                   and a.model_hash == self.config.model_hash and not self._other_manifest(a)
                   and (a.state is PeerState.ONLINE or a.step > 0)
                   for a in self.announcements(now))

    def _live_entries(self, now: float) -> Iterator[_Entry]:
        for e in self._entries.values():
            if e.expires_at > now and e.ann.state is not PeerState.LEAVING:
                yield e

    def stage_totals(self, now: float) -> list[float]:
        """Total throughput of the routable peers of each stage 0..S-1 (cheap: no objects)."""
        stages, model_hash, online = self.config.stages, self.config.model_hash, PeerState.ONLINE
        totals = [0.0] * stages
        for e in self._entries.values():
            a = e.ann  # overdue_at < expires_at, and tombstones are not online
            if (e.overdue_at > now and a.state is online and a.model_hash == model_hash
                    and a.stage is not None and a.stage < stages
                    and not self._other_manifest(a)):
                totals[a.stage] += a.throughput
        return totals

    def snapshot(self, now: float) -> Snapshot:
        by_stage: list[list[PeerInfo]] = [[] for _ in range(self.config.stages)]
        other: list[PeerInfo] = []
        for e in sorted(self._live_entries(now), key=lambda e: e.ann.peer_id):
            a = e.ann
            why = self._why_not(a, e.overdue_at, now)
            info = PeerInfo(peer_id=a.peer_id, addrs=a.addrs, stage=a.stage, state=a.state.value,
                            throughput=a.throughput, queue=a.queue, version=a.version,
                            model_hash=a.model_hash, age_s=now - a.timestamp, period_s=a.period,
                            routable=why is None, why_not=why, step=a.step)
            if a.stage is not None and a.stage < self.config.stages:
                by_stage[a.stage].append(info)
            else:
                other.append(info)
        stages = tuple(
            StageInfo(stage=s, peers=tuple(ps),
                      total_throughput=sum(p.throughput for p in ps if p.routable),
                      routable_peers=sum(p.routable for p in ps),
                      queue=sum(p.queue for p in ps if p.routable))
            for s, ps in enumerate(by_stage))
        bottleneck = min(stages, key=lambda s: (s.total_throughput, s.routable_peers, s.stage))
        return Snapshot(now=now, peers=len(other) + sum(len(s.peers) for s in stages),
                        stages=stages, other_peers=tuple(other),
                        bottleneck_stage=bottleneck.stage,
                        bottleneck_throughput=bottleneck.total_throughput,
                        counts=dict(self.counts), dropped=dict(self.dropped))

    # --------------------------------------------------------------------------------- pull

    def _since(self, cutoff: float, now: float) -> list[_Entry]:
        """Unexpired entries (tombstones too) signed at or after ``cutoff``."""
        entries = self._entries
        stop = cutoff - self.config.limits.max_future_s  # accepted no earlier than this
        if stop < now - self.config.recent_horizon_s:
            return [e for e in entries.values() if e.ann.timestamp >= cutoff and e.expires_at > now]
        found = []
        for accepted, ts, pid, fp in reversed(self._recent):
            if accepted < stop:
                break
            if ts >= cutoff:
                entry = entries.get(pid)
                if entry is not None and entry.fp == fp and entry.expires_at > now:
                    found.append(entry)
        return found

    def pull_request(self, now: float, cutoff: float | None) -> PullRequest:
        """Our side of a pull: the full view when ``cutoff`` is None, else a delta whose digest
        holds what we have signed since ``cutoff`` (the newest ``max_digest``: the cutoff
        moves later when there are more)."""
        limits = self.config.limits
        if cutoff is None:
            return PullRequest(cutoff=None, max_bytes=limits.max_page_bytes)
        held = sorted(((e.ann.timestamp, e.fp) for e in self._since(cutoff, now)), reverse=True)
        if len(held) > limits.max_digest:
            held = held[:limits.max_digest]
            cutoff = held[-1][0]
        return PullRequest(cutoff=cutoff, have=frozenset(fp for _, fp in held),
                           max_bytes=limits.max_page_bytes)

    def serve(self, request: PullRequest, now: float) -> PullPage:
        """A neighbour's side: the next page of what the puller lacks."""
        if request.cutoff is None:
            pool: list[_Entry] = [e for e in self._entries.values() if e.expires_at > now]
        else:
            pool = [e for e in self._since(request.cutoff, now) if e.fp not in request.have]
        pool.sort(key=lambda e: e.ann.peer_id)
        start = 0
        if request.cursor is not None:
            start = bisect.bisect_right([e.ann.peer_id for e in pool], request.cursor)
        budget = min(request.max_bytes, self.config.limits.max_page_bytes) - page_size(())
        out: list[bytes] = []
        for e in pool[start:]:
            cost = len(e.wire) + 3
            if cost > budget and out:
                return PullPage(entries=tuple(out), next_cursor=last)
            out.append(e.wire)
            last = e.ann.peer_id
            budget -= cost
        return PullPage(entries=tuple(out), next_cursor=None)

    def handle_pull(self, data: bytes, now: float) -> bytes:
        """Server side on bytes: decode a request (``BadPullMessage`` if unusable), answer it."""
        return encode_page(self.serve(decode_request(data, self.config.limits), now))

    def apply_page(self, data: bytes, now: float) -> tuple[list[Applied], str | None]:
        """Puller side on bytes: apply every entry of a page; the cursor of the next page."""
        page = decode_page(data, self.config.limits)
        if len(page.entries) > self.config.limits.max_page_bytes // 64:
            raise BadPullMessage("oversized", f"{len(page.entries)} entries in one page")
        return [self.apply(wire, now) for wire in page.entries], page.next_cursor

