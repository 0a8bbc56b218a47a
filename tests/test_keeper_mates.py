"""A fresh joiner of a stage waits for the stage's live mate before it decides where its state
comes from (``swarmd.node.stage_setup.mates_expected`` with ``StageKeeper``): while no view has
been pulled, and while the view shows another peer holding the stage's state; a first peer of a
stage decides at once. The view is the real ``View`` fed signed announcements; the downloads are
faked (``_fetch``), nothing goes on the network."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from typing import Any, AsyncIterator

import torch

from swarmd.config import load_config
from swarmd.membership import Announcement, PeerState, View, ViewConfig, encode_signed
from swarmd.membership.service import MembershipService
from swarmd.node.stage_setup import build_keeper
from swarmd.state.encoding import capture
from swarmd.models.registry import model_hash_of

CONFIG = load_config(None, {})
ME, MATE, OTHER = "12D3KooWme", "12D3KooWmate", "12D3KooWother"


def _sign(pid: str) -> Any:
    return lambda message: hmac.new(pid.encode(), message, hashlib.sha256).digest()


def _verify(pid: str, message: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(_sign(pid)(message), signature)


class _Host:
    peer_id = ME


class _Membership:
    """What the keeper reads of ``MembershipService``, over a real view (its own methods)."""

    state_sources = MembershipService.state_sources
    stage_has_state = MembershipService.stage_has_state
    _others_of = MembershipService._others_of

    def __init__(self) -> None:
        self.host = _Host()
        self._wall = time.time
        self.view = View(ViewConfig(stages=CONFIG.swarm.stages, model_hash=model_hash_of(CONFIG)),
                         _verify)
        self.has_view = asyncio.Event()

    def announce(self, pid: str, *, stage: int, state: PeerState, step: int = 0) -> None:
        now = time.time()
        ann = Announcement(peer_id=pid, addrs=("/ip4/127.0.0.1/tcp/1",), stage=stage,
                           state=state, throughput=1.0, queue=0, version="0",
                           model_hash=model_hash_of(CONFIG), timestamp=now, period=60.0, step=step)
        assert self.view.apply(encode_signed(ann, _sign(pid)), now).outcome in ("added",
                                                                                 "updated")


class _Server:
    stage = 1
    module = torch.nn.Linear(4, 4)
    step = 0

    async def when_drained(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def took_state(self, step: int) -> None:
        self.step = step


class _Quiet:
    def start(self) -> None:
        return None

    async def replay(self, peers: Any) -> None:
        return None


def _keeper(membership: _Membership, *, bootstrapping: bool = True,
            wait_s: float = 60.0) -> Any:
    keeper = build_keeper(CONFIG, _Host(), _Server(), home=None, membership=membership,
                          stage=1, bootstrapping=bootstrapping)
    keeper.mates_wait_s = wait_s  # long: a wait that is not cut short fails the test's bound
    keeper.announced_steps = None
    keeper._serving = keeper._replayer = _Quiet()
    keeper._restore = lambda state: None
    keeper.asked = []
    module = torch.nn.Linear(4, 4)
    state = capture(module, torch.optim.AdamW(module.parameters()), stage=1, step=6,
                    model_hash=model_hash_of(CONFIG))

    async def fetch(peers: Any, *, newer_than: Any) -> Any:
        keeper.asked.append([p for p, _ in peers])
        return state

    keeper._fetch = fetch
    return keeper


def _run(scenario: Any) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_joiner_waits_for_its_first_view_then_downloads_from_the_mate_it_names() -> None:
    async def scenario() -> None:
        membership = _Membership()  # nothing pulled yet: the mate is not known
        keeper = _keeper(membership)

        async def pulled() -> None:
            await asyncio.sleep(0.5)
            membership.announce(MATE, stage=1, state=PeerState.ONLINE, step=6)
            membership.has_view.set()

        later = asyncio.create_task(pulled())
        assert await keeper.load() == "peers"
        await later
        assert keeper.asked == [[MATE]] and keeper.server.step == 6
        assert keeper.counters["waited_for_mates"] == 1

    _run(scenario)


def test_a_joiner_waits_for_a_mate_the_view_shows_loaded_but_not_yet_online() -> None:
    async def scenario() -> None:
        membership = _Membership()
        membership.announce(MATE, stage=1, state=PeerState.SYNCING, step=6)
        membership.has_view.set()
        keeper = _keeper(membership)

        async def online() -> None:
            await asyncio.sleep(0.5)
            membership.announce(MATE, stage=1, state=PeerState.ONLINE, step=6)

        later = asyncio.create_task(online())
        assert await keeper.load() == "peers"
        await later
        assert keeper.asked == [[MATE]]

    _run(scenario)


def test_a_first_peer_of_a_stage_decides_at_once() -> None:
    async def scenario() -> None:
        membership = _Membership()  # the view shows stage 0 served, a fresh mate at step 0
        membership.announce(OTHER, stage=0, state=PeerState.ONLINE, step=9)
        membership.announce(MATE, stage=1, state=PeerState.SYNCING)
        membership.has_view.set()
        keeper = _keeper(membership, wait_s=600.0)
        assert await keeper.load() == "initial"
        assert keeper.asked == [] and "waited_for_mates" not in keeper.counters
        alone = _keeper(_Membership(), bootstrapping=False, wait_s=600.0)  # a new swarm
        assert await alone.load() == "initial" and "waited_for_mates" not in alone.counters

    _run(scenario)


def test_a_wait_for_the_first_view_ends_when_it_shows_nobody_on_the_stage() -> None:
    async def scenario() -> None:
        membership = _Membership()
        keeper = _keeper(membership, wait_s=600.0)

        async def pulled() -> None:
            await asyncio.sleep(0.5)
            membership.announce(OTHER, stage=0, state=PeerState.ONLINE, step=9)
            membership.has_view.set()

        later = asyncio.create_task(pulled())
        assert await keeper.load() == "initial"  # long before the 600 s wait
        await later
        assert keeper.asked == [] and keeper.counters["waited_for_mates"] == 1

    _run(scenario)


class _Replaying:
    """A replayer whose mates keep the gradients up to ``stage_at`` (None: nobody keeps
    them): a replay brings the server there."""

    enabled = True

    def __init__(self, server: Any) -> None:
        self.server, self.stage_at, self.calls = server, None, 0

    async def replay(self, peers: Any) -> int:
        self.calls += 1
        if self.stage_at is None or self.stage_at <= self.server.step:
            return 0
        done, self.server.step = self.stage_at - self.server.step, self.stage_at
        return done

    def caught_up(self) -> bool:
        return self.stage_at is not None and self.server.step >= self.stage_at


def test_a_peer_behind_again_within_the_gap_replays_the_new_steps_but_never_downloads() -> None:
    """A stage that steps faster than ``CATCH_UP_GAP_S`` left a mate that had just caught up
    a step behind at every round, for good (the gap ignored what each round told it): a
    replay is cheap and runs at once; only a download waits the gap."""
    async def scenario() -> None:
        membership = _Membership()
        membership.announce(MATE, stage=1, state=PeerState.ONLINE, step=6)
        membership.has_view.set()
        keeper = _keeper(membership)
        assert await keeper.load() == "peers" and keeper.server.step == 6
        server = keeper.server
        server.gate = type("Gate", (), {"catching_up": False})()

        @contextlib.asynccontextmanager
        async def held() -> AsyncIterator[None]:
            yield

        server.rounds_held = held
        keeper._replayer = replayer = _Replaying(server)
        keeper._clock = lambda: 1000.0  # the gap never passes

        async def behind(step: int) -> None:
            keeper.behind(MATE, step)
            if keeper._catching_up is not None:
                await keeper._catching_up

        replayer.stage_at = 8
        await behind(8)  # the first catch-up: a replay does it, no download
        replayer.stage_at = 9
        await behind(9)  # told again at once (the stage stepped on): replayed at once
        assert server.step == 9 and replayer.calls == 2 and not server.gate.catching_up
        replayer.stage_at = None
        await behind(12)  # nobody keeps the gradients: a download, but not within the gap
        assert keeper.asked == [[MATE]] and server.step == 9 and replayer.calls == 3
        assert keeper.counters["caught_up_by_replay"] == 2

    _run(scenario)
