"""A peer moving between stages announces its measured speed all along the move, not 0: the
others' balancers count it as arriving on its new stage (``SwarmLoad``), and with 0 they would
see that stage still short and follow it. The daemon's ``_migrate`` with fakes around it."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

from swarmd.config import load_config
from swarmd.node.daemon import Daemon, JoinOptions
from swarmd.peer_states import PeerState


class _Server:
    def __init__(self, throughput: float) -> None:
        self.throughput = throughput
        self.queue, self.step, self.counters = 0, 7, {}
        self.seam = NS(width=64, max_seq_len=32)

    async def retire(self) -> int:
        return 0

    def rounds_held(self) -> Any:  # no round in progress: nothing to wait for
        return contextlib.nullcontext()


def test_a_migrating_peer_announces_its_measured_throughput_not_zero(tmp_path: Path) -> None:
    daemon = Daemon(JoinOptions(home=tmp_path, config=load_config(None, {}), stage=0))
    announced: list[Any] = []  # what membership would announce at each change
    daemon.membership = NS(changed=lambda: announced.append(daemon._local()))
    daemon.peer_state, daemon.stage_server = PeerState.ONLINE, _Server(12.5)
    assert daemon._local().throughput == 12.5

    async def stop_serving() -> None:
        announced.append(daemon._local())  # the old server still up: saving its state

    async def serve_stage() -> None:  # as Daemon._serve_stage: syncing, then a new server
        daemon._enter(PeerState.SYNCING)
        daemon.membership.changed()
        await asyncio.sleep(0)  # building the stage's module (seconds, in a thread)
        announced.append(daemon._local())
        daemon.stage_server = _Server(daemon._throughput_hint)

    daemon._stop_serving = stop_serving  # type: ignore[method-assign]
    daemon._serve_stage = serve_stage  # type: ignore[method-assign]
    asyncio.run(daemon._migrate(1))
    assert [(a.stage, a.state) for a in announced] == [
        (1, "migrating"), (1, "migrating"), (1, "syncing"), (1, "syncing"), (1, "online")]
    assert [a.throughput for a in announced] == [12.5] * 5


def test_a_new_peer_announces_zero_until_it_has_measured(tmp_path: Path) -> None:
    daemon = Daemon(JoinOptions(home=tmp_path, config=load_config(None, {}), stage=0))
    daemon._enter(PeerState.SYNCING)
    assert daemon._local().throughput == 0.0
