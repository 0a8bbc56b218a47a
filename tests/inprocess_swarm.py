"""The in-process two-stage swarm of the pipeline tests: three libp2p hosts on 127.0.0.1 in
this process (Noise + yamux, no transport mocked), a stage server on each of the first two
(one peer per stage, listed in a fixed view) and a trainer on the third. Each stage server has
an averager, as a daemon's does, so stage mates (``stage1_peers``) average their steps."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from swarmd.averaging.allreduce import Averager, protocol_id
from swarmd.pipeline.server import StageServer
from swarmd.trainer.trainer import Trainer
from transport import identity
from transport.codecs import CodecSpec
from transport.host import Host, HostOptions


@contextlib.asynccontextmanager
async def two_stage_swarm(model_config: Any, *, target_batch_size: int, swarm: str,
                          codec: CodecSpec | None = None, model_hash: str | None = None,
                          lr: float = 1e-3, view: dict[int, dict[str, Any]] | None = None,
                          stage1_peers: int = 1, **common: Any
                          ) -> AsyncIterator[tuple[list[StageServer], Trainer]]:
    """``(servers, trainer)``, started; each stage steps once it holds ``target_batch_size``
    samples. ``common`` goes to the servers and the trainer alike (``optim``, ``dtype``...).
    ``view``: a dict the fixed view is written into, which every peer reads live (a test
    lists another host at a stage in it: {stage: {peer id: (throughput, queue, addrs)}}).
    ``stage1_peers``: peers serving stage 1 (mates, averaging their steps), after stage 0's in
    ``servers``. Everything is closed on the way out."""
    codec = codec or CodecSpec(name="none")
    hosts = [Host(identity.generate(), HostOptions(pubsub=None, codec=codec))
             for _ in range(2 + stage1_peers)]
    for h in hosts:
        await h.start()
    servers: list[StageServer] = []
    trainer: Trainer | None = None
    stack = contextlib.AsyncExitStack()
    try:
        s0, *s1, t = hosts
        table = view if view is not None else {}
        table.update({0: {s0.peer_id: (1.0, 0, tuple(s0.addrs))},
                      1: {h.peer_id: (1.0, 0, tuple(h.addrs)) for h in s1}})
        shared = dict(swarm=swarm, num_stages=2, model_config=model_config,
                      model_hash=model_hash or model_config.model_hash(), codec=codec, lr=lr,
                      seed=0, peers_of=lambda s: table.get(s, {}), **common)
        # the trainer's signed announcement, as membership would give it to the last stage
        announced = {t.peer_id: tuple(t.addrs)}
        listed = {h.peer_id: tuple(h.addrs) for h in hosts}
        for i, h in [(0, s0), *((1, h) for h in s1)]:
            averager = await stack.enter_async_context(
                Averager(h, protocol_id(swarm), addrs_of=lambda p: listed.get(p, ())))
            servers.append(StageServer(h, stage=i, max_tokens=4096,
                                       target_batch_size=target_batch_size, averager=averager,
                                       addrs_of=lambda p: announced.get(p, ()), **shared))
        for s in servers:
            s.start()
        trainer = Trainer(t, **shared)
        trainer.start()
        yield servers, trainer
    finally:
        for s in servers:
            await s.close()
        if trainer is not None:
            trainer.close()
        await stack.aclose()
        for h in hosts:
            await h.close()
