"""Membership in the daemon: the adapter that moves the pure core's bytes over libp2p.

What to send and when is decided by ``swarmd.membership`` (``View``, ``Schedule``); this module
only carries bytes and keeps the clock:

- ``/swarmd/<swarm>/1/view``: pull anti-entropy. The request and each reply page are the core's
  bytes in a message's meta. A newly connected peer is pulled from at once (full view), so a
  newcomer has the whole view within a round trip of its bootstrap dial.
- ``/swarmd/<swarm>/1/announce``: a direct push of one signed announcement to the connected
  peers, for events that must spread fast (``leaving``, state or stage changes).
- gossipsub topic ``swarmd/<swarm>/announce/1``: an accelerator the schedule allows rarely.

The swarm name is in every protocol id and topic, so two swarms never exchange membership.
Times are wall-clock seconds (announcements carry the signer's timestamp).
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections import Counter, deque
from typing import Any, Callable, NamedTuple, Sequence

from swarmd.version import __version__
from swarmd.api.types import PeerRow, StageRow, SwarmInfo
from swarmd.errors import BadPeerMessage
from swarmd.membership import (Announcement, PeerState, Schedule, View, ViewConfig,
                               encode_request, encode_signed)
from transport.errors import DeadlineExceeded, TransportError
from transport.frames import Message
from transport.signing import signer, verify
from swarmd.addresses import MAX_ANNOUNCED, AddressPolicy, announced_addrs
from swarmd.links import LinkEstimates, links_for
from swarmd.protocols import Protocols
from swarmd.models.registry import model_hash_of

log = logging.getLogger("swarmd.membership")

#: longest sleep of the loop, so new connections and stop requests are noticed quickly
TICK_S = 0.5
PULL_TIMEOUT_S = 10.0
#: scheduled pulls running at once: one stuck on a dead peer does not stop the others
PULLS_IN_FLIGHT = 3
#: a scheduled pull may take this many of the peer's measured round trips (at least half a
#: period): on a saturated uplink a page waits behind tensors (issue 26: 1-1.5 s round trips
#: at 6 Mbit/s), and a pull cut at half a 2 s period failed every time until entries expired
PULL_RTT_SLACK = 4.0
#: the view's lateness allowance (``View.lateness_s``) is this many times the median of the
#: last ``LATENESS_PULLS`` successful pulls, at most ``LATENESS_CAP_S``: replies that come
#: late prove announcements reach us late (our own link is congested); an unanswered pull
#: proves nothing (a dead peer), and the median keeps one peer answering slowly (a hostile
#: one: the protocol fuzzer's made the allowance keep dead entries routable) from setting it
LATENESS_FACTOR = 2.0
LATENESS_PULLS = 16
LATENESS_CAP_S = 30.0
#: pulls and pushes running at once, beyond the scheduled pull
MAX_BACKGROUND = 8
MAX_PAGES = 256
#: a peer whose pull failed is not picked again for this long (while others can be)
PULL_FAILED_SKIP_S = 10.0
#: a joiner deciding where its stage's state comes from reads the view as of this long ago:
#: entries expire only when the loop ticks (every TICK_S), so this changes nothing while the
#: loop runs, but after the loop was held (a stage built on a loaded machine: 10 s measured)
#: every entry, its mates' included, has timed out and the joiner would take initial weights
#: while its mates are alive; a peer really gone costs a failed dial (``state_sources``)
STATE_SOURCE_GRACE_S = 30.0


class LocalState(NamedTuple):
    """What this peer announces about itself."""

    stage: int | None
    #: a PeerState value: "joining", "syncing", "online", "migrating", "leaving"
    state: str
    throughput: float = 0.0
    queue: int = 0
    step: int = 0


class MembershipService:
    """``async with MembershipService(host, identity, config, local, manifest=...,
    interfaces=...) as m:``

    ``local()`` returns this peer's current :class:`LocalState`; ``manifest`` is the hash of the
    swarm manifest this peer runs (``swarmd.manifest.local.swarm_manifest``), announced and
    required of peers; ``interfaces()`` lists this machine's interface addresses
    (``swarmd.node.interfaces.interface_ips``), read when the host is bound to ``0.0.0.0``.
    """

    def __init__(self, host: Any, identity: Any, config: Any,
                 local: Callable[[], LocalState], *, manifest: str,
                 interfaces: Callable[[], Sequence[str]],
                 rng: random.Random | None = None, links: LinkEstimates | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        """``clock`` (monotonic) times the schedule: when to announce and pull; ``wall`` is
        only for what announcements carry and the view compares with them (signed
        timestamps, expiry, the delta window of a pull)."""
        self.host = host
        self._clock, self._wall = clock, wall
        self.config = config
        self._local = local
        self._sign = signer(identity)
        self._rng = rng or random.Random()
        swarm = config.swarm.name
        self.pull_protocol = Protocols(swarm).view
        self.push_protocol = Protocols(swarm).announce
        self.topic = Protocols(swarm).announce_topic
        self.view = View(ViewConfig(stages=config.swarm.stages, model_hash=self.model_hash(),
                                    manifest=manifest), verify)
        self.schedule = Schedule(now=clock(), rng=self._rng)
        self._counters: Counter[str] = Counter()
        self._pulled_from: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._subscription: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._last_announcement: bytes | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: scheduled pulls in flight, and the peer each asks
        self._pulls: dict[asyncio.Task[Any], str] = {}
        self._pull_seconds: deque[float] = deque(maxlen=LATENESS_PULLS)
        #: peer -> when a scheduled pull from it last failed
        self._pull_failed: dict[str, float] = {}
        #: set once a full view has been pulled from some peer
        self.has_view = asyncio.Event()
        #: set (then cleared by waiters) whenever this peer announces
        self._announce_made = asyncio.Event()
        network = config.network
        self._interfaces = interfaces
        self._address_policy = AddressPolicy(announce=tuple(network.announce),
                                             no_announce=tuple(network.no_announce))
        self._announced: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        #: more addresses to announce (relayed ones, from swarmd.node.nat)
        self.extra_addrs: Callable[[], Sequence[str]] = tuple
        #: what was measured of each link, shared with the rest of the daemon (the host's
        #: estimates, swarmd.links); pull deadlines follow it
        self.links = links if links is not None else links_for(host)

    def announced_addrs(self) -> tuple[str, ...]:
        """What this peer announces it is reached at (``swarmd.addresses``): the bound
        addresses with 0.0.0.0 expanded, loopback left out unless alone, ``network.announce``
        and ``network.no_announce`` applied. Interfaces are read once per host address set."""
        bound = tuple(self.host.addrs)
        if self._announced is None or self._announced[0] != bound:
            interfaces = list(self._interfaces()) if any("/0.0.0.0/" in a or "/::/" in a
                                                        for a in bound) else []
            self._announced = (bound, announced_addrs(bound, interfaces, self._address_policy,
                                                      self.host.peer_id))
        # relayed addresses (only while peers cannot dial us) go first: dialers try in order
        extra = tuple(a for a in self.extra_addrs() if a not in self._announced[1])
        return (extra + self._announced[1])[:MAX_ANNOUNCED]

    def latest_announcement(self) -> bytes | None:
        """This peer's newest signed announcement (None before the first)."""
        return self._last_announcement

    def model_hash(self) -> str:
        """The swarm's model name and the hash of its architecture: both must match."""
        return model_hash_of(self.config)

    # ---- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> MembershipService:
        self.host.set_request_handler(self.pull_protocol, self._serve_pull)
        self.host.set_request_handler(self.push_protocol, self._serve_push)
        try:
            self._subscription = await self.host.subscribe(self.topic)
            self._pump = asyncio.create_task(self._pump_gossip())
        except TransportError as exc:  # pubsub is an accelerator only
            log.warning("gossip unavailable, membership runs on pulls alone: %s", exc)
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in (self._task, self._pump, *self._tasks):
            if task is not None:
                task.cancel()
        for task in (self._task, self._pump, *self._tasks):
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        if self._subscription is not None:
            try:
                await asyncio.wait_for(self._subscription.close(), 2.0)
            except (TransportError, TimeoutError):
                pass

    def changed(self) -> None:
        """Our stage or state changed: announce soon."""
        self.schedule.changed(self._clock())
        self._wake.set()

    async def announced(self, stage: int | None, timeout: float) -> bool:
        """Wait until this peer's latest announcement (what a peer pulling our view gets)
        names ``stage``, at most ``timeout`` seconds; whether it does. After a stage change,
        ``changed()`` has it announced within ``min_gap_s`` of the previous announcement."""
        async def named() -> None:
            while (own := self.view.get(self.host.peer_id)) is None or own.stage != stage:
                self._announce_made.clear()
                await self._announce_made.wait()

        try:
            await asyncio.wait_for(named(), timeout)
            return True
        except TimeoutError:
            return False

    async def leave(self, timeout: float = 2.0) -> None:
        """Tell the connected peers we are leaving (best effort within ``timeout``)."""
        now = self._wall()
        data = self._announcement(now, period=self.config_period_hint(), state="leaving")
        self.view.apply(data, now)
        try:
            async with asyncio.timeout(timeout):
                await self._push_to_connected(data)
        except TimeoutError:
            pass

    def config_period_hint(self) -> float:
        return max(2.0, self.schedule.plan(self.view.estimate(self._wall())).period_s)

    # ---- the loop --------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end membership: log, count, go on
                self._counters["membership_errors"] += 1
                log.exception("membership tick failed")
            delay = min(TICK_S, max(0.0, self.schedule.next_wakeup() - self._clock()))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass

    async def _tick(self) -> None:
        self._vouch_for_heard()
        for ann in self.view.expire(self._wall()):
            log.info("peer %s left the view (expired)", ann.peer_id)
            # still connected (its pulls failed, under load, while it lived): pull it again
            # at once, as at first contact; its refreshes change nothing, so nobody pushes
            self._pulled_from.discard(ann.peer_id)
        if self.schedule.announce_due(self._clock()):
            await self._announce()
        # Pulls run as tasks of their own: a pull that waits on a dead or slow peer (up to
        # PULL_TIMEOUT_S) must never delay our announcements, or others would expire us.
        connected = await self.host.connected_peers()
        for peer in connected:  # first contact: pull its full view at once
            if peer not in self._pulled_from and len(self._tasks) < MAX_BACKGROUND:
                self._pulled_from.add(peer)
                self._spawn(self._pull(peer, cutoff=None))
        self._pulled_from.intersection_update(connected)
        now, wall = self._clock(), self._wall()
        if self.schedule.pull_due(now) and len(self._pulls) < PULLS_IN_FLIGHT:
            # a peer whose last pull failed is skipped for a while: pulls spent on a dead
            # peer are pulls not spent on live ones, and entries expire in 3 periods
            failing = {p for p, t in self._pull_failed.items() if t > now - PULL_FAILED_SKIP_S}
            self._pull_failed = {p: self._pull_failed[p] for p in failing}
            # connected peers too: one the view expired is pulled by nobody else (its pulls
            # failed everywhere); only a pull from it brings its fresh announcements back
            candidates = sorted({*self.view.peer_ids(wall), *connected} - {self.host.peer_id})
            candidates = [p for p in candidates if p not in failing] or candidates
            # one scheduled pull a peer at a time: pulls to a frozen peer (each waiting out
            # its deadline) would otherwise take every slot in turn, and the live peers'
            # announcements would stop coming (a SIGSTOPped stage peer expired every other
            # peer from the views of its stage-0 peer and its mate)
            asking = set(self._pulls.values())
            candidates = [p for p in candidates if p not in asking]
            order = self.schedule.pull(now, self.view.estimate(wall), candidates, wall=wall)
            if order is not None:
                task = self._spawn(self._scheduled_pull(order))
                self._pulls[task] = order.peer_id
                task.add_done_callback(lambda t: self._pulls.pop(t, None))

    def _vouch_for_heard(self) -> None:
        """Peers that answered us within the last period (a hop, a pull: ``links``) are alive
        whatever their announcements' delay: the view keeps them routable
        (``View.heard_from``). On a saturated 2 Mbit/s uplink a stage's only next peer
        expired from its view while answering its hops."""
        now, wall = self._clock(), self._wall()
        period = self.schedule.plan(self.view.estimate(wall)).period_s
        for peer, when in self.links.heard_since(now - period).items():
            if peer != self.host.peer_id and self.view.heard_from(peer, wall - (now - when)):
                self._counters["membership.vouched"] += 1

    def pull_timeout(self, peer: str) -> float:
        """A scheduled pull's deadline: half a period, or ``PULL_RTT_SLACK`` round trips
        measured with ``peer`` if that is longer (a congested link), at most
        ``PULL_TIMEOUT_S``. A stuck pull must end well before entries expire (3 periods),
        and ``PULLS_IN_FLIGHT`` run at once, so one on a dead peer delays no other."""
        period = self.schedule.plan(self.view.estimate(self._wall())).period_s
        rtt = self.links.link(peer).rtt_s or 0.0
        return min(PULL_TIMEOUT_S, max(0.5, period / 2, PULL_RTT_SLACK * rtt))

    async def _scheduled_pull(self, order: Any) -> None:
        timeout = self.pull_timeout(order.peer_id)
        ok = await self._pull(order.peer_id, cutoff=order.cutoff, timeout=timeout)
        if ok is False or (ok is None and timeout >= PULL_TIMEOUT_S):
            self._pull_failed[order.peer_id] = self._clock()
        self.schedule.pulled(self._clock(), order, ok=bool(ok))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _announce(self) -> None:
        now, wall = self._clock(), self._wall()
        period = self.schedule.announce(now, self.view.estimate(wall))
        stage, state = self._local().stage, self._local().state
        data = self._announcement(wall, period=period, state=state)
        previous = self.view.get(self.host.peer_id)
        self.view.apply(data, wall)
        self._announce_made.set()
        self._counters["announcements_made"] += 1
        event = previous is None or previous.stage != stage or previous.state.value != state
        if event:
            self._spawn(self._push_to_connected(data))
        if event and self._subscription is not None and self.schedule.may_gossip(
                now, self.view.estimate(wall)):
            try:
                await self.host.publish(self.topic, data)
            except TransportError as exc:
                log.debug("gossip publish failed: %s", exc)

    def _announcement(self, now: float, *, period: float, state: str) -> bytes:
        local = self._local()
        ann = Announcement(
            peer_id=self.host.peer_id, addrs=self.announced_addrs(), stage=local.stage,
            state=PeerState(state), throughput=float(local.throughput), queue=int(local.queue),
            version=__version__, model_hash=self.model_hash(), timestamp=now, period=period,
            step=int(local.step), manifest=self.view.config.manifest)
        data = encode_signed(ann, self._sign)
        self._last_announcement = data
        return data

    # ---- pulling and pushing ------------------------------------------------------------
    async def _pull(self, peer: str, *, cutoff: float | None,
                    timeout: float = PULL_TIMEOUT_S) -> bool | None:
        """Pull the full view (cutoff None) or a delta from ``peer``, page by page: True when
        it succeeded, False when it failed, None when it ran out of time (the round trip
        estimate is raised to what it waited: the next pull from that peer waits longer; a
        peer whose pulls time out at ``PULL_TIMEOUT_S`` is taken for dead)."""
        started: float | None = None  # once connected: a dial's time is not a round trip
        try:
            ann = self.view.get(peer)
            await self.host.ensure_connected(peer, ann.addrs if ann is not None else ())
            started = self._clock()
            request = self.view.pull_request(self._wall(), cutoff)
            async with asyncio.timeout(timeout):
                for _ in range(MAX_PAGES):
                    t0 = self._clock()
                    reply = await self.host.request(
                        peer, self.pull_protocol,
                        Message(kind="pull", meta={"r": encode_request(request)}),
                        timeout=self.links.deadline(peer, self.view.config.limits.max_page_bytes,
                                                    cap_s=PULL_TIMEOUT_S))
                    page = reply.meta.get("p")
                    if reply.kind != "page" or not isinstance(page, bytes):
                        raise BadPeerMessage("malformed", "pull reply without a page")
                    self.links.observe_transfer(peer, len(page), self._clock() - t0,
                                                self._clock())
                    results, cursor = self.view.apply_page(page, self._wall())
                    for applied in results:
                        self._counters[f"membership.{applied.outcome}"] += 1
                    if cursor is None:
                        break
                    request = request.next_page(cursor)
            self._counters["pulls_ok"] += 1
            self._took(self._clock() - started)
            if cutoff is None:
                self.has_view.set()
            return True
        except (TransportError, BadPeerMessage, TimeoutError) as exc:
            self._counters["pulls_failed"] += 1
            log.debug("pull from %s failed: %s", peer, exc)
            if started is not None and isinstance(exc, (TimeoutError, DeadlineExceeded)):
                self._counters["pulls_timed_out"] += 1
                self.links.observe_rtt_at_least(peer, self._clock() - started, self._clock())
                return None
            return False

    def _took(self, seconds: float) -> None:
        """A pull succeeded after ``seconds``: the view's lateness allowance follows."""
        self._pull_seconds.append(max(0.0, seconds))
        self.view.lateness_s = min(LATENESS_CAP_S,
                                   LATENESS_FACTOR * statistics.median(self._pull_seconds))

    async def _push_to_connected(self, data: bytes) -> None:
        peers = await self.host.connected_peers()

        async def push(peer: str) -> None:
            try:
                await self.host.request(peer, self.push_protocol,
                                        Message(kind="announce", meta={"a": data}), timeout=2.0)
            except TransportError as exc:
                log.debug("push to %s failed: %s", peer, exc)

        await asyncio.gather(*(push(p) for p in peers))

    async def _serve_pull(self, message: Message, peer: str) -> Message:
        request = message.meta.get("r")
        if message.kind != "pull" or not isinstance(request, bytes):
            raise BadPeerMessage("malformed", "a pull carries its request in meta 'r'")
        return Message(kind="page", meta={"p": self.view.handle_pull(request, self._wall())})

    async def _serve_push(self, message: Message, peer: str) -> Message:
        data = message.meta.get("a")
        if message.kind != "announce" or not isinstance(data, bytes):
            raise BadPeerMessage("malformed", "a push carries one announcement in meta 'a'")
        applied = self.view.apply(data, self._wall())
        self._counters[f"membership.{applied.outcome}"] += 1
        return Message(kind="ok", meta={"outcome": applied.outcome})

    async def _pump_gossip(self) -> None:
        async for msg in self._subscription:
            applied = self.view.apply(msg.data, self._wall())
            self._counters[f"membership.{applied.outcome}"] += 1

    # ---- what the API shows ---------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        out = dict(self._counters)
        for reason, n in self.view.dropped.items():
            out[f"membership_dropped.{reason}"] = n
        return out

    def peers_of(self, stage: int) -> dict[str, tuple[float, int, tuple[str, ...]]]:
        """Routable peers of ``stage``: {peer_id: (throughput, queue, addrs)}."""
        return {a.peer_id: (a.throughput, a.queue, a.addrs)
                for a in self._others_of(stage, {None})}

    def steps_of(self, stage: int) -> dict[str, int]:
        """The step each routable other peer of ``stage`` last announced."""
        return {a.peer_id: a.step for a in self._others_of(stage, {None})}

    def stage_has_state(self, stage: int) -> bool:
        """Whether the view shows another peer holding ``stage``'s state (online, or at a
        step > 0): a joiner of the stage waits for it rather than start from scratch."""
        return self.view.stage_has_state(stage, self._wall() - STATE_SOURCE_GRACE_S,
                                         besides=self.host.peer_id)

    def trainers(self) -> dict[str, tuple[str, ...]]:
        """The other trainers: {peer_id: addrs} of peers announced online with no stage and
        our model (``swarmd.trainer.trainer_sync``)."""
        now = self._wall()
        return {a.peer_id: a.addrs for a in self.view.announcements(now)
                if a.stage is None and a.state is PeerState.ONLINE
                and a.peer_id != self.host.peer_id
                and self.view.why_not(a.peer_id, now) == "no_stage"}

    def state_sources(self, stage: int) -> list[tuple[str, tuple[str, ...]]]:
        """Peers to ask for ``stage``'s state: online peers of the stage with our model, even
        ones whose next announcement is overdue (a fresh view is often a little stale, and
        asking a dead peer costs only a failed dial). Freshest first."""
        found = self._others_of(stage, {None, "overdue"},
                                now=self._wall() - STATE_SOURCE_GRACE_S)
        return [(a.peer_id, a.addrs) for a in sorted(found, key=lambda a: -a.timestamp)]

    def _others_of(self, stage: int, reasons: set[str | None],
                   now: float | None = None) -> list[Announcement]:
        """The other peers of ``stage`` whose reason to be kept out of routing (None: none)
        is one of ``reasons``, as of ``now`` (wall clock; default: now)."""
        now = self._wall() if now is None else now
        return [a for a in self.view.announcements(now)
                if a.stage == stage and a.peer_id != self.host.peer_id
                and self.view.why_not(a.peer_id, now) in reasons]

    def peer_states(self) -> dict[str, tuple[int | None, str]]:
        now = self._wall()
        return {a.peer_id: (a.stage, a.state.value) for a in self.view.announcements(now)}

    def swarm_info(self) -> SwarmInfo:
        snap = self.view.snapshot(self._wall())

        def row(p: Any) -> PeerRow:
            return PeerRow(peer_id=p.peer_id, stage=p.stage, state=p.state,
                           throughput=p.throughput, queue=p.queue, routable=p.routable,
                           reason=p.why_not, age_s=p.age_s, addrs=tuple(p.addrs),
                           step=p.step)

        stages = tuple(StageRow(stage=s.stage, peers=tuple(row(p) for p in s.peers),
                                total_throughput=s.total_throughput,
                                routable_peers=s.routable_peers) for s in snap.stages)
        return SwarmInfo(swarm=self.config.swarm.name, num_stages=len(stages), stages=stages,
                         bottleneck=snap.bottleneck_stage if stages else None,
                         excluded=tuple(row(p) for p in snap.other_peers),
                         peers_total=snap.peers)

