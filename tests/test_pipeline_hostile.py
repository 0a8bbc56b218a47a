"""Hostile peers on our own transport (``transport.host.Host`` and real ``Message`` frames over
real libp2p) against a real ``swarmd join`` daemon and against the trainer: every bad message
gets a typed error or is handled as backpressure, nothing crashes, work goes on, and nobody is
dialed at an address it did not announce."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import pytest
import torch
import uvloop

from swarmd.config import load_config
from swarmd.errors import StageBusy
from swarmd.local.demo import DEMO_ENV
from swarmd.pipeline.handlers import TRAINER_WAIT_S
from swarmd.pipeline.server import StageServer
from swarmd.trainer.trainer import Trainer
from swarmd.protocols import Protocols
from swarmd.models.gpt import ModelConfig
from transport import identity
from transport.codecs import CodecSpec
from transport.errors import RemoteError
from transport.frames import Message
from transport.host import Host, HostOptions
from swarmd.models.registry import model_config_of, model_hash_of

pytestmark = pytest.mark.integration

ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "hostile-test"}
CONFIG = ModelConfig(width=32, heads=2, layers=2, seq_len=16)
SWARM = "hostile-inproc"
PROTO = Protocols(SWARM).pipeline()
OPTS = HostOptions(pubsub=None, codec=CodecSpec(name="none"))


async def _code(call: Any) -> str:
    try:
        await call
    except RemoteError as exc:
        return exc.code
    return "ok"


# ---- a real daemon of the last stage, fed by a hostile stage-0 peer -------------------------
def test_a_daemon_refuses_bad_forwards_and_backwards_and_dials_no_unannounced_trainer(
        daemons: Any) -> None:
    (d1,) = daemons(1)  # the last of two stages; stage 0 is the hostile peer below
    config = load_config(None, {**os.environ, **ENV})
    width, model = model_config_of(config).width, model_hash_of(config)
    proto = Protocols(config.swarm.name).pipeline()

    async def scenario() -> None:
        x_host, t_host, y_host = (Host(identity.generate(), HostOptions(pubsub=None))
                                  for _ in range(3))
        async with x_host as x, t_host as t, y_host as y:
            results: list[Message] = []
            backwards: list[str] = []

            async def on_result(message: Message, peer: str) -> Message:
                results.append(message)
                return Message(kind="ok")

            async def on_backward(message: Message, peer: str) -> Message:
                backwards.append(peer)
                return Message(kind="ok")

            t.set_request_handler(proto["result"], on_result)
            x.set_request_handler(proto["backward"], on_backward)
            await x.dial(d1.addr)
            await t.dial(d1.addr)  # the trainer is connected: no dial is needed to reach it

            def fwd(mb: str, **over: Any) -> Any:
                meta = {"mb": mb, "stage": 1, "step": 0, "path": [x.peer_id],
                        "trainer": t.peer_id, "model": model, **over}
                return x.request(d1.peer_id, proto["forward"], Message(
                    kind="forward", meta=meta, tensors=(torch.randn(2, 8, width),)), timeout=60)

            # unknown keys and 10,000 trainer addresses: dropped, the rest served
            junk = {"evil": "x" * 1000, "trainer_addrs": ["/x"] * 10_000, "eval": False}
            assert await _code(fwd("h/1", **junk)) == "ok"
            (result,) = results
            assert set(result.meta) == {"mb", "path"}
            assert result.meta["path"] == [x.peer_id, d1.peer_id]
            assert tuple(result.tensors[0].shape) == (2, 8, width)
            assert await _code(fwd("h/2", path=x.peer_id)) == "bad_activation"
            assert await _code(fwd("h/3", path=[5])) == "bad_activation"
            assert await _code(fwd("h/4", path=[t.peer_id])) == "not_on_path"
            # a trainer that announced nothing, with its real addresses in the message: never
            # dialed; after a short wait the sender learns the trainer is unreachable
            t0 = time.monotonic()
            assert await _code(fwd("h/5", trainer=y.peer_id,
                                   trainer_addrs=list(y.addrs))) == "trainer_unreachable"
            assert time.monotonic() - t0 >= TRAINER_WAIT_S * 0.9
            assert d1.peer_id not in await y.connected_peers()
            assert y.counters.snapshot().get("streams_accepted", 0) == 0

            def bwd(sender: Host, mb: str, grad: torch.Tensor, **over: Any) -> Any:
                meta = {"mb": mb, "stage": 1, "step": 0, "path": [x.peer_id, d1.peer_id],
                        "trainer": t.peer_id, "model": model, **over}
                return sender.request(d1.peer_id, proto["backward"], Message(
                    kind="backward", meta=meta, tensors=(grad,)), timeout=60)

            good = torch.randn(2, 8, width)
            # only the trainer the result went to may send the backward
            assert await _code(bwd(x, "h/1", good)) == "not_on_path"
            assert await _code(bwd(t, "h/1", torch.randn(2, 9, width))) == "bad_activation"
            assert await _code(bwd(t, "h/1", good.double()[..., :width - 1])) == "bad_activation"
            assert await _code(bwd(t, "h/2", good)) == "unknown_microbatch"
            assert backwards == []
            # only its trainer may give a microbatch up; a malformed abandon is refused
            def abandon(sender: Host, mb: Any) -> Any:
                return sender.request(d1.peer_id, proto["abandon"], Message(
                    kind="abandon", meta={"mb": mb}), timeout=60)

            assert await _code(abandon(x, "h/1")) == "not_on_path"
            assert await _code(abandon(t, 7)) == "bad_activation"
            assert await _code(bwd(t, "h/1", good)) == "ok"  # h/1 was kept through all that
            assert backwards == [d1.peer_id]  # it went on to x, the peer the forward came from
            # given up by its trainer: dropped at once, its backward has nothing to run on
            assert await _code(fwd("h/6")) == "ok"
            assert (await abandon(t, "h/6")).meta == {"held": True}
            assert await _code(bwd(t, "h/6", good)) == "unknown_microbatch"
            assert (await abandon(t, "h/6")).meta == {"held": False}  # again: nothing to drop

    uvloop.run(asyncio.wait_for(scenario(), 120))
    status = d1.get("/api/v0/status")
    assert status["state"] == "online"
    counters = status["counters"]
    assert counters.get("request_errors.not_on_path", 0) >= 2
    assert counters.get("stage.refused.path", 0) >= 2
    assert counters.get("stage.trainer_unannounced", 0) == 1
    assert counters.get("stage.refused.abandon_sender", 0) == 1
    assert counters.get("stage.abandoned", 0) == 1


# ---- the trainer against a hostile stage peer (in this process, real libp2p) ----------------
def test_the_trainer_accepts_results_and_grads_only_from_the_path_with_their_shape() -> None:
    async def scenario() -> dict[str, Any]:
        hosts = [Host(identity.generate(), OPTS) for _ in range(3)]
        async with hosts[0] as h, hosts[1] as other, hosts[2] as t_host:
            table = {0: {h.peer_id: (1.0, 0, tuple(h.addrs))}}
            trainer = Trainer(t_host, swarm=SWARM, num_stages=1, model_config=CONFIG,
                              model_hash=CONFIG.model_hash(), codec=OPTS.codec, lr=1e-3,
                              seed=0, peers_of=lambda s: table.get(s, {}))
            trainer.start()
            await other.dial(t_host.addrs[0])
            codes: dict[str, list[str]] = {"result": [], "grad": []}
            answered = asyncio.Event()  # the last grad's reply came back to the hostile peer

            async def send(sender: Host, kind: str, meta: dict[str, Any], tensor: Any) -> None:
                codes[kind].append(await _code(sender.request(
                    t_host.peer_id, PROTO[kind], Message(kind=kind, meta=meta,
                                                         tensors=(tensor,)), timeout=30)))

            async def on_forward(message: Message, peer: str) -> Message:
                # the only stage holds the built-in model's embedding: ids in, activations out
                mb, ids = message.meta["mb"], message.tensors[0]
                x = torch.randn(*ids.shape, CONFIG.width)
                good = {"mb": mb, "path": [h.peer_id]}
                await send(h, "result", good, x[:, :-1])                       # shape
                await send(h, "result", good, x.to(torch.int32))               # dtype
                await send(other, "result", good, x)                           # not the last
                await send(other, "result", {"mb": mb, "path": [other.peer_id]}, x)  # not sent to
                await send(h, "result", {"mb": mb, "path": [h.peer_id, "x"]}, x)     # path length
                await send(h, "result", good, x)
                return Message(kind="ok")

            async def on_backward(message: Message, peer: str) -> Message:
                # no gradient goes back to token ids: an empty one (B, T, 0) ends the chain
                mb, g = message.meta["mb"], torch.zeros(*message.tensors[0].shape[:2], 0)
                await send(h, "grad", {"mb": mb}, g[:1])
                await send(other, "grad", {"mb": mb}, g)
                await send(h, "grad", {"mb": mb}, g)
                answered.set()
                return Message(kind="ok")

            h.set_request_handler(PROTO["forward"], on_forward)
            h.set_request_handler(PROTO["backward"], on_backward)
            x = torch.randint(0, 256, (2, 16))
            losses = await trainer.accumulate([(x, x)])
            await answered.wait()
            trainer.close()
            return {"codes": codes, "losses": losses, "stats": trainer.stats,
                    "counters": trainer.counters}

    out = uvloop.run(asyncio.wait_for(scenario(), 60))
    assert out["codes"]["result"] == ["bad_activation", "bad_activation", "not_on_path",
                                      "not_on_path", "bad_activation", "ok"]
    assert out["codes"]["grad"] == ["bad_activation", "not_on_path", "ok"]
    assert out["stats"].lost == 0 and out["stats"].restarted == 0
    assert len(out["losses"]) == 1 and torch.isfinite(torch.tensor(out["losses"])).all()
    assert out["counters"]["refused.shape"] >= 2 and out["counters"]["refused.sender"] >= 3


async def _three_stage_servers(table: dict[int, dict[str, Any]], busy_first: int
                               ) -> tuple[list[Host], list[StageServer]]:
    """Two stage-0 servers that answer busy to their first ``busy_first`` forwards, and one
    stage-1 server, each on its own host, listed in ``table``."""
    hosts = [Host(identity.generate(), OPTS) for _ in range(3)]
    for h in hosts:
        await h.start()
    servers = []
    for h, stage in zip(hosts, (0, 0, 1)):
        table.setdefault(stage, {})[h.peer_id] = (1.0, 0, tuple(h.addrs))
        server = StageServer(h, swarm=SWARM, stage=stage, num_stages=2, model_config=CONFIG,
                             model_hash=CONFIG.model_hash(), codec=OPTS.codec, lr=1e-3,
                             seed=0, peers_of=lambda s: table.get(s, {}), max_tokens=4096,
                             target_batch_size=1000, addrs_of=lambda p: table["t"].get(p, ()))
        server.start()
        if stage == 0 and busy_first:
            real, refused = server.handlers.on_forward, [0]

            async def sometimes_busy(message: Message, peer: str, real: Any = real,
                                     refused: list[int] = refused) -> Message:
                if refused[0] < busy_first:
                    refused[0] += 1
                    raise StageBusy("hostile test: full for a while")
                return await real(message, peer)

            h.set_request_handler(PROTO["forward"], sometimes_busy)
        servers.append(server)
    return hosts, servers


def _started_trainer(t_host: Host, table: dict[Any, dict[str, Any]]) -> Trainer:
    """A trainer of the two-stage in-process swarm on ``t_host``, listed in ``table``."""
    table["t"][t_host.peer_id] = tuple(t_host.addrs)
    trainer = Trainer(t_host, swarm=SWARM, num_stages=2, model_config=CONFIG,
                      model_hash=CONFIG.model_hash(), codec=OPTS.codec, lr=1e-3, seed=0,
                      peers_of=lambda s: table.get(s, {}))
    trainer.start()
    return trainer


async def _one_step_then_close(table: dict[Any, dict[str, Any]], hosts: list[Host],
                               servers: list[StageServer]) -> Trainer:
    """A trainer on a host of its own takes one step of 4 microbatches through the servers
    listed in ``table``; then every server and host is closed. The trainer, for its counters."""
    async with Host(identity.generate(), OPTS) as t_host:
        trainer = _started_trainer(t_host, table)
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randint(0, 256, (2, 16), generator=g),) * 2 for _ in range(4)]
        await trainer.train_step(batches)
        trainer.close()
    for s in servers:
        await s.close()
    for h in hosts:
        await h.close()
    return trainer


def test_busy_from_every_peer_of_a_stage_is_backpressure_and_training_goes_on() -> None:
    async def scenario() -> Any:
        table: dict[Any, dict[str, Any]] = {"t": {}}
        hosts, servers = await _three_stage_servers(table, busy_first=6)
        trainer = await _one_step_then_close(table, hosts, servers)
        return trainer

    trainer = uvloop.run(asyncio.wait_for(scenario(), 120))
    assert trainer.stats.lost == 0 and trainer.stats.microbatches == 4
    assert trainer.counters["hop_busy"] >= 12  # both stage-0 peers were busy for a while
    assert trainer.wiring.banned == 0          # and neither was banned for it
    assert trainer.counters["waited"] >= 1     # all busy at once: waited, did not fail


def test_a_peer_catching_up_with_its_stage_refuses_forwards_with_busy_and_its_mate_serves(
        ) -> None:
    """While a peer takes a newer state of its stage (download, restore, replay:
    ``Gate.catching_up``) a forward's backward would wait seconds behind it: it answers busy
    at once, and the trainer routes to its mate (issue 28: 4 s steps after a thawed peer
    caught up)."""
    async def scenario() -> tuple[Trainer, list[StageServer]]:
        table: dict[Any, dict[str, Any]] = {"t": {}}
        hosts, servers = await _three_stage_servers(table, busy_first=0)
        servers[0].gate.catching_up = True
        # announced 1,000 times faster than its mate: the trainer's first choice
        table[0][hosts[0].peer_id] = (1000.0, 0, tuple(hosts[0].addrs))
        trainer = await _one_step_then_close(table, hosts, servers)
        return trainer, servers

    trainer, servers = uvloop.run(asyncio.wait_for(scenario(), 120))
    catching_up, mate = servers[0].counters, servers[1].counters
    assert catching_up["busy_catching_up"] >= 1 and catching_up["forward"] == 0
    assert mate["forward"] >= 4 and mate.get("busy_catching_up", 0) == 0
    assert trainer.stats.lost == 0 and trainer.stats.microbatches == 4


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_trainer_whose_only_stage_0_peer_is_unreachable_waits_and_routes_on() -> None:
    async def scenario() -> Any:
        table: dict[Any, dict[str, Any]] = {"t": {}}
        hosts, servers = await _three_stage_servers(table, busy_first=0)
        real0 = dict(table[0])
        ghost = identity.generate().peer_id
        table[0] = {ghost: (1.0, 0, (f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{ghost}",))}
        async with Host(identity.generate(), OPTS) as t_host:
            trainer = _started_trainer(t_host, table)
            x = torch.randint(0, 256, (2, 16))
            task = asyncio.ensure_future(trainer.evaluate([(x, x)]))
            deadline = time.monotonic() + 30
            while trainer.wiring.banned == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert trainer.wiring.banned >= 1  # the dial failed and was judged
            assert not task.done()             # waiting, not failed
            table[0] = real0                   # a reachable stage-0 peer appears
            loss = await asyncio.wait_for(task, 60)
            trainer.close()
        for s in servers:
            await s.close()
        for h in hosts:
            await h.close()
        return trainer, loss

    trainer, loss = uvloop.run(asyncio.wait_for(scenario(), 120))
    assert loss > 0 and trainer.stats.lost == 0
    assert trainer.counters["hop_broken"] >= 1

