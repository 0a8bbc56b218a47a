"""``swarmd join``: one daemon per machine.

Owns, in this order (and tears down in reverse): the home lock, the libp2p host, membership,
the local HTTP API. ``<home>/api`` is written only once the HTTP server is bound and removed on
exit. SIGINT/SIGTERM or ``POST /api/v0/stop`` start a graceful stop within
``node.shutdown_grace_s`` (phases and deadlines: ``swarmd.node.shutdown``): announce
``leaving``, refuse new forwards with ``busy``, let the microbatches in flight here finish
(hand back the rest), save the checkpoint by its deadline, close everything, exit 0. A second
request stops at once; a watchdog ends a stop that overruns its budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from swarmd.version import __version__
from swarmd.api.types import (ConnectedPeer, IdInfo, StageInfo, StatusInfo, SwarmInfo,
                              TrainingInfo, peer_rows, trainer_rows)
from swarmd.config import Config
from swarmd.manifest.local import swarm_manifest
from swarmd.models.registry import (model_fingerprint_of, model_hash_of, model_seam_of,
                                    torch_placement_of)
from swarmd.errors import SwarmdError
from swarmd.node.connectivity import keep_connected
from swarmd.node.caps import UploadLeft
from swarmd.node.host_options import announced_throughput, limits_status, stages_that_fit
from swarmd.runfiles import HomeLock, remove_api_file, write_api_file
from swarmd.node.shutdown import BEGIN, HURRY, StopBudget, StopRequests, plan_stop
from swarmd.peer_states import PeerState, transition
from swarmd.pipeline.progress import TrainerBook

log = logging.getLogger("swarmd.node.daemon")

#: with --stage auto, how long to wait for a first view before choosing a stage
PLACEMENT_WAIT_S = 5.0
#: how long a move between stages waits for the old stage's round in progress to end (a
#: member that leaves mid-round leaves its parts to be repaired by the others: one such
#: move held a mate of 12 in its round for over a minute, then a chase of 40 steps)
MOVE_ROUND_WAIT_S = 30.0
#: how long a daemon going online waits for its announcement to name its stage (due within
#: membership's min_gap_s, 0.5 s) before saying it started
ANNOUNCED_WAIT_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinOptions:
    """What ``swarmd join`` was asked for on top of the configuration."""

    home: Path
    config: Config
    listen: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    http_listen: str | None = None
    #: a stage number, or None for "auto" (the balancer places the peer)
    stage: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """Printed when the daemon is up."""

    peer_id: str
    addrs: tuple[str, ...]
    http_url: str


class Daemon:
    """The daemon's state and its ``DaemonApi`` (what the HTTP API and CLI read)."""

    def __init__(self, options: JoinOptions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: every time here is read from this clock (seconds, monotonic)
        self._clock = clock
        self.options = options
        self.config = options.config
        self.started_at = clock()
        #: the lifecycle state (``swarmd.peer_states``), moved only through ``_enter``
        self.peer_state = PeerState.JOINING
        self.stage = options.stage
        self.host: Any = None
        self.membership: Any = None
        self.stage_server: Any = None
        self.averager: Any = None
        self.nat: Any = None
        self.keeper: Any = None
        self.balancer: Any = None
        self.balance_counters: Counter[str] = Counter()
        self.last_migration: dict[str, Any] | None = None
        #: a moving peer's measured speed (``_migrate``): its new server starts from it and,
        #: until that server exists, ``_local`` announces it with the caps applied
        self._throughput_hint = 0.0
        self._moving_throughput = 0.0
        #: what the upload cap leaves for hops after averaging and state (swarmd.node.caps)
        self._upload_left = UploadLeft()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        #: set by a second stop request: stop at once
        self._hurry = asyncio.Event()
        self._stop_requests = StopRequests()
        #: the deadlines of the stop under way (None until one is requested)
        self.budget: StopBudget | None = None
        #: called with each new budget (``run_join`` arms its watchdog with it)
        self.on_budget: Callable[[StopBudget], None] | None = None
        self._rng = random.Random()
        self._view_waited = False
        #: the swarm manifest this daemon runs (``swarmd.manifest.join.Settled``) and what its
        #: fetch counted
        self.manifest: Any = None
        self.manifest_counters: Counter[str] = Counter()
        #: what offering a checkpoint of a stage it no longer serves did (``swarmd.state.offer``)
        self.offer_counters: dict[str, int] = {}
        #: what the trainers this daemon's stage serves told of their runs (kept across
        #: stage moves; ``swarmd.pipeline.progress``)
        self.trainers = TrainerBook()

    # ---- DaemonApi ---------------------------------------------------------------------
    def id_info(self) -> IdInfo:
        return IdInfo(peer_id=self.host.peer_id, addrs=tuple(self.host.addrs),
                      swarm=self.config.swarm.name, version=__version__)

    async def status(self) -> StatusInfo:
        counters = self.host.counters.snapshot()
        if self.membership is not None:
            counters.update(self.membership.counters())
        if self.stage_server is not None:
            counters.update({f"stage.{k}": v for k, v in self.stage_server.counters.items()})
            counters.update({f"sync.{k}": v for k, v in self.stage_server.sync.counters.items()})
            counters["stage.step"] = self.stage_server.step
            counters["stage.in_flight"] = self.stage_server.in_flight
        counters.update({f"balance.{k}": v for k, v in self.balance_counters.items()})
        if self.keeper is not None:
            counters.update({f"state.{k}": v for k, v in self.keeper.counters.items()})
        if self.averager is not None:
            counters.update({f"allreduce.{k}": v
                             for k, v in self.averager.counters.snapshot().items()})
        counters.update({f"manifest.{k}": v for k, v in self.manifest_counters.items()})
        counters.update({f"offer.{k}": v for k, v in self.offer_counters.items()})
        local = self._local()
        throughput, queue = local.throughput, local.queue
        nat = self.nat.status() if self.nat is not None else None
        if self.nat is not None:
            counters.update(self.nat.counters)
            counters.update(self.nat.dialback.counters)
        return StatusInfo(
            peer_id=self.host.peer_id, swarm=self.config.swarm.name, version=__version__,
            stage=self.stage, state=self.state, uptime_s=self._clock() - self.started_at,
            connected_peers=len(await self.host.connected_peers()), throughput=throughput,
            queue=queue, counters=counters,
            histograms=({k: v.to_json() for k, v in self.stage_server.histograms.snapshot().items()}
                        if self.stage_server is not None else {}),
            reachability=nat.reachability if nat else "unknown",
            relays=nat.relays if nat else (), reachability_hint=nat.hint if nat else "",
            observed_addrs=nat.observed_addrs if nat else (),
            announced_addrs=self.membership.announced_addrs() if self.membership else (),
            links=self._links_status(),
            limits=limits_status(self.config, self.host, self.stage_server,
                                 self._upload_left),
            grace_left_s=self.budget.left(self._clock()) if self.budget else None,
            trainers=trainer_rows(self.trainers.series(), self._clock(), curves=False),
            **self._manifest_status())

    def _manifest_status(self) -> dict[str, str]:
        m = self.manifest
        return {} if m is None else {"manifest": m.manifest.hash,
                                     "model": m.manifest.model_text(), "manifest_from": m.origin}

    def _links_status(self) -> dict[str, Any]:
        """Each link's measured round trip and bandwidth and the deadlines derived from them."""
        from swarmd.links import links_for
        from swarmd.pipeline.held import HOP_TIMEOUT_S

        return links_for(self.host).status(hop_cap_s=HOP_TIMEOUT_S,
                                           round_cap_s=self.config.averaging.timeout_s,
                                           chunk_cap_s=self.config.network.request_timeout_s)

    def swarm(self) -> SwarmInfo:
        if self.membership is not None:
            return self.membership.swarm_info()
        return SwarmInfo(swarm=self.config.swarm.name, num_stages=0, stages=(), bottleneck=None)

    async def stage_info(self) -> StageInfo:
        server, keeper = self.stage_server, self.keeper
        if server is None:
            return StageInfo(stage=self.stage, state=self.state)
        digest, norm = await server.run_exclusive(server.params_fingerprint)
        return StageInfo(stage=self.stage, state=self.state, step=server.step,
                         samples=server.worker.samples_accumulated,
                         state_from=keeper.source_of_state if keeper else "initial",
                         syncing=keeper.syncing if keeper else None, params_digest=digest,
                         params_norm=norm, **server.staleness())

    async def peers(self) -> list[ConnectedPeer]:
        connected = await self.host.connected_peers()
        known = self.membership.peer_states() if self.membership is not None else {}
        server = self.stage_server
        wiring = server.wiring if server is not None else None
        relay = getattr(self.host, "relay", None)
        return peer_rows(set(connected), known,
                         wiring.snapshot(self._clock()) if wiring is not None else [],
                         server.handlers.budgets.refused_by_peer if server is not None else {},
                         addrs_of=self._addrs_of,
                         paths=await relay.paths() if relay is not None else None)

    def training(self) -> TrainingInfo:
        return TrainingInfo(trainers=trainer_rows(self.trainers.series(), self._clock(),
                                                  curves=True))

    async def stop(self) -> None:
        self.request_stop()

    def request_stop(self) -> None:
        """The first request begins a graceful stop within ``node.shutdown_grace_s``; the
        second stops at once."""
        what, now = self._stop_requests.request(), self._clock()
        if what == BEGIN:
            keeper = self.keeper
            self.budget = plan_stop(self.config.node.shutdown_grace_s, now=now,
                                    save_estimate_s=keeper.last_save_s if keeper else None)
            log.info("stop requested: leaving within %.1f s", self.budget.left(now))
            self._enter(PeerState.LEAVING)
            self._stop.set()
        elif what == HURRY and self.budget is not None:
            log.warning("a second stop request: stopping at once")
            self.budget = self.budget.hurried(now)
            self._hurry.set()
        else:
            return
        if self.on_budget is not None:
            self.on_budget(self.budget)

    def abandon_save(self) -> None:
        """From any thread: a checkpoint save in progress stops (the previous one is kept)."""
        keeper = self.keeper
        if keeper is not None:
            keeper.abandon()

    # ---- lifecycle ---------------------------------------------------------------------
    async def run(self, on_started: Callable[[Started], None] | None = None) -> None:
        """Own the home lock, the host, membership, the averager and the HTTP API (torn down
        in reverse) and serve until a stop is requested."""
        from swarmd.api.token import create_token
        from swarmd.node.home import load_identity
        from swarmd.node.host_options import host_options
        from transport.host import Host
        from transport.memory import keep_freed_memory

        home = self.options.home
        self._device, self._dtype = torch_placement_of(self.config)  # bad settings fail here
        model_hash_of(self.config)  # so does a model that cannot be built (ModelError)
        with HomeLock(home):
            identity = load_identity(home)
            keep_freed_memory()
            token = create_token(home)
            async with Host(identity, host_options(self.config, self.options.listen)) as host:
                self.host = host
                await self._settle_manifest()
                try:
                    await self._run_services(identity, token, on_started)
                except* SwarmdError as group:  # a task's typed failure: its message, no trace
                    raise group.exceptions[0] from None
        if self.budget is not None:
            log.info("stopped %.1f s after the stop request", self._since_stop())

    async def _settle_manifest(self) -> None:
        """Run the swarm's manifest (``swarmd.manifest.join``): a joiner takes the settings it
        did not set itself from its bootstrap peers, or stops naming each one that differs."""
        import dataclasses

        from swarmd.manifest.join import settle_config
        from swarmd.node.host_options import codec_spec

        settled = await settle_config(self.host, self.config, self.options.home,
                                      self._bootstrap(), counters=self.manifest_counters)
        if settled.config is not self.config:
            self.config = settled.config
            self._device, self._dtype = torch_placement_of(self.config)
            await asyncio.to_thread(model_hash_of, self.config)  # the adopted model builds
            self.host.options = dataclasses.replace(self.host.options,
                                                    codec=codec_spec(self.config))
        self.manifest = settled
        log.info("swarm %s, manifest %s (%s): %s", self.config.swarm.name,
                 settled.manifest.hash, settled.source, settled.manifest.model_text())

    def _bootstrap(self) -> tuple[str, ...]:
        return tuple(self.options.bootstrap or self.config.network.bootstrap)

    async def _run_services(self, identity: Any, token: str,
                            on_started: Callable[[Started], None] | None) -> None:
        from swarmd.api.server import HttpApi
        from swarmd.averaging.allreduce import Averager, protocol_id
        from swarmd.manifest.service import ManifestServer
        from swarmd.membership.service import MembershipService
        from swarmd.node.interfaces import interface_ips
        from swarmd.node.nat import NatService
        from swarmd.pipeline.model_info import serve_model_info
        from swarmd.state.offer import serve_offers

        http, home = self.config.http, self.options.home
        membership = MembershipService(self.host, identity, self.config, self._local,
                                       manifest=swarm_manifest(self.config).hash,
                                       interfaces=interface_ips, clock=self._clock)
        averager = Averager(self.host, protocol_id(self.config.swarm.name),
                            addrs_of=self._addrs_of, clock=self._clock)
        nat = NatService(self.host, membership, self.config)
        serve_model_info(self.host, self.config.swarm.name, self.config.swarm.model,
                         model_fingerprint_of(self.config))
        ManifestServer(self.host, self.manifest.manifest, self.manifest.tokenizer,
                       membership.latest_announcement, self.manifest_counters).start()
        serve_offers(self.host, self.config.swarm.name,
                     lambda peer, offer: self.keeper.offered(peer, offer) if self.keeper else None)
        if self.stage is None and not self._bootstrapping():
            # a first peer has nobody to ask: placed before membership's first announcement,
            # which then names the stage (a peer joining through it at once counts it there)
            await self._choose_stage(self.swarm())
        async with membership, averager, nat, HttpApi(
                self, listen=self.options.http_listen or http.listen, token=token,
                allow_non_loopback=http.allow_non_loopback) as api:
            self.membership, self.averager, self.nat = membership, averager, nat
            write_api_file(home, api.url)
            try:
                async with asyncio.TaskGroup() as tasks:
                    await self._serve_until_stopped(tasks, api.url, on_started)
            except* _Stopping:
                pass
            finally:
                try:  # `swarmd stop` waits for the api file to go: after the checkpoint
                    await self._stop_serving()
                finally:
                    remove_api_file(home, api.url)

    async def _serve_until_stopped(self, tasks: asyncio.TaskGroup, http_url: str,
                                   on_started: Callable[[Started], None] | None) -> None:
        """Place and sync (before saying we are up), go online, wait for the stop, leave."""
        tasks.create_task(keep_connected(self.host, self._bootstrap(), self._rng))
        stopping = tasks.create_task(self._stop.wait())
        serving = tasks.create_task(
            self._serve_stage() if self.stage is not None else self._place())
        await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():  # stopped while still syncing
            serving.cancel()
        else:
            serving.result()  # a failure to load ends the daemon
        if not self._stop.is_set():
            await self._go_online(tasks, http_url, on_started)
        await stopping
        await self._leave()
        raise _Stopping()

    async def _leave(self) -> None:
        from swarmd.node.stopping import leave_stage

        assert self.budget is not None
        self._enter(PeerState.LEAVING)
        await leave_stage(server=self.stage_server, membership=self.membership,
                          budget=self.budget, hurry=self._hurry, stage=self.stage)

    @property
    def state(self) -> str:
        """The lifecycle state's name, as announced and shown by the API."""
        return self.peer_state.value

    def _enter(self, new: PeerState, *, unless_leaving: bool = False) -> bool:
        """Move to ``new`` (``swarmd.peer_states.transition``: an illegal move raises). With
        ``unless_leaving``, a peer already leaving stays so (a stop asked meanwhile wins) and
        False is returned."""
        if unless_leaving and self.peer_state is PeerState.LEAVING:
            log.debug("stays leaving rather than going %s (a stop was asked)", new.value)
            return False
        self.peer_state = transition(self.peer_state, new)
        return True

    def _since_stop(self) -> float:
        return self._clock() - self.budget.started_at if self.budget is not None else 0.0

    async def _go_online(self, tasks: asyncio.TaskGroup, http_url: str,
                         on_started: Callable[[Started], None] | None) -> None:
        if not self._enter(PeerState.ONLINE, unless_leaving=True):
            return
        self.membership.changed()  # announce "online" now
        if self.config.balancing.enabled:
            tasks.create_task(self._balance())
        # Up once the swarm can see the stage: announcements are at least min_gap_s apart, so
        # one naming the stage may still be due. A peer placed with --stage auto through this
        # one meanwhile would find it on no stage, and could pick the same one.
        if not await self.membership.announced(self.stage, ANNOUNCED_WAIT_S):
            log.warning("stage %s not announced within %.0f s: saying started anyway",
                        self.stage, ANNOUNCED_WAIT_S)
        if on_started is not None:
            on_started(Started(peer_id=self.host.peer_id, addrs=tuple(self.host.addrs),
                               http_url=http_url))

    def _addrs_of(self, peer: str) -> tuple[str, ...]:
        ann = self.membership.view.get(peer) if self.membership is not None else None
        return tuple(ann.addrs) if ann is not None else ()

    def _local(self) -> Any:
        """This peer as membership announces it."""
        from swarmd.membership.service import LocalState

        server = self.stage_server
        if server is None:
            # between its old server and its new one a moving peer announces the speed it
            # measured, as its new server will: 0 would show its new stage still short of
            # peers and make others follow it (a new peer has measured nothing: 0)
            moving = self.peer_state in (PeerState.MIGRATING, PeerState.SYNCING)
            return LocalState(self.stage, self.state,
                              self._moving_throughput if moving else 0.0)
        throughput = announced_throughput(self.config, server, self.host, self._upload_left)
        return LocalState(self.stage, self.state, throughput, server.queue, server.step)

    async def _serve_stage(self) -> None:
        """Serve ``self.stage``: take the newest state (checkpoint or peers), then forward,
        backward, averaging and state transfer over libp2p."""
        from swarmd.node.stage_setup import build_keeper, build_server

        c = self.config
        seam, _ = model_seam_of(c)
        stage = self.stage
        assert stage is not None
        if not self._enter(PeerState.SYNCING, unless_leaving=True):
            return  # a stop came while migrating: nothing new is loaded
        self.membership.changed()
        await self._wait_for_view()  # a peer of the stage must be known before we decide
        self._spawn(self._warn_other_models())
        module = await asyncio.to_thread(  # seconds for a big model: not on the event loop
            lambda: seam.build_stage(stage, c.swarm.stages, seed=c.training.seed,
                                     device=self._device, dtype=self._dtype,
                                     weights=seam.own_weights()))
        server = build_server(c, self.host, stage=stage, seam=seam, module=module,
                              device=self._device, dtype=self._dtype,
                              membership=self.membership, averager=self.averager,
                              keeper=lambda: self.keeper, addrs_of=self._addrs_of,
                              trainers=self.trainers)
        keeper = build_keeper(c, self.host, server, home=self.options.home,
                              membership=self.membership, stage=stage,
                              bootstrapping=self._bootstrapping())
        server.on_step(lambda: self._spawn(keeper.stepped()))
        # a peer that moved keeps its measured speed: announcing 0 would make the others see
        # its new stage as still short of peers and follow it
        server.throughput = self._throughput_hint
        self.stage_server, self.keeper = server, keeper
        origin = await keeper.load()
        server.start()
        log.info("serving stage %d of %d from step %d (state from %s)", stage, c.swarm.stages,
                 server.step, origin)

    async def _stop_serving(self) -> None:
        stopping = self.budget if self._stop.is_set() else None  # else a move between stages
        if self.keeper is not None:
            try:  # saves a checkpoint (by the budget's deadline when stopping)
                await self.keeper.close(stopping.save_until if stopping else None,
                                        self._hurry if stopping else None)
            except Exception as exc:  # a failed save is reported, the stop goes on
                log.error("stage %s: saving the checkpoint on shutdown failed: %s",
                          self.stage, exc)
        if self.stage_server is not None:
            await self.stage_server.close()
        for task in list(self._tasks):
            task.cancel()
        if stopping is not None:
            log.info("stopped serving the stage %.1f s into the stop", self._since_stop())

    def _bootstrapping(self) -> bool:
        """Whether a bootstrap was given (else: a first peer of a new swarm)."""
        return bool(self._bootstrap())

    async def _wait_for_view(self) -> None:
        """Wait for a first view from the swarm, at most ``PLACEMENT_WAIT_S`` once in the
        daemon's life (``--stage auto`` then serving the stage would wait it out twice)."""
        if self._view_waited or not self._bootstrapping():
            return  # a first peer of a new swarm has nobody to ask
        try:
            await asyncio.wait_for(self.membership.has_view.wait(), PLACEMENT_WAIT_S)
        except TimeoutError:
            log.warning("no view from the swarm within %.0f s: going on with what is known",
                        PLACEMENT_WAIT_S)
        self._view_waited = True

    async def _warn_other_models(self) -> None:
        """Say once what differs when the view holds peers of another model (they and this
        peer keep each other out of routing)."""
        from swarmd.pipeline.model_info import explain_mismatch, mismatched_peers

        peers = mismatched_peers(self.membership.swarm_info())
        if peers:
            c = self.config
            reason = await explain_mismatch(self.host, c.swarm.name, c.swarm.model,
                                            model_fingerprint_of(c), peers)
            log.warning("%s; they are kept out of this peer's routing and it out of theirs",
                        reason or f"{len(peers)} peer(s) announce another model hash")

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _place(self) -> None:
        """``--stage auto``: serve the bottleneck stage once the view has been pulled (a first
        peer of a new swarm was placed before it announced: ``_run_services``).

        A first placement only; moving between stages later is the balancer's job."""
        await self._wait_for_view()
        placed, saved = await self._choose_stage(self.membership.swarm_info())
        await self._serve_stage()
        if placed.reason == "needed":
            for stage in saved:
                if stage != self.stage and stage < self.config.swarm.stages:
                    await self._offer_checkpoint(stage)

    async def _choose_stage(self, info: SwarmInfo) -> tuple[Any, list[int]]:
        """Set ``self.stage`` from the view ``info`` (``swarmd.balancing.placement``); the
        placement and the stages this home holds checkpoints of.

        Peers count on the stage they announce whatever their state (joining, syncing or
        migrating there too, as the balancer plans: ``SwarmLoad``), so that peers placed one
        shortly after the other, before the first is routable, see each other."""
        from swarmd.balancing.placement import place
        from swarmd.balancing.policy import SwarmLoad
        from swarmd.state.checkpoint import checkpoint_dir, saved_stages

        by_stage = {s.stage: s for s in info.stages}
        stages = range(self.config.swarm.stages)
        load = SwarmLoad.from_view(self.config.swarm.stages, info)
        fits = await asyncio.to_thread(stages_that_fit, self.config, self._dtype)
        saved = await asyncio.to_thread(saved_stages, checkpoint_dir(self.options.home))
        placed = place(  # none fits: any, refused with the numbers when loaded
            saved, load.planned_totals(), load.planned_counts(), self._rng,
            fits=fits or None, present=[_present(by_stage.get(s)) for s in stages])
        self.stage = placed.stage
        log.info("placed on stage %d (%s)", self.stage, {
            "checkpoint": "its checkpoint's stage", "bottleneck": "the bottleneck",
            "needed": f"no peer serves it; this home's checkpoints are of stages {saved}, "
                      f"which their peers hold"}[placed.reason])
        return placed, list(saved)

    async def _offer_checkpoint(self, stage: int) -> None:
        """Offer this home's checkpoint of ``stage``, which it no longer serves, to that
        stage's peers (``swarmd.state.offer``): one of them may have started without it."""
        from swarmd.state.checkpoint import checkpoint_dir, checkpoint_identity
        from swarmd.state.offer import CheckpointOffer

        directory = checkpoint_dir(self.options.home)
        found = await asyncio.to_thread(checkpoint_identity, directory, stage)
        if found is None or found[1] != model_hash_of(self.config):
            return
        step, model_hash = found
        offer = CheckpointOffer(self.host, swarm=self.config.swarm.name, dir=directory,
                                stage=stage, step=step, model_hash=model_hash,
                                peers=lambda: self.membership.state_sources(stage),
                                counters=self.offer_counters)
        log.info("offering this home's checkpoint of stage %d (step %d) to its peers", stage,
                 step)
        self._spawn(offer.run())

    # ---- rebalancing ----------------------------------------------------------------------
    async def _balance(self) -> None:
        """Check now and then whether this peer should serve another stage (the policy is
        ``swarmd.balancing.policy``: it moves only for a real gain, after confirmations)."""
        from swarmd.balancing.policy import Balancer, BalancingConfig, SwarmLoad

        b = self.config.balancing
        self.balancer = Balancer(self.host.peer_id, BalancingConfig(
            threshold=b.threshold, confirmations=b.confirmations,
            check_period_s=b.check_period_s, confirm_period_s=b.confirm_period_s))
        fits = await asyncio.to_thread(stages_that_fit, self.config, self._dtype)
        while True:
            now = self._clock()
            await asyncio.sleep(max(0.0, self.balancer.next_check_at(now, self._rng) - now))
            if self.peer_state is not PeerState.ONLINE or self.stage_server is None:
                self.balancer.reset()
                continue
            load = SwarmLoad.from_view(self.config.swarm.stages, self.membership.swarm_info())
            target = self.balancer.check(load, self._clock(), fits)
            self.balance_counters["checks"] += 1
            if target is not None and target != self.stage:
                log.info("stage totals as this peer sees them: %s samples/s planned, %s "
                         "peer(s) online or arriving", [round(t) for t in load.planned_totals()],
                         load.planned_counts())
                await self._migrate(target)
                # let the swarm see the move and our speed on the new stage before judging
                # again: a peer that just moved never moves straight back
                self.balancer.reset()
                await asyncio.sleep(b.check_period_s * b.confirmations)

    async def _migrate(self, target: int) -> None:
        """Move to ``target``: announce ``migrating`` (with the new stage, so the others count
        this peer as arriving there), let the work in flight finish, save the old stage's
        state, then load the new stage's state from its peers and serve it."""
        old = self.stage
        log.info("moving from stage %s to stage %d (the bottleneck)", old, target)
        self.balance_counters["migrations"] += 1
        self._enter(PeerState.MIGRATING)
        self.stage = target
        self.membership.changed()
        t0 = self._clock()
        async with contextlib.AsyncExitStack() as rounds_held:
            if self.stage_server is not None:
                self._throughput_hint = self.stage_server.throughput
                self._moving_throughput = announced_throughput(self.config, self.stage_server)
                unfinished = await self.stage_server.retire()
                self.balance_counters["migration_dropped_microbatches"] += unfinished
                await self._out_of_rounds(self.stage_server, rounds_held)
            await self._stop_serving()
        self.stage_server = self.keeper = None
        await self._serve_stage()
        if not self._enter(PeerState.ONLINE, unless_leaving=True):
            return
        self.membership.changed()
        self.last_migration = {"from": old, "to": target, "at": self._clock(),
                               "seconds": self._clock() - t0}
        log.info("moved from stage %s to stage %d in %.1f s", old, target,
                 self.last_migration["seconds"])

    async def _out_of_rounds(self, server: Any, stack: contextlib.AsyncExitStack) -> None:
        """Let the old stage's round in progress end (``MOVE_ROUND_WAIT_S`` at most) and join
        no new one until the stage server is closed (``stack`` holds it so)."""
        try:
            async with asyncio.timeout(MOVE_ROUND_WAIT_S):
                await stack.enter_async_context(server.rounds_held())
        except TimeoutError:
            self.balance_counters["migration_cut_round"] += 1
            log.warning("stage %s: its round did not end within %.0f s: moving anyway (its "
                        "mates repair this peer's part)", server.stage, MOVE_ROUND_WAIT_S)


class _Stopping(Exception):
    """Ends the daemon's task group on a stop request."""


def run_join(options: JoinOptions, on_started: Callable[[Started], None]) -> None:
    """Run a daemon in this process until SIGINT/SIGTERM or ``POST /api/v0/stop``."""
    import uvloop

    from swarmd.node.watchdog import Watchdog

    daemon = Daemon(options)
    watchdog = Watchdog(before_exit=daemon.abandon_save)
    daemon.on_budget = lambda budget: watchdog.arm(budget.hard_until)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, daemon.request_stop)
        await daemon.run(on_started)

    uvloop.run(main())
    # the interpreter's last garbage collection walks every object libp2p and torch left:
    # seconds on a loaded machine, out of the stop's budget; what is left is freed anyway
    gc.freeze()


def _present(row: Any) -> int:
    """Peers of our model announced on a stage (``StageRow``), in any state but leaving."""
    if row is None:
        return 0
    return sum(1 for p in row.peers if p.reason not in _OTHER_SWARM
               and str(getattr(p.state, "value", p.state)) != "leaving")


#: why a peer is of another model or manifest (``swarmd.membership.view``)
_OTHER_SWARM = ("model_hash_mismatch", "manifest_mismatch")
