"""Hostile peers against real ``swarmd join`` processes: the round, all-reduce and state
protocols take only what the sender may send. The hostile peer is a ``transport.host.Host`` in
this process; to be a mate of stage 1 it pushes a validly signed announcement of itself.

Every case: no crash, a typed error reply or a counted drop, and the victim still answers
``/api/v0/status``."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
import torch
import uvloop

from daemon_harness import DaemonProcess, wait_until
from swarmd.averaging.plan import RoundPlan
from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.membership import Announcement, PeerState, encode_signed
from swarmd.protocols import Protocols
from swarmd.state import encoding as ss
from swarmd.state.transfer import StateInfo, chunk_checksum
from swarmd.models.gpt import build_stage
from transport import identity
from transport.errors import RemoteError
from transport.frames import Message, error_message
from transport.host import Host, HostOptions
from transport.signing import signer
from swarmd.models.registry import model_config_of, model_hash_of

pytestmark = pytest.mark.integration

SWARM = "hostile-test"
ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": SWARM,
       "SWARMD_AVERAGING_TIMEOUT_S": "8"}
CONFIG = load_config(None, {**os.environ, **ENV})
PROTO = Protocols(SWARM)
GiB = 1 << 30


def run(scenario: Callable[[], Awaitable[Any]], seconds: float = 150) -> Any:
    return uvloop.run(asyncio.wait_for(scenario(), seconds))


def announcement(ident: Any, addrs: list[str], stage: int = 1) -> bytes:
    ann = Announcement(peer_id=ident.peer_id, addrs=tuple(addrs)[:8], stage=stage,
                       state=PeerState.ONLINE, throughput=1.0, queue=0, version="test",
                       model_hash=model_hash_of(CONFIG), timestamp=time.time(), period=30.0)
    return encode_signed(ann, signer(ident))


async def announce(host: Host, victim: DaemonProcess) -> None:
    """Make ``host`` a stage-1 peer in the victim's view."""
    await host.dial(victim.addr)
    reply = await host.request(victim.peer_id, PROTO.announce, Message(
        kind="announce", meta={"a": announcement(host.identity, host.addrs)}))
    assert reply.meta["outcome"] == "added"


async def refused(host: Host, peer: str, protocol: str, message: Message) -> str:
    try:
        reply = await host.request(peer, protocol, message, timeout=20)
    except RemoteError as exc:
        return exc.code
    return f"accepted:{reply.kind}"


def identities_around(peer_id: str) -> tuple[Any, Any]:
    """One identity whose peer id sorts before ``peer_id`` (it leads a stage of the two) and
    one that sorts after it. (1,000 tries missed about one run in 500: a daemon whose id
    sorts within 1/1,000 of either end; 20,000 miss about one in 10,000, 1.5 ms a try.)"""
    low = high = None
    for _ in range(20_000):
        ident = identity.generate()
        if ident.peer_id < peer_id and low is None:
            low = ident
        elif ident.peer_id > peer_id and high is None:
            high = ident
        if low is not None and high is not None:
            return low, high
    raise AssertionError("no identities on both sides (not reached)")


def counters(d: DaemonProcess) -> dict[str, int]:
    status = d.get("/api/v0/status")
    assert status["state"] == "online"
    return status["counters"]


def gradient_length() -> int:
    stage = build_stage(model_config_of(CONFIG), 1, CONFIG.swarm.stages, CONFIG.training.seed)
    return sum(p.numel() for p in stage.parameters() if p.requires_grad)


# ---- rounds and all-reduce -----------------------------------------------------------------

def test_round_and_all_reduce_messages_only_from_those_who_may_send_them(daemons: Any) -> None:
    _, victim = daemons(0, 1)
    leader_id, follower_id = identities_around(victim.peer_id)
    total = gradient_length()
    start_base = {"stage": 1, "step": 0, "bandwidths": [None, None]}
    codes: dict[str, str] = {}

    async def scenario() -> None:
        opts = HostOptions(pubsub=None)
        async with Host(identity.generate(), opts) as outsider, \
                Host(follower_id, opts) as follower, Host(leader_id, opts) as leader:
            await outsider.dial(victim.addr)
            # an outsider's start would have made stage 1 step with the outsider's gradient
            group = sorted([outsider.peer_id, victim.peer_id])
            codes["outsider_start"] = await refused(outsider, victim.peer_id, PROTO.round,
                                                    Message(kind="start", meta={
                                                        **start_base, "round": "1:0:o",
                                                        "group": group}))

            async def answer_probe(message: Message, peer: str) -> Message:
                return Message(kind="ok", meta={"step": 0})

            leader.set_request_handler(PROTO.round, answer_probe)
            await announce(follower, victim)
            await announce(leader, victim)
            wait = lambda: wait_until(  # noqa: E731
                lambda: all(p in {x["peer_id"] for s in victim.get("/api/v0/swarm")["stages"]
                                  for x in s["peers"]}
                            for p in (leader.peer_id, follower.peer_id)), 30, "mates listed")
            await asyncio.to_thread(wait)
            codes["follower_start"] = await refused(
                follower, victim.peer_id, PROTO.round, Message(kind="start", meta={
                    **start_base, "round": "1:0:f",
                    "group": sorted([follower.peer_id, victim.peer_id])}))
            codes["huge_progress"] = await refused(
                follower, victim.peer_id, PROTO.round,
                Message(kind="progress", meta={"stage": 1, "step": 0, "samples": 10 ** 12}))
            codes["stranger_in_group"] = await refused(
                leader, victim.peer_id, PROTO.round, Message(kind="start", meta={
                    **start_base, "round": "1:0:s",
                    "group": sorted([leader.peer_id, victim.peer_id, outsider.peer_id]),
                    "bandwidths": [None] * 3}))
            # a start is taken only from a mate heard from: the leader answers the victim's
            # probe (its progress, sent to a smaller mate never heard from)
            await asyncio.to_thread(wait_until, lambda: counters(victim).get(
                "sync.probes_answered", 0) >= 1, 30, "the leader's answer to a probe")
            # the leader may start a round: then it, but no one else, contributes parts. It
            # holds the victim's all-reduce requests unanswered: refused at once (no handler),
            # they let a loaded victim finish its own part without the leader's before the
            # NaN part below arrived, which then was never aggregated (nor refused)
            released = asyncio.Event()

            async def hold(message: Message, peer: str) -> Message:
                await released.wait()
                return Message(kind="absent")

            leader.set_request_handler(PROTO.allreduce, hold)
            round_id, group = "1:0:hostile", sorted([leader.peer_id, victim.peer_id])
            codes["leader_start"] = await refused(leader, victim.peer_id, PROTO.round, Message(
                kind="start", meta={**start_base, "round": round_id, "group": group}))
            plan = RoundPlan.build(round_id, group, total)
            mine = [u for u, unit in enumerate(plan.units)
                    if plan.group[unit.owner] == victim.peer_id][0]
            n = plan.units[mine].length

            def contribute(weight: float, tensor: torch.Tensor) -> Message:
                return Message(kind="contribute", meta={
                    "r": round_id, "d": plan.digest, "u": mine, "t": 10.0, "w": weight},
                    tensors=(tensor,))

            codes["non_member_part"] = await refused(outsider, victim.peer_id,
                                                     PROTO.allreduce,
                                                     contribute(1.0, torch.zeros(n)))
            codes["overweight_part"] = await refused(leader, victim.peer_id, PROTO.allreduce,
                                                     contribute(1e12, torch.zeros(n)))
            codes["nan_part"] = await refused(leader, victim.peer_id, PROTO.allreduce,
                                              contribute(1.0, torch.full((n,), float("nan"))))
            released.set()

    run(scenario)
    assert codes["outsider_start"] == "bad_round_message"
    assert codes["follower_start"] == "bad_round_message"
    assert codes["huge_progress"] == "bad_round_message"
    assert codes["stranger_in_group"] == "bad_round_message"
    assert codes["leader_start"] == "accepted:ok"
    assert codes["non_member_part"] == "bad_allreduce_message"
    assert codes["overweight_part"] == "bad_allreduce_message"
    assert codes["nan_part"] == "accepted:part"  # answered, but left out of the average
    c = wait_until(lambda: (lambda c: c if c.get("allreduce.contributions_refused", 0) >= 1
                            else None)(counters(victim)), 30, "the NaN part refused")
    assert c.get("sync.bad_requests.not_a_mate", 0) >= 1
    assert c.get("sync.bad_requests.not_leader", 0) >= 1
    assert c.get("sync.bad_requests.bad_samples", 0) >= 1
    assert c.get("sync.bad_requests.group_not_mates", 0) >= 1
    assert c.get("allreduce.bad_requests.wrong_part", 0) >= 1
    assert c.get("allreduce.bad_requests.bad_weight", 0) >= 1


# ---- state transfer ------------------------------------------------------------------------

def _nan_state() -> bytes:
    stage = build_stage(model_config_of(CONFIG), 1, CONFIG.swarm.stages, CONFIG.training.seed)
    optimizer = torch.optim.AdamW(stage.parameters())
    state = ss.capture(stage, optimizer, stage=1, step=50, model_hash=model_hash_of(CONFIG))
    next(iter(state.params.values())).view(-1)[0] = float("nan")
    return ss.encode(state)


def test_hostile_state_sources_and_unasked_chunks(daemons: Any, tmp_path: Path) -> None:
    (first,) = daemons(0)
    nan_data = _nan_state()
    asked: dict[str, list[str]] = {"huge": [], "nan": []}
    results: dict[str, Any] = {}

    def liar(name: str, host: Host) -> Callable[[Message, str], Awaitable[Message]]:
        if name == "huge":
            offer = StateInfo(peer=host.peer_id, stage=1, step=99,
                              model_hash=model_hash_of(CONFIG), digest="ab" * 32,
                              total_bytes=16 * GiB, chunk_bytes=1 << 24)
        else:
            offer = StateInfo(peer=host.peer_id, stage=1, step=50,
                              model_hash=model_hash_of(CONFIG), digest=ss.digest(nan_data),
                              total_bytes=len(nan_data), chunk_bytes=1 << 20)

        async def serve(message: Message, peer: str) -> Message:
            if message.kind == "state_digest":  # the joiner's idle drift check, not a transfer
                return error_message("unknown_stage", "a liar keeps its digest")
            asked[name].append(message.kind)
            if message.kind == "state_info":
                return Message(kind="state_info", meta=offer.to_meta())
            i = message.meta["index"]
            start, end = offer.chunk_range(i)
            piece = bytearray(nan_data[start:end])
            return Message(kind="state_chunk", meta={"digest": offer.digest, "index": i,
                                                     "checksum": chunk_checksum(piece)},
                           tensors=(torch.frombuffer(piece, dtype=torch.uint8),))
        return serve

    async def scenario() -> None:
        opts = HostOptions(pubsub=None)
        async with Host(identity.generate(), opts) as huge, \
                Host(identity.generate(), opts) as nan:
            for name, host in (("huge", huge), ("nan", nan)):
                host.set_request_handler(PROTO.state, liar(name, host))
                await announce(host, first)
            joiner = DaemonProcess(tmp_path / "joiner", "--stage", "1", "--bootstrap",
                                   first.addr, env=ENV)
            try:
                await asyncio.to_thread(joiner.wait_started)
                results["stage"] = await asyncio.to_thread(joiner.get, "/api/v0/stage")
                results["counters"] = await asyncio.to_thread(counters, joiner)
                # a chunk pushed to the joiner unasked (its state server runs now)
                await nan.dial(joiner.addr)
                results["push"] = await refused(nan, joiner.peer_id, PROTO.state, Message(
                    kind="state_chunk", meta={"stage": 1, "model_hash": model_hash_of(CONFIG),
                                              "digest": "ab" * 32, "index": 0},
                    tensors=(torch.zeros(1024, dtype=torch.uint8),)))
                results["after"] = await asyncio.to_thread(counters, joiner)
            finally:
                await asyncio.to_thread(joiner.stop)

    run(scenario)
    assert asked["huge"] == ["state_info"]  # its 16 GiB claim was refused before any chunk
    assert asked["nan"][0] == "state_info" and "state_chunk" in asked["nan"]
    assert results["stage"]["state_from"] == "initial" and results["stage"]["step"] == 0
    c = results["counters"]
    assert c.get("state.bad_replies", 0) >= 1
    assert c.get("state.non_finite_states", 0) == 1
    assert c.get("state.state_downloads_failed", 0) == 1
    assert results["push"] == "bad_state_request"
    assert results["after"].get("state.served.bad_requests.unsolicited_data", 0) == 1
