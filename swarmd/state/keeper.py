"""Where a stage's state comes from and where it goes: checkpoints, peers, catch-up.

- **Before serving** (``load``): the newer of this home's checkpoint and the stage's live
  peers (``swarmd.state.transfer.fetch_state`` with ``newer_than`` the checkpoint's step). A
  corrupt checkpoint (or one holding NaN/Inf) is reported, set aside (``quarantine``) and
  replaced from peers. The checkpoint is read, hashed and checked in a thread. A peer that had
  a checkpoint (it served the stage before), or whose ``mates_expected()`` says the swarm shows
  the stage's state held (or no view came yet), waits (at most ``MATES_WAIT_S``) for its view
  to name a mate before it decides. Only a peer with neither a checkpoint nor a live peer of
  its stage starts from the initial weights. Offers are bounded by what the stage's module
  implies (``state_bytes_bound``), and a downloaded state must be finite.
- **While serving**: a ``StateServer`` hands this stage's state to joiners, captured in the
  compute thread between two steps; a peer that learns a mate is ahead (``behind``) downloads
  the newer state and takes it over between two steps; a peer told that a round's leader held
  other weights at our step (``diverged``: the stage drifted) takes the leader's state even at
  an equal step (``state.diverged``, then ``caught_up``); a peer whose step stands still
  (no rounds: training paused) asks its mates for their step and weights digest
  (``state_digest``, ``swarmd.averaging.authority.IdleDrift``) and takes the state of the
  lowest-id mate at its step when that one's digest differs (``idle_adopt_from``,
  ``state.idle_diverged``), so a drift left when training stopped is repaired too; after a
  download, the steps the stage took meanwhile are replayed (``swarmd.state.catchup``); every
  ``every_steps`` steps and on shutdown the state is saved atomically (``save_checkpoint``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from swarmd.averaging.authority import IdleDrift, idle_adopt_from
from swarmd.state.catchup import Replayer
from swarmd.state.checkpoint import (CorruptCheckpoint, SaveAborted, checkpoint_dir,
                                     checkpoint_path, in_thread, load_checkpoint, quarantine,
                                     save_checkpoint)
from swarmd.state.encoding import (NonFiniteState, StageState, StateMismatch, capture,
                                   check_finite_state, restore, state_bytes_bound)
from swarmd.state.messages import SizeBound
from swarmd.state.fetch import ask_digest, fetch_state
from swarmd.state.serve import StateServer
from swarmd.state.spool import clear as clear_spools
from swarmd.state.transfer import StateTransferFailed
from transport.errors import TransportError
from swarmd.protocols import Protocols

log = logging.getLogger("swarmd.keeper")

#: a whole download at most: each request has its own deadline derived from the link
#: (swarmd.state.fetch), so a dead or slow source is left long before this
STAGE_STATE_FETCH_TIMEOUT_S = 3600.0
#: after a catch-up attempt, the next one waits at least this long to download (a replay of
#: the steps taken since runs at once)
CATCH_UP_GAP_S = 2.0
#: after a drift repaired, the next repair waits at least this long: peers whose optimizer
#: results differ in the last bits (other devices or kernels) would otherwise download on
#: every round
REPAIR_GAP_S = 30.0
#: how long a peer that expects mates waits for its view to name one, and how often it looks
MATES_WAIT_S = 5.0
MATES_POLL_S = 0.2
#: downloads tried before serving, and the pause between two
LOAD_ATTEMPTS = 3
LOAD_RETRY_S = 1.0
#: how often a serving peer compares its step with the steps its mates announce
WATCH_S = 2.0
#: the most mates asked for their digest in one idle check, and each request's deadline
MAX_DIGEST_MATES = 8
DIGEST_TIMEOUT_S = 10.0
#: how long an abandoned save is waited for to remove its file (it stops at its next chunk)
ABORT_WAIT_S = 0.5


def state_protocol(swarm: str) -> str:
    return Protocols(swarm).state


class StageKeeper:
    """One per served stage. ``sources()`` returns [(peer id, addrs)] of the stage's other
    live peers; ``server`` is the ``StageServer`` whose module, optimizer and step it keeps.
    ``mates_expected()`` (optional) says whether the swarm shows other peers serving this
    stage, so that ``load`` waits for them to appear in ``sources()``."""

    def __init__(self, host: Any, server: Any, *, swarm: str, home: Path | None,
                 model_hash: str, every_steps: int,
                 sources: Callable[[], list[tuple[str, tuple[str, ...]]]],
                 mates_expected: Callable[[], bool] | None = None,
                 mates_wait_s: float = MATES_WAIT_S,
                 announced_steps: Callable[[], dict[str, int]] | None = None,
                 weights_digest: Callable[[], Awaitable[tuple[int, str]]] | None = None,
                 idle: IdleDrift | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: every time here is read from this clock (seconds, monotonic)
        self._clock = clock
        self.host = host
        self.server = server
        self.stage = server.stage
        self.model_hash = model_hash
        self.dir = checkpoint_dir(home) if home is not None else None
        self.every_steps = every_steps
        self.sources = sources
        self.mates_expected = mates_expected
        self.mates_wait_s = mates_wait_s
        self.announced_steps = announced_steps
        self._watching: asyncio.Task[None] | None = None
        self._weights_digest = weights_digest
        self._idle = idle if idle is not None else IdleDrift()
        self._idle_check: asyncio.Task[None] | None = None
        self.protocol = state_protocol(swarm)
        self.swarm = swarm
        #: where downloads are written while they arrive (``swarmd.state.spool``)
        self.spool_dir = self.dir / "incoming" if self.dir is not None else None
        self._counts: dict[str, int] = {}
        self._served: dict[str, int] = {}
        #: (done, total) bytes of a download in progress, for status
        self.syncing: tuple[int, int] | None = None
        self.source_of_state = "initial"
        self._replayer = Replayer(host, server, protocol=self.protocol, model_hash=model_hash,
                                  counters=self._counts)
        self._serving = StateServer(host, self.protocol, self._snapshot, stage=self.stage,
                                    model_hash=model_hash, counters=self._served,
                                    step=lambda: self.server.step,
                                    weights_digest=self._digest_if_ready,
                                    replay=self._replayer.serve)
        self._catching_up: asyncio.Task[None] | None = None
        self._last_catch_up = 0.0
        self._last_repair = -REPAIR_GAP_S
        self._saving = asyncio.Lock()
        self._saved_step = -1
        #: set once a save is abandoned: the writer stops, no save starts after it
        self._abort = threading.Event()
        self._writer: asyncio.Future[Path] | None = None
        #: how long the last checkpoint write took (None: none yet); a stop plans by it
        self.last_save_s: float | None = None
        self._ready = False

    @property
    def counters(self) -> dict[str, int]:
        """What this keeper counted (downloads, checkpoints), and as ``served.<name>`` what its
        state server did (infos, chunks, refused requests by reason)."""
        return {**self._counts, **{f"served.{k}": v for k, v in self._served.items()}}

    def _count(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1

    # ---- before serving ------------------------------------------------------------------
    async def load(self) -> str:
        """Take the newest state available; returns where it came from."""
        local = await asyncio.to_thread(self._read_checkpoint)  # reads and hashes the file
        peers = await self._wait_for_sources(expected=local is not None)
        log.info("stage %d: checkpoint %s, %d live peer(s) of the stage to ask", self.stage,
                 f"at step {local.step}" if local else "none", len(peers))
        fetched = await self._download(peers, local) if peers else None
        state, origin = (fetched, "peers") if fetched is not None else (
            (local, "checkpoint") if local is not None else (None, "initial"))
        if state is not None:
            await self.server.when_drained(self._restore, state)
            self.server.took_state(state.step)
        if origin == "peers":  # no round runs yet: the mates' steps since are replayed
            await self._replayer.replay(peers)
        self.source_of_state = origin
        self._saved_step = self.server.step if origin == "checkpoint" else -1
        log.info("stage %d: state from %s (step %d)", self.stage, origin, self.server.step)
        self._ready = True
        self._serving.start()
        if self.announced_steps is not None:
            self._watching = asyncio.create_task(self._watch(self.announced_steps))
        return origin

    async def _download(self, peers: list[tuple[str, tuple[str, ...]]],
                        local: StageState | None) -> StageState | None:
        """The state from ``peers`` if newer than ``local``: asked up to ``LOAD_ATTEMPTS``
        times; None when it cannot be had (start from ``local`` or the initial weights)."""
        for attempt in range(LOAD_ATTEMPTS):
            lies = self._lies()
            try:
                return await self._fetch(peers, newer_than=local.step if local else None)
            except (StateTransferFailed, TransportError) as exc:
                # e.g. every peer of the stage is itself still syncing, or answering slowly:
                # ask again, then start from what we have; a mate's later announced step
                # makes us catch up
                self._count("state_downloads_failed")
                # asking again helps a slow or busy source, not one that sent bad data
                last = attempt == LOAD_ATTEMPTS - 1 or self._lies() > lies
                log.warning("stage %d: could not download the state from peers (%s); %s",
                            self.stage, exc, ("starting from the checkpoint" if local else
                                              "starting from the initial weights") if last
                            else "asking again")
                if last:
                    return None
                await asyncio.sleep(LOAD_RETRY_S)
                peers = self.sources() or peers
        return None

    def _lies(self) -> int:
        """Replies so far that were malformed or held NaN/Inf."""
        return self._counts.get("bad_replies", 0) + self._counts.get("non_finite_states", 0)

    async def _wait_for_sources(self, *, expected: bool) -> list[tuple[str, tuple[str, ...]]]:
        """``sources()``; when mates are expected (a checkpoint says this peer served the
        stage before, or ``mates_expected()``: the swarm shows it served, or no view came yet)
        but none is known yet, ask again until one appears, ``mates_wait_s`` passed, or (no
        checkpoint) ``mates_expected()`` turns false: a view still filling must not make a
        restarted peer start from stale or initial weights."""
        def still_expected() -> bool:
            return expected or (self.mates_expected is not None and self.mates_expected())

        peers = self.sources()
        if peers or not still_expected():
            return peers
        deadline = self._clock() + self.mates_wait_s
        while not peers and self._clock() < deadline and still_expected():
            await asyncio.sleep(MATES_POLL_S)
            peers = self.sources()
        self._count("waited_for_mates")
        return peers

    def _read_checkpoint(self) -> StageState | None:
        """In a thread: this home's checkpoint of the stage, if usable (finite, this model)."""
        if self.dir is None:
            return None
        try:
            if self.spool_dir is not None and self.spool_dir.is_dir():
                clear_spools(self.spool_dir)  # what a killed run left
            state = load_checkpoint(self.dir, self.stage, max_bytes=self._max_bytes())
            if state is not None:
                check_finite_state(state)
        except (CorruptCheckpoint, NonFiniteState) as exc:
            log.error("%s", exc)
            path = getattr(exc, "path", None) or checkpoint_path(self.dir, self.stage)
            quarantine(path)
            self._count("corrupt_checkpoints")
            return None
        if state is not None and state.model_hash != self.model_hash:
            log.warning("stage %d: the checkpoint is of model %s, this swarm trains %s: "
                        "ignored", self.stage, state.model_hash, self.model_hash)
            return None
        return state

    async def _fetch(self, peers: list[tuple[str, tuple[str, ...]]], *,
                     newer_than: int | None) -> StageState | None:
        def progress(done: int, total: int) -> None:
            self.syncing = (done, total)

        self.syncing = (0, 0)
        low, high = state_bytes_bound(self.server.module)
        try:
            return await fetch_state(self.host, self.protocol, peers, stage=self.stage,
                                     model_hash=self.model_hash,
                                     timeout_s=STAGE_STATE_FETCH_TIMEOUT_S,
                                     max_bytes=high, on_progress=progress,
                                     spool_dir=self.spool_dir,
                                     newer_than=newer_than, counters=self._counts,
                                     size_bound=SizeBound(low, high))
        finally:
            self.syncing = None

    def _max_bytes(self) -> int:
        """The largest encoded state of this stage: what its module implies (no fixed
        ceiling: memory is bounded by a piece, ``swarmd.state.checkpoint``)."""
        return state_bytes_bound(self.server.module)[1]

    def _restore(self, state: StageState) -> None:
        """In the compute thread: take ``state`` over (weights, optimizer, step)."""
        restore(state, self.server.module, self.server.optimizer, stage=self.stage,
                model_hash=self.model_hash)
        self.server.worker.zero_grad()  # gradients of the old weights do not apply
        self.server.stepper.forget(state.step)  # nor the steps that led to them

    # ---- while serving ---------------------------------------------------------------------
    async def _snapshot(self) -> StageState | None:
        if not self._ready or self._catching_up is not None and not self._catching_up.done():
            return None  # nothing trustworthy to hand out while our own state is in transit
        return await self.server.run_exclusive(self._capture)

    def _capture(self) -> StageState:
        return capture(self.server.module, self.server.optimizer, stage=self.stage,
                       step=self.server.stepper.weights_step, model_hash=self.model_hash)

    def behind(self, peer: str, step: int) -> None:
        """A mate is at ``step``, ahead of us: download its state (once at a time)."""
        if step <= self.server.step or not self._ready:
            return
        if self._catching_up is not None and not self._catching_up.done():
            return
        if self._clock() - self._last_catch_up < CATCH_UP_GAP_S:
            # a catch-up just ran: no download again so soon, but a replay of the steps
            # taken since (a few gradients) keeps a peer whose stage steps faster than the
            # gap from staying a step behind every round
            if self._replayer.enabled:
                self._catching_up = asyncio.create_task(self._catch_up(peer, replay_only=True))
            return
        self._last_catch_up = self._clock()
        self._catching_up = asyncio.create_task(self._catch_up(peer))

    def diverged(self, peer: str, step: int) -> None:
        """``peer`` (a round's leader, the stage's winner by ``same_step_verdict``) held other
        weights than ours at ``step``: take its state, even one at our step (once at a time)."""
        if not self._ready:
            return
        self._count("diverged")
        if self._catching_up is not None and not self._catching_up.done():
            return  # a download under way: what it brings is looked at again next round
        now = self._clock()
        if now - self._last_catch_up < CATCH_UP_GAP_S or now - self._last_repair < REPAIR_GAP_S:
            self._count("diverged_deferred")
            return
        self._last_catch_up = now
        log.warning("stage %d: our weights at step %d differ from the stage's (%s): taking its "
                    "state", self.stage, step, peer)
        self._catching_up = asyncio.create_task(self._repair(peer, step))

    async def _repair(self, peer: str, step: int) -> None:
        """A drift: our rounds are held from now until the winner's state is taken over, so
        that its state (at our step or later) cannot be overtaken by ours while it downloads;
        the winner steps without us meanwhile, and we catch up from there."""
        taken = self._counts.get("caught_up", 0)
        async with self.server.rounds_held():
            await self._catch_up(peer, at_least=max(step, self.server.step))
        if self._counts.get("caught_up", 0) > taken:
            self._count("drift_repaired")
            self._last_repair = self._clock()

    async def _watch(self, announced: Callable[[], dict[str, int]]) -> None:
        """Every ``WATCH_S``: a mate whose announcement shows a later step than ours means we
        are behind, even when no round tells us so (training paused, or no mate leads); a
        step that stands still makes us compare weights with the mates (``_idle_drift``)."""
        while True:
            await asyncio.sleep(WATCH_S)
            steps = announced()
            if steps:
                peer = max(steps, key=lambda p: steps[p])
                if steps[peer] > self.server.step:
                    self.behind(peer, steps[peer])
            if (self._weights_digest is not None and self._idle.due(self.server.step,
                                                                    self._clock())
                    and (self._idle_check is None or self._idle_check.done())):
                self._idle_check = asyncio.create_task(self._idle_drift())

    async def _digest_if_ready(self) -> tuple[int, str] | None:
        """(step, round digest) of our weights, for a mate's ``state_digest``; None while our
        state is not settled (loading, or a download under way)."""
        if (self._weights_digest is None or not self._ready
                or self._catching_up is not None and not self._catching_up.done()):
            return None
        return await self._weights_digest()

    async def _idle_drift(self) -> None:
        """No round ran for a while: ask the mates (at most ``MAX_DIGEST_MATES``, each within
        ``DIGEST_TIMEOUT_S``) for their step and digest; the lowest-id mate at our step with
        other weights is the one whose state we take (``idle_adopt_from``)."""
        mates = self.sources()[:MAX_DIGEST_MATES]
        ours = await self._digest_if_ready() if mates else None
        if ours is None:
            return
        step, digest_ = ours
        self._count("idle_checks")
        replies = await asyncio.gather(*(
            ask_digest(self.host, self.protocol, p, a, stage=self.stage,
                       model_hash=self.model_hash, timeout_s=DIGEST_TIMEOUT_S,
                       counters=self._counts) for p, a in mates))
        found = {r.peer: (r.step, r.digest) for r in replies if r is not None}
        peer = idle_adopt_from(me=self.host.peer_id, our_step=step, our_digest=digest_,
                               mates=found)
        if peer is None or self.server.step != step:  # equal, or a round moved us meanwhile
            return
        self._count("idle_diverged")
        self.diverged(peer, step)

    async def _catch_up(self, peer: str, *, at_least: int | None = None,
                        replay_only: bool = False) -> None:
        """Download a newer state (the one ahead first) and take it over; with ``at_least``
        (a drift), ``peer``'s own state at that step or later, even at our step; with
        ``replay_only``, only replay the steps the stage took since ours. New
        forwards are refused with busy meanwhile (``Gate.catching_up``): the stage's peers
        that are at its step take them."""
        gate = self.server.gate
        gate.catching_up = True
        try:
            if replay_only:
                await self._replayed(self._ahead_first(peer))
            else:
                await self._catch_up_now(peer, at_least=at_least)
        finally:
            gate.catching_up = False

    def _ahead_first(self, peer: str) -> list[tuple[str, tuple[str, ...]]]:
        """The stage's sources, ``peer`` (the one ahead) first."""
        return sorted(self.sources(), key=lambda p: p[0] != peer)

    async def _catch_up_now(self, peer: str, *, at_least: int | None) -> None:
        if at_least is None:
            peers = self._ahead_first(peer)
            if await self._replayed(peers):
                return
            newer_than = self.server.step
        else:  # only the winner's weights repair a drift: nobody else's
            peers = [p for p in self.sources() if p[0] == peer] or [(peer, ())]
            newer_than = at_least - 1
        try:
            state = await self._fetch(peers, newer_than=newer_than)
        except (StateTransferFailed, TransportError) as exc:
            log.warning("stage %d: catching up failed: %s", self.stage, exc)
            return
        if state is None:
            self._count("catch_up_none_offered")
            log.info("stage %d: no source offered a state after step %d", self.stage,
                     newer_than)
            return
        if await self._take(state, peers, equal_too=at_least is not None):
            self._count("caught_up")
            log.info("stage %d: caught up to step %d", self.stage, self.server.step)

    async def _take(self, state: StageState, peers: list[tuple[str, tuple[str, ...]]], *,
                    equal_too: bool = False) -> bool:
        """Take a downloaded state over (rounds held, the stage drained) unless ours moved
        past it meanwhile (or to it: unless ``equal_too``); then replay the steps ``peers``
        took since. Whether it was taken."""
        async with self.server.rounds_held():  # a round must not step beside the restore
            if state.step < self.server.step or not equal_too and (
                    state.step == self.server.step):  # our rounds went on: keep ours
                self._count("catch_up_stale")
                log.info("stage %d: the downloaded state (step %d) is no newer than ours "
                         "(%d) by now: kept ours", self.stage, state.step, self.server.step)
                return False
            try:
                await self.server.when_drained(self._restore, state)
            except StateMismatch as exc:
                log.error("stage %d: the downloaded state does not fit: %s", self.stage, exc)
                return False
            self.server.took_state(state.step)
            await self._replayer.replay(peers)  # the steps taken meanwhile
        return True

    def offered(self, peer: str, offer: Any) -> int | None:
        """``peer`` offers a checkpoint of a stage it no longer serves (``swarmd.state.offer``):
        one of ours newer than our step is downloaded from it and taken over (once at a
        time). Returns our step (None: another stage or model, or no state settled yet)."""
        if (offer.stage != self.stage or offer.model_hash != self.model_hash
                or not self._ready):
            return None
        if offer.step > self.server.step and (self._catching_up is None
                                              or self._catching_up.done()):
            self._count("offers_taking")
            log.info("stage %d: %s offers its checkpoint at step %d, ours is at %d: taking it",
                     self.stage, peer, offer.step, self.server.step)
            self._catching_up = asyncio.create_task(self._take_offer(peer, offer.step))
        return self.server.step

    async def _take_offer(self, peer: str, step: int) -> None:
        from swarmd.protocols import Protocols

        self.syncing = (0, 0)
        low, high = state_bytes_bound(self.server.module)
        try:
            state = await fetch_state(
                self.host, Protocols(self.swarm).offered_state, [(peer, ())], stage=self.stage,
                model_hash=self.model_hash, timeout_s=STAGE_STATE_FETCH_TIMEOUT_S,
                max_bytes=high, newer_than=self.server.step, spool_dir=self.spool_dir,
                counters=self._counts, size_bound=SizeBound(low, high))
        except (StateTransferFailed, TransportError) as exc:
            log.warning("stage %d: the checkpoint %s offered could not be had: %s", self.stage,
                        peer, exc)
            return
        finally:
            self.syncing = None
        if state is not None and await self._take(state, self.sources()):
            self._count("offers_taken")
            log.info("stage %d: took %s's checkpoint: now at step %d", self.stage, peer,
                     self.server.step)

    async def _replayed(self, peers: list[tuple[str, tuple[str, ...]]]) -> bool:
        """Behind by a few steps: whether replaying them onto our state caught us up (no
        download then: ``swarmd.state.catchup``)."""
        if not self._replayer.enabled:
            return False
        async with self.server.rounds_held():
            if await self._replayer.replay(peers) and self._replayer.caught_up():
                self._count("caught_up_by_replay")
                return True
        return False

    async def stepped(self) -> None:
        """After every optimizer step: save a checkpoint when one is due."""
        if self.every_steps and self.server.step - max(self._saved_step, 0) >= self.every_steps:
            await self.save()

    async def save(self, deadline: float | None = None,
                   hurry: asyncio.Event | None = None) -> Path | None:
        """Save a checkpoint unless the step is saved already. With a ``deadline`` (monotonic
        seconds) or a ``hurry`` event, a save that has not finished by then (or by the time
        ``hurry`` is set) is abandoned: the file being written is removed and the previous
        checkpoint stays (``checkpoint.save_checkpoint`` writes atomically)."""
        if self.dir is None or not self._ready or self._abort.is_set():
            return None
        if hurry is not None and hurry.is_set():
            return self._abandoned("a second stop request")
        saving = asyncio.ensure_future(self._save_now())
        saving.add_done_callback(lambda t: t.cancelled() or t.exception())  # always retrieved
        waiters: set[asyncio.Future[Any]] = {saving}
        if hurry is not None:
            waiters.add(asyncio.ensure_future(hurry.wait()))
        timeout = None if deadline is None else max(0.0, deadline - self._clock())
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            saving.cancel()  # the write itself, if started, finishes (it is atomic)
            raise
        finally:
            for waiter in waiters - {saving}:
                waiter.cancel()
        if saving in done:
            return saving.result()
        self._abort.set()  # the writer stops at its next chunk and removes its file
        saving.cancel()
        writer = self._writer
        if writer is not None and not writer.done():
            await asyncio.wait({writer}, timeout=ABORT_WAIT_S)
        return self._abandoned("a second stop request" if hurry is not None and hurry.is_set()
                               else "its deadline passed")

    def abandon(self) -> None:
        """From any thread: a save in progress stops at its next chunk (its file removed);
        no save starts after this."""
        self._abort.set()

    def _abandoned(self, why: str) -> None:
        self._abort.set()
        self._count("checkpoints_abandoned")
        log.warning("stage %d: the checkpoint at step %d was not saved (%s); the previous "
                    "checkpoint, if any, is kept whole", self.stage, self.server.step, why)
        return None

    async def _save_now(self) -> Path | None:
        async with self._saving:
            if self.server.step == self._saved_step:
                return None
            t0 = self._clock()
            state = await self.server.run_exclusive(self._capture)
            self._writer = in_thread(self._save_finite, state)
            try:
                path = await asyncio.shield(self._writer)
            except NonFiniteState as exc:  # the last good checkpoint stays
                log.error("stage %d: not saving a checkpoint: %s", self.stage, exc)
                self._count("non_finite_not_saved")
                return None
            except SaveAborted:
                return None
            self.last_save_s = self._clock() - t0
            log.debug("stage %d: checkpoint of step %d saved in %.2f s", self.stage, state.step,
                      self.last_save_s)
            self._saved_step = state.step
            self._count("checkpoints_saved")
            return path

    def _save_finite(self, state: StageState) -> Path:
        """In a thread: check the state is finite, then write it atomically (unless the save
        is abandoned meanwhile)."""
        assert self.dir is not None
        check_finite_state(state)
        return save_checkpoint(self.dir, state, abort=self._abort.is_set)

    async def close(self, deadline: float | None = None,
                    hurry: asyncio.Event | None = None) -> None:
        """Stop serving the state and save a checkpoint (by ``deadline``, unless ``hurry`` is
        set first: see ``save``)."""
        self._serving.close()
        for task in (self._watching, self._idle_check, self._catching_up):
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        await self.save(deadline, hurry)  # on shutdown: never lose more than this

