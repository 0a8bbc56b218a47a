"""Membership between real ``swarmd join`` processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import uvloop

from daemon_harness import DaemonProcess, start_swarm, stop_all, wait_until
from swarmd.config import load_config
from swarmd.membership import Announcement, PeerState, encode_signed
from transport import identity
from transport.frames import Message
from transport.host import Host, HostOptions
from transport.signing import signer
from swarmd.models.registry import model_hash_of

pytestmark = pytest.mark.integration

SWARM = "swarmd-default"
MODEL = model_hash_of(load_config(None, env={}))
PUSH = f"/swarmd/{SWARM}/1/announce"


def view_ids(d: DaemonProcess) -> set[str]:
    info = d.get("/api/v0/swarm")
    rows = [p for s in info["stages"] for p in s["peers"]] + info["excluded"]
    return {p["peer_id"] for p in rows}


@pytest.fixture
def swarm(tmp_path: Path) -> Any:
    daemons: list[DaemonProcess] = []

    def start(n: int) -> list[DaemonProcess]:  # stage 0 starts the swarm, the rest are auto
        return start_swarm(tmp_path, [0, *[None] * (n - 1)], into=daemons)

    yield start
    stop_all(daemons)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One swarm of four daemons (stage 0, then three ``auto``) for this module: the tests that
    only read it come first, the one that stops two of them last (pytest keeps file order)."""
    daemons: list[DaemonProcess] = []
    try:
        yield start_swarm(tmp_path_factory.mktemp("four"), [0, None, None, None],
                          into=daemons)
    finally:
        stop_all(daemons)


def test_daemons_agree_on_the_full_view_and_spread_over_stages(four: Any) -> None:
    daemons = four
    everyone = {d.peer_id for d in daemons}
    wait_until(lambda: all(view_ids(d) == everyone for d in daemons), 30,
               "every daemon listing all four")
    stages = {d.get("/api/v0/status")["stage"] for d in daemons}
    assert stages == {0, 1}  # auto placement filled the empty stage
    assert all(d.get("/api/v0/swarm")["peers_total"] == 4 for d in daemons)


def test_a_daemon_paused_past_its_expiry_comes_back_into_every_view(four: Any) -> None:
    """A peer the others expired while it was paused (SIGSTOP: a suspended laptop, a long GC)
    refreshes without a state change, so nothing pushes it: the others must pull it again."""
    daemons = four
    everyone = {d.peer_id for d in daemons}
    wait_until(lambda: all(view_ids(d) == everyone for d in daemons), 30, "a full view")
    paused, rest = daemons[3], daemons[:3]
    paused.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: all(paused.peer_id not in view_ids(d) for d in rest), 30,
                   "the paused daemon expiring from the others' views")
    finally:
        paused.signal(signal.SIGCONT)
    wait_until(lambda: all(view_ids(d) == everyone for d in daemons), 30,
               "the resumed daemon back in every view")


def test_graceful_stop_and_sigkill_both_leave_every_view(four: Any) -> None:
    daemons = four
    assert all(d.proc.poll() is None for d in daemons)  # the module's swarm, still whole
    everyone = {d.peer_id for d in daemons}
    wait_until(lambda: all(view_ids(d) == everyone for d in daemons), 30, "a full view")
    stopped, killed, rest = daemons[1], daemons[2], [daemons[0], daemons[3]]
    stopped.signal(signal.SIGTERM)
    assert stopped.wait(10) == 0
    # leaving is pushed: gone from the views long before any expiry
    wait_until(lambda: all(stopped.peer_id not in view_ids(d) for d in rest), 5,
               "the stopped daemon leaving every view")
    killed.proc.kill()
    killed.wait(10)
    t0 = time.monotonic()
    # small swarms announce every ~2-3 s; expiry is 3 periods
    wait_until(lambda: all(killed.peer_id not in view_ids(d) for d in rest), 20,
               "the killed daemon leaving every view")
    assert time.monotonic() - t0 < 20
    assert all(view_ids(d) == {daemons[0].peer_id, daemons[3].peer_id} for d in rest)


def _announcement(ident: Any, **fields: Any) -> Announcement:
    base: dict[str, Any] = dict(peer_id=ident.peer_id, addrs=(), stage=0,
                                state=PeerState.ONLINE, throughput=1.0, queue=0,
                                version="test", model_hash=MODEL, timestamp=time.time(),
                                period=30.0)
    base.update(fields)
    return Announcement(**base)


def test_bad_announcements_are_dropped_counted_or_kept_out_of_routing(swarm: Any) -> None:
    (daemon,) = swarm(1)
    honest, liar, other_stage, other_model = (identity.generate() for _ in range(4))
    forged = encode_signed(_announcement(honest), signer(liar))  # claims honest, signed by liar
    cases = {
        "forged": forged,
        "malformed": b"\x93garbage",
        "unknown_stage": encode_signed(_announcement(other_stage, stage=99), signer(other_stage)),
        "model_hash_mismatch": encode_signed(_announcement(other_model, model_hash="other"),
                                             signer(other_model)),
    }

    async def push_all() -> dict[str, str]:
        async with Host(identity.generate(), HostOptions(pubsub=None)) as host:
            await host.dial(daemon.addr)
            out = {}
            for name, data in cases.items():
                reply = await host.request(daemon.peer_id, PUSH,
                                           Message(kind="announce", meta={"a": data}))
                out[name] = reply.meta["outcome"]
            return out

    outcomes = uvloop.run(asyncio.wait_for(push_all(), 60))
    assert outcomes["forged"] == "dropped" and outcomes["malformed"] == "dropped"
    assert outcomes["unknown_stage"] == "added" and outcomes["model_hash_mismatch"] == "added"
    counters = daemon.get("/api/v0/status")["counters"]
    assert counters.get("membership_dropped.forged") == 1
    assert counters.get("membership_dropped.malformed") == 1
    info = daemon.get("/api/v0/swarm")
    excluded = {p["peer_id"]: p["reason"] for p in info["excluded"]}
    routed = {p["peer_id"]: p for s in info["stages"] for p in s["peers"]}
    assert excluded.get(other_stage.peer_id) == "unknown_stage"
    reason = excluded.get(other_model.peer_id) or routed[other_model.peer_id]["reason"]
    assert reason == "model_hash_mismatch"
    assert honest.peer_id not in excluded and honest.peer_id not in routed  # never listed
    assert daemon.get("/api/v0/status")["state"] == "online"


def test_different_swarms_never_mix(swarm: Any, tmp_path: Path) -> None:
    (a,) = swarm(1)
    b = DaemonProcess(tmp_path / "other", "--bootstrap", a.addr, "--stage", "0",
                      env={"SWARMD_SWARM_NAME": "another-swarm"})
    try:
        # a's manifest names its swarm: a daemon of another one refuses to join it at all
        assert b.wait(60) == 2
        assert "swarm.name = 'another-swarm' here, 'swarmd-default' in the swarm" in b.stderr()
        assert view_ids(a) == {a.peer_id}
    finally:
        b.stop()


def test_a_daemon_is_on_its_stage_in_its_view_once_started_and_the_next_goes_elsewhere(
        tmp_path: Path) -> None:
    """``--stage auto`` places a peer from the view it pulls from its bootstrap peers. A daemon
    that said it started must already be on its stage there (its announcements are at least
    ``min_gap_s`` apart: the one naming its stage may still be due), or a peer placed through
    it at that moment counts it on no stage and may pick the same one; the other stage then
    stays empty and nothing trains."""
    daemons: list[DaemonProcess] = []

    def on_its_stage(d: DaemonProcess) -> int:
        stage = d.get("/api/v0/status")["stage"]
        rows = {s["stage"]: {p["peer_id"] for p in s["peers"]}
                for s in d.get("/api/v0/swarm")["stages"]}
        assert d.peer_id in rows[stage], d.get("/api/v0/swarm")
        return stage

    try:
        first = DaemonProcess(tmp_path / "first")  # --stage auto, a new swarm
        daemons.append(first)
        first.wait_started()
        placed = [on_its_stage(first)]  # at once: no waiting for an announcement here
        second = DaemonProcess(tmp_path / "second", "--bootstrap", first.addr)
        daemons.append(second)
        second.wait_started()
        placed.append(on_its_stage(second))
        assert sorted(placed) == [0, 1], second.stderr()[-2000:]
    finally:
        stop_all(daemons)
