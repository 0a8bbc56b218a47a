"""The pipeline protocol end to end over real libp2p (three hosts in this process, so the
stages' gradients can be read): with codec none and one peer per stage, the gradients after one
step through the swarm equal single-process gradients."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import uvloop

from swarmd.models.gpt import FullModel, ModelConfig
from transport import identity
from transport.codecs import CodecSpec
from transport.host import Host, HostOptions

from inprocess_swarm import two_stage_swarm

pytestmark = pytest.mark.integration

CONFIG = ModelConfig(width=32, heads=2, layers=4, seq_len=16)
SWARM = "exact-test"


async def _swarm_grads(batches, codec: CodecSpec):
    # a target above the samples sent: nobody steps, the accumulated gradients stay
    async with two_stage_swarm(CONFIG, target_batch_size=1000, swarm=SWARM,
                               codec=codec) as (servers, trainer):
        losses = await trainer.accumulate(batches)
        samples = sum(int(x.shape[0]) for x, _ in batches)
        grads = {}  # gradients are sums over samples: the mean is what a step applies
        for name, p in trainer.head.named_parameters():
            grads[f"head.{name}"] = p.grad / samples
        for s in servers:
            assert s.worker.samples_accumulated == samples
            for name, p in s.module.named_parameters():  # stage 0 holds the embedding
                grads[name if name.startswith("embedding.")
                      else f"stages.{s.stage}.{name}"] = p.grad / samples
        return losses, grads, trainer.stats


def _reference(batches):
    model = FullModel(CONFIG, num_stages=2, seed=0)
    total = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        (loss / len(batches)).backward()
        total += float(loss.detach())
    return total / len(batches), {n: p.grad for n, p in model.named_parameters()}


def test_one_step_through_the_swarm_equals_single_process() -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 16), generator=g),
                torch.randint(0, 256, (2, 16), generator=g)) for _ in range(3)]
    losses, grads, stats = uvloop.run(asyncio.wait_for(
        _swarm_grads(batches, CodecSpec(name="none")), 120))
    ref_loss, ref = _reference(batches)
    assert sum(losses) / len(losses) == pytest.approx(ref_loss, rel=1e-6)
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    for name, r in ref.items():
        err = float((grads[name] - r).norm() / r.norm())
        assert err <= 1e-5, (name, err)
    assert stats.lost == 0 and stats.restarted == 0 and stats.microbatches == 3


def test_a_full_stage_refuses_new_forwards_with_busy() -> None:
    from swarmd.pipeline import server as stage_server
    from swarmd.errors import StageBusy

    async def scenario() -> None:
        async with Host(identity.generate(), HostOptions(pubsub=None)) as host:
            server = stage_server.StageServer(
                host, swarm=SWARM, stage=1, num_stages=2, model_config=CONFIG,
                model_hash=CONFIG.model_hash(), codec=CodecSpec(name="none"), lr=1e-3, seed=0,
                peers_of=lambda s: {}, max_tokens=4096)  # (stage 0 would take token ids)
            server.compute.queued = stage_server.MAX_QUEUE  # as if MAX_QUEUE requests waited
            with pytest.raises(StageBusy):
                await server.compute.run(server.worker.infer, torch.randn(1, 4, CONFIG.width),
                                         admit=True)
            assert server.counters["busy"] == 1
            # backward-side work still runs
            assert server.counters["compute_busy_ms"] == 0  # nothing computed yet
            out = await server.compute.run(server.worker.infer, torch.randn(1, 4, CONFIG.width))
            assert out.shape == (1, 4, CONFIG.width)
            # the compute thread's busy time, in whole ms (that forward may take less than one)
            await server.compute.run(time.sleep, 0.02)
            assert server.counters["compute_busy_ms"] >= 20
            await server.close()

    uvloop.run(asyncio.wait_for(scenario(), 60))


def test_a_hop_is_judged_by_the_peer_s_own_time_not_the_rest_of_the_chain() -> None:
    from swarmd.pipeline.messages import hop_seconds
    from transport.frames import Message

    ok = Message(kind="ok", meta={"service_s": 0.02, "held_s": 0.5})
    assert hop_seconds(ok, 0.53) == pytest.approx(0.05)  # 20 ms here + 30 ms on the wire
    for bad in ({}, {"service_s": "x", "held_s": 0.5}, {"service_s": 0.6, "held_s": 0.5},
                {"service_s": 0.1, "held_s": 9.0}, {"service_s": -1, "held_s": 0.5},
                {"service_s": True, "held_s": 0.5}):
        assert hop_seconds(Message(kind="ok", meta=bad), 0.53) == 0.53
