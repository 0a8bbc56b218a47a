"""Mixed precision through the pipeline over real libp2p (three hosts in this process): bfloat16
stages and trainer step through float32 masters; with float16, the trainer's loss scale travels
with each backward, and an overflow skips the step on the trainer and on every stage."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import uvloop

from swarmd.pipeline.server import StageServer
from swarmd.trainer.trainer import Trainer
from swarmd.models.gpt import ModelConfig

from inprocess_swarm import two_stage_swarm

pytestmark = pytest.mark.integration

CONFIG = ModelConfig(width=32, heads=2, layers=2, seq_len=16)
SWARM = "precision-test"
B, T, MICRO = 2, 16, 2


async def _until(condition, seconds: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _scenario(dtype: torch.dtype, check) -> None:  # type: ignore[no-untyped-def]
    async with two_stage_swarm(CONFIG, target_batch_size=B * MICRO, swarm=SWARM,
                               model_hash="precision", dtype=dtype) as (servers, trainer):
        await check(trainer, servers)


def _batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 256, (B, T + 1), generator=g)
    return [(text[:, :-1], text[:, 1:]) for _ in range(MICRO)]  # learnable: the same text


def test_bfloat16_stages_and_trainer_train_through_float32_masters() -> None:
    async def check(trainer: Trainer, servers: list[StageServer]) -> None:
        losses = [await trainer.train_step(_batches(0)) for _ in range(6)]
        await _until(lambda: all(s.counters["optimizer_steps"] >= 6 for s in servers))
        assert losses[-1] < losses[0]
        for s in servers:
            assert all(p.dtype == torch.bfloat16 for p in s.module.parameters())
            assert s.optimizer.master is not None and s.optimizer.skipped == 0
            assert all(m.dtype == torch.float32 for m in s.optimizer.masters_state())
        assert trainer.optimizer.master is not None and trainer.scaler is None

    uvloop.run(asyncio.wait_for(_scenario(torch.bfloat16, check), 120))


def test_a_float16_overflow_skips_the_step_everywhere_and_halves_the_scale() -> None:
    async def check(trainer: Trainer, servers: list[StageServer]) -> None:
        assert trainer.scaler is not None
        trainer.scaler.scale = trainer.scaler.max_scale  # d(scale * loss) overflows float16
        before = [[p.detach().clone() for p in s.module.parameters()] for s in servers]
        await trainer.train_step(_batches(0))
        await _until(lambda: all(s.optimizer.skipped == 1 for s in servers))
        assert trainer.optimizer.skipped == 1
        assert trainer.scaler.scale == trainer.scaler.max_scale / 2
        for s, old in zip(servers, before):
            assert s.counters["grad_overflow"] >= 1 and s.optimizer.updates == 0
            assert all(torch.equal(a, p) for a, p in zip(old, s.module.parameters()))
        trainer.scaler.scale = 2.0 ** 8  # a scale that fits: the steps go through
        await trainer.train_step(_batches(0))
        await _until(lambda: all(s.optimizer.updates == 1 for s in servers))
        assert trainer.optimizer.skipped == 1 and trainer.optimizer.updates == 1
        for s in servers:
            assert s.optimizer.skipped == 1 and s.optimizer.scale == 2.0 ** 8

    uvloop.run(asyncio.wait_for(_scenario(torch.float16, check), 120))
