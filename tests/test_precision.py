"""Mixed precision: bf16 compute with float32 masters trains; fp16 with loss scaling does not
turn to NaN where a pure fp16 model with AdamW does; the learning rate schedule; clipping."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmd.models.builtin import BuiltinGPT
from swarmd.models.gpt import ModelConfig
from swarmd.training.optim import lr_at, make_optimizer
from swarmd.training.precision import LossScaler, MasterWeights

CONFIG = ModelConfig(vocab=32, width=32, heads=2, layers=2, seq_len=16)
#: smaller still for the 200 float16 steps (float16 kernels are slow on a CPU)
TINY = ModelConfig(vocab=32, width=16, heads=2, layers=2, seq_len=8)


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    """Tiny models: one torch thread is fastest, and spares a busy machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(dtype: torch.dtype, config: ModelConfig = CONFIG):  # type: ignore[no-untyped-def]
    seam = BuiltinGPT(config)
    trainer = seam.build_trainer(dtype=dtype)
    stages = [seam.build_stage(i, 2, dtype=dtype) for i in range(2)]
    params = [p for m in (trainer, *stages) for p in m.parameters()]

    def loss_of(x, y):  # type: ignore[no-untyped-def]
        h = trainer.embed(x)
        for s in stages:
            h = s(h)
        return trainer.loss(trainer.head(h), y)
    return params, loss_of


def batches(n: int, seq_len: int = 16):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    pattern = torch.arange(seq_len + 1) % 5  # a learnable sequence
    for _ in range(n):
        shift = torch.randint(5, (4, 1), generator=g)
        t = (pattern[None, :] + shift) % 32
        yield t[:, :-1], t[:, 1:]


def test_bf16_with_float32_masters_trains_and_masters_stay_float32() -> None:
    params, loss_of = tiny(torch.bfloat16)
    opt = MasterWeights(params, optimizer="adamw", lr=3e-3, grad_clip=1.0)
    losses = []
    for x, y in batches(60):
        opt.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        assert opt.step().stepped
        losses.append(float(loss.detach()))
    assert all(m.dtype == torch.float32 for m in opt.masters)
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, opt.masters))
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.inner.state.values())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10


def test_fp16_with_loss_scaling_stays_finite_over_200_steps() -> None:
    params, loss_of = tiny(torch.float16, TINY)
    opt = MasterWeights(params, optimizer="adamw", lr=3e-3)
    scaler = LossScaler(init_scale=2.0 ** 20, growth_interval=20)
    first = None
    for x, y in batches(200, TINY.seq_len):
        opt.zero_grad()
        loss = loss_of(x, y)
        (loss * scaler.scale).backward()
        result = opt.step(scale=scaler.scale)
        scaler.update(not result.stepped)
        first = first if first is not None else float(loss.detach())
        assert all(torch.isfinite(p).all() for p in params)
    assert math.isfinite(float(loss.detach())) and float(loss.detach()) < first
    assert scaler.skipped >= 1  # 2**20 overflowed at first: the scale came down by itself


def test_pure_fp16_adamw_turns_to_nan_where_masters_do_not() -> None:
    # the failure MasterWeights exists for: AdamW's eps 1e-8 is 0 in float16, so an entry with
    # a zero gradient divides 0 by 0
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = make_optimizer("adamw", [w], 1e-3)
    w.grad = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float16)
    opt.step()
    assert torch.isnan(w).any()
    v = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    mw = MasterWeights([v], lr=1e-3)
    v.grad = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float16)
    assert mw.step().stepped and torch.isfinite(v).all()


def test_overflowed_gradients_skip_the_step_and_leave_weights() -> None:
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = MasterWeights([w], lr=0.1)
    w.grad = torch.tensor([1.0, math.inf, 0.0], dtype=torch.float16)
    result = opt.step(scale=8.0)
    assert not result.stepped and torch.equal(w, torch.ones(3, dtype=torch.float16))
    assert not opt.inner.state  # the inner optimizer never saw it


def test_gradient_clipping_bounds_the_global_norm() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    opt = MasterWeights([w], optimizer="adamw", lr=1.0, grad_clip=0.5)
    w.grad = torch.tensor([30.0, 40.0])
    assert opt.step().grad_norm == pytest.approx(50.0)
    assert float(opt.masters[0].grad.norm()) == pytest.approx(0.5, rel=1e-4)


def test_loss_scaler_backs_off_and_grows() -> None:
    s = LossScaler(init_scale=1024.0, growth_interval=3)
    s.update(True)
    assert s.scale == 512.0 and s.skipped == 1
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024.0
    for _ in range(100):
        s.update(True)
    assert s.scale == 1.0  # min_scale
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


@given(st.integers(0, 5000), st.integers(0, 100), st.integers(1, 3000))
def test_lr_schedule_warms_up_then_stays_within_bounds(step, warmup, decay) -> None:
    for schedule in ("constant", "cosine"):
        lr = lr_at(step, 0.1, schedule=schedule, warmup_steps=warmup, decay_steps=decay)
        if step < warmup:
            assert lr == pytest.approx(0.1 * (step + 1) / warmup)
        elif schedule == "constant":
            assert lr == 0.1
        else:
            assert 0.01 - 1e-12 <= lr <= 0.1 + 1e-12
    assert lr_at(10_000, 0.1, schedule="cosine", decay_steps=100) == pytest.approx(0.01)
    assert lr_at(0, 0.1, schedule="cosine", decay_steps=100) == pytest.approx(0.1)


def test_weight_decay_reaches_the_optimizer_and_defaults_are_unchanged() -> None:
    p = [torch.nn.Parameter(torch.ones(1))]
    assert make_optimizer("adamw", p, 0.1).param_groups[0]["weight_decay"] == 0.01
    assert make_optimizer("lamb", p, 0.1, weight_decay=0.2).param_groups[0]["weight_decay"] == 0.2


def test_master_weights_state_round_trips() -> None:
    params, loss_of = tiny(torch.bfloat16)
    opt = MasterWeights(params, lr=1e-2)
    x, y = next(batches(1))
    loss_of(x, y).backward()
    opt.step()
    other_params, _ = tiny(torch.bfloat16)
    other = MasterWeights(other_params, lr=1e-2)
    other.load_state_dict(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, other.masters))
    assert all(torch.equal(a, b) for a, b in zip(params, other_params))
    with pytest.raises(ValueError, match="holds 1 master tensors"):
        other.load_state_dict({"masters": [opt.masters[0]], "optimizer": {}})
