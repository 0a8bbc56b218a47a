"""The trainers' shared embedding and head: what a round does to one trainer's weights."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import torch

from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer
from swarmd.trainer.trainer_sync import TRAINERS_STAGE, TrainerSync


class _Host:
    peer_id = "me"
    #: the peers connected now (``connected_peers``)
    connected: list[str] = []

    async def connected_peers(self) -> list[str]:
        return list(self.connected)

    async def connect(self, peer: str, addrs: Any = (), *, timeout: float = 5.0) -> None:
        if peer not in self.connected:
            raise ConnectionError(f"{peer} cannot be dialed")

    async def ping(self, peer: str, *, timeout: float = 5.0) -> float:
        if peer not in self.connected:
            raise ConnectionError(f"{peer} does not answer")
        return 0.001

    def set_request_handler(self, *a: Any, **k: Any) -> None:
        pass

    def set_handler(self, *a: Any, **k: Any) -> None:
        pass

    def remove_handler(self, *a: Any) -> None:
        pass


def _trainer(dtype: torch.dtype) -> Any:
    module = torch.nn.Linear(3, 2).to(dtype)
    params = list(module.parameters())
    optimizer = SwarmOptimizer(params, OptimSettings(name="adamw", lr=0.1), dtype=dtype)

    async def run(fn: Any, *args: Any) -> Any:
        return fn(*args)

    return SimpleNamespace(parts=module, params=params, optimizer=optimizer, _run=run)


def _sync(trainer: Any) -> TrainerSync:
    return TrainerSync(_Host(), trainer, swarm="t", model_hash="h", mates=lambda: {},
                       averager=None)


def _step(trainer: Any) -> None:
    for p in trainer.params:
        p.grad = torch.ones_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()


def test_a_round_sets_the_average_and_keeps_the_steps_taken_while_it_ran() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        trainer = _trainer(dtype)
        sync = _sync(trainer)
        sync._samples = 8  # as after a step (stepped() would start a round)

        async def scenario() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
            taken, samples = await sync._snapshot()
            before = sync._weights()
            _step(trainer)                      # our own step while the round runs
            delta = sync._weights() - before
            average = torch.zeros_like(taken)   # what the round agreed on
            await sync._apply(average)
            return sync._weights(), delta, average, samples

        after, delta, average, samples = asyncio.run(scenario())
        assert samples == 8 and sync._samples == 0
        assert torch.allclose(after, average + delta, atol=1e-6), dtype
        if dtype == torch.bfloat16:  # the masters moved, and the module's weights follow them
            master = trainer.optimizer.master
            assert all(m.dtype == torch.float32 for m in master.masters)
            for p, m in zip(master.params, master.masters):
                assert torch.equal(p, m.to(p.dtype))


def test_a_failed_round_changes_no_weight_and_returns_its_samples() -> None:
    trainer = _trainer(torch.float32)
    sync = _sync(trainer)
    sync._samples = 5

    async def scenario() -> torch.Tensor:
        taken, samples = await sync._snapshot()
        sync._samples += 3
        await sync._give_back(taken, samples)
        return taken

    taken = asyncio.run(scenario())
    assert torch.equal(sync._weights(), taken) and sync._samples == 8


def test_a_mate_ahead_in_rounds_is_followed_without_a_download() -> None:
    sync = _sync(_trainer(torch.float32))
    sync._behind("other", 7)
    sync._behind("other", 3)  # never backwards
    assert sync.sync.step == 7 and sync.sync.stage == TRAINERS_STAGE


def test_the_parts_served_carry_the_trainer_step_and_their_digest_matches() -> None:
    from swarmd.state.round_digest import round_digest_of

    trainer = _trainer(torch.float32)
    trainer.step = 4
    sync = _sync(trainer)

    async def scenario() -> tuple[Any, tuple[int, str]]:
        return await sync._capture_parts(), await sync._parts_digest()

    state, (round_, digest) = asyncio.run(scenario())
    assert state.meta == {"trainer_step": 4} and state.stage == TRAINERS_STAGE
    assert round_ == state.step == sync.sync.step
    assert digest == round_digest_of(trainer.parts.parameters())
    _step(trainer)  # the digest follows the weights (what `swarmd export` compares)
    assert asyncio.run(sync._parts_digest())[1] != digest


def _grad_sync(trainer: Any, mates: dict[str, tuple[str, ...]]) -> TrainerSync:
    trainer.loss_scale = 1.0
    return TrainerSync(_Host(), trainer, swarm="t", model_hash="h", mates=lambda: mates,
                       averager=None, gradients=True, target=16)


def test_a_gradient_round_replaces_the_step_s_gradient_with_the_trainers_average() -> None:
    """Exact steps: the parts' mean gradient of this trainer's share is what the round gets
    (weighted by its samples), and the round's average is what the trainer steps on; the
    step's samples are the swarm's target."""
    trainer = _trainer(torch.float32)
    sync = _grad_sync(trainer, {"other": ("/ip4/127.0.0.1/tcp/1",)})
    for p in trainer.params:
        p.grad = torch.full_like(p, 2.0)

    async def scenario() -> tuple[int | None, torch.Tensor, int]:
        waiting = asyncio.ensure_future(sync.average_gradient(8))
        await asyncio.sleep(0)  # it reported its samples and waits for the round
        vector, samples = await sync._snapshot()
        await sync._apply(torch.full_like(vector, 0.5))  # what the round agreed on
        return await waiting, vector, samples

    total, vector, samples = asyncio.run(scenario())
    assert total == 16 and samples == 8
    assert torch.equal(vector, torch.full((sum(p.numel() for p in trainer.params),), 2.0))
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in trainer.params)
    assert sync.counters["gradients_averaged"] == 1


def test_a_gradient_round_that_fails_or_comes_late_leaves_the_trainer_its_own() -> None:
    """A failed round answers at once (None: the trainer steps on its own gradient); a round
    that ends after the trainer stopped waiting changes nothing (``gradient_rounds_late``),
    and a snapshot taken while no step waits adds nothing (weight 0)."""
    trainer = _trainer(torch.float32)
    sync = _grad_sync(trainer, {"other": ("/ip4/127.0.0.1/tcp/1",)})
    for p in trainer.params:
        p.grad = torch.full_like(p, 2.0)

    async def scenario() -> tuple[int | None, int]:
        waiting = asyncio.ensure_future(sync.average_gradient(8))
        await asyncio.sleep(0)
        vector, samples = await sync._snapshot()
        await sync._give_back(vector, samples)
        total = await waiting
        idle, idle_samples = await sync._snapshot()
        assert not idle.any()
        await sync._apply(torch.zeros_like(vector))
        return total, idle_samples

    total, idle_samples = asyncio.run(scenario())
    assert total is None and idle_samples == 0
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in trainer.params)
    assert sync.counters["gradient_rounds_missed"] == 1
    assert sync.counters["gradient_rounds_late"] == 1


def test_a_trainer_alone_keeps_its_gradient_without_a_round() -> None:
    trainer = _trainer(torch.float32)
    sync = _grad_sync(trainer, {})
    assert asyncio.run(sync.average_gradient(8)) == 8


def test_every_weights_every_th_gradient_round_averages_the_weights_too() -> None:
    """Parts that drifted apart (a round missed) come back together: that round's vector is
    the gradient and the weights, and both are set from the average before the step."""
    from swarmd.trainer.trainer_sync import WEIGHTS_EVERY

    trainer = _trainer(torch.float32)
    sync = _grad_sync(trainer, {"other": ("/ip4/127.0.0.1/tcp/1",)})
    sync.sync.took_state(WEIGHTS_EVERY - 1, 0)
    n = sum(p.numel() for p in trainer.params)
    before = torch.cat([p.detach().flatten() for p in trainer.params])
    for p in trainer.params:
        p.grad = torch.full_like(p, 2.0)

    async def scenario() -> tuple[int | None, torch.Tensor]:
        waiting = asyncio.ensure_future(sync.average_gradient(8))
        await asyncio.sleep(0)
        vector, _ = await sync._snapshot()
        await sync._apply(torch.cat([torch.full((n,), 0.5), torch.full((n,), 3.0)]))
        return await waiting, vector

    total, vector = asyncio.run(scenario())
    assert total == 16 and vector.numel() == 2 * n
    assert torch.equal(vector[:n], torch.full((n,), 2.0)) and torch.equal(vector[n:], before)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in trainer.params)
    assert all(torch.equal(p.detach(), torch.full_like(p, 3.0)) for p in trainer.params)


def test_a_trainer_that_disconnects_while_the_round_is_waited_for_is_not_waited_for() -> None:
    """A killed trainer stays in the view until its announcement expires; once the round is
    late the others probe it (dial and ping), and the step goes on without it, not after the
    minute a missing share would cost."""
    from swarmd.trainer.trainer_sync import GRADIENT_POLL_S

    trainer = _trainer(torch.float32)
    sync = _grad_sync(trainer, {"other": ("/ip4/127.0.0.1/tcp/1",)})
    host = sync.host
    host.connected = ["other"]
    for p in trainer.params:
        p.grad = torch.full_like(p, 2.0)

    async def scenario() -> tuple[int | None, float]:
        waiting = asyncio.ensure_future(sync.average_gradient(8))
        await asyncio.sleep(GRADIENT_POLL_S / 2)
        host.connected = []  # the other trainer died
        t0 = asyncio.get_running_loop().time()
        total = await asyncio.wait_for(waiting, 30)
        return total, asyncio.get_running_loop().time() - t0

    total, _ = asyncio.run(scenario())
    assert total is None
    assert sync.counters["gradient_rounds_mate_gone"] == 1
    assert sync.counters["gradient_rounds_missed"] == 1


def test_a_trainer_in_view_that_cannot_be_dialed_is_not_waited_for() -> None:
    trainer = _trainer(torch.float32)
    sync = _grad_sync(trainer, {"other": ("/ip4/127.0.0.1/tcp/1",)})
    sync.host.connected = []  # killed before this step: no connection, no dial
    for p in trainer.params:
        p.grad = torch.full_like(p, 2.0)
    assert asyncio.run(asyncio.wait_for(sync.average_gradient(8), 30)) is None
    assert sync.counters["gradient_rounds_mate_gone"] == 1
