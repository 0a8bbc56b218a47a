"""The stage compute core: the chain rule across stage boundaries, and every refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarmd.errors import BadActivation, StageBusy, UnknownMicrobatch
from swarmd.pipeline.worker import StageWorker

W = 16


def blocks(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.LayerNorm(W), nn.Linear(W, W))


def test_two_workers_chained_give_the_single_process_gradients() -> None:
    a, b = blocks(1), blocks(2)
    ref_a, ref_b = blocks(1), blocks(2)
    x, target = torch.randn(4, 5, W), torch.randn(4, 5, W)
    # single process
    loss = ((ref_b(ref_a(x)) - target) ** 2).mean()
    loss.backward()
    # the swarm's way: forward hop by hop, backward along the path in reverse
    wa, wb = StageWorker(a, width=W, max_tokens=100), StageWorker(b, width=W, max_tokens=100)
    h = wa.forward("mb1", x, now=0.0)
    out = wb.forward("mb1", h, now=0.0).requires_grad_(True)
    ((out - target) ** 2).mean().backward()
    g_h = wb.backward("mb1", out.grad, now=1.0)
    wa.backward("mb1", g_h, now=1.0)
    for mine, ref in ((a, ref_a), (b, ref_b)):
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    assert wa.saved == wb.saved == 0
    assert wa.samples_accumulated == 4


def test_gradients_accumulate_until_zeroed() -> None:
    w = StageWorker(blocks(0), width=W, max_tokens=100)
    for i in range(3):
        w.forward(f"m{i}", torch.randn(2, 3, W), now=0.0)
        w.backward(f"m{i}", torch.ones(2, 3, W), now=0.0)
    assert w.samples_accumulated == 6
    w.zero_grad()
    assert w.samples_accumulated == 0 and all(p.grad is None for p in w.module.parameters())



def test_a_backwards_source_is_counted_with_its_samples_and_taken_with_the_gradient() -> None:
    """The (trainer, step) of a backward joins the worker's sources in the very call that adds
    its samples (the compute thread): a batch's members count together once it ran, never
    one before its samples or after the step that took its gradient."""
    w = StageWorker(blocks(0), width=W, max_tokens=100)
    w.forward_many([("a", torch.randn(2, 3, W)), ("b", torch.randn(2, 3, W))], now=0.0)
    assert w.backward_joined("a", torch.ones(2, 3, W), now=0.0, source=("T", 0)) is None
    assert w.accumulated() == ([], 0)  # waits for its batch: neither samples nor source yet
    w.backward_joined("b", torch.ones(2, 3, W), now=0.0, source=("T", 0))
    assert w.accumulated() == ([("T", 0)], 4)
    w.forward("c", torch.randn(2, 3, W), now=0.0)
    w.backward_joined("c", torch.ones(2, 3, W), now=0.0, source=("U", 5))
    assert w.accumulated() == ([("T", 0), ("U", 5)], 6)
    w.zero_grad()  # the step took the gradient: its sources went with it
    assert w.accumulated() == ([], 0)
    w.forward("d", torch.randn(2, 3, W), now=0.0)
    w.backward("d", torch.ones(2, 3, W), now=0.0)  # no source given: samples only
    assert w.accumulated() == ([], 2)

@pytest.mark.parametrize("x, reason", [
    (torch.randn(2, 3, W + 1), "shape"),
    (torch.randn(2, W), "shape"),
    (torch.randn(0, 3, W), "shape"),
    (torch.zeros(2, 3, W, dtype=torch.int64), "dtype"),
    (torch.full((2, 3, W), float("nan")), "not_finite"),
    (torch.full((2, 3, W), float("inf")), "not_finite"),
    (torch.randn(20, 10, W), "too_large"),
])
def test_bad_activations_are_refused_and_nothing_is_kept(x: torch.Tensor, reason: str) -> None:
    w = StageWorker(blocks(0), width=W, max_tokens=100)
    with pytest.raises(BadActivation) as err:
        w.forward("m", x, now=0.0)
    assert err.value.reason == reason and w.saved == 0


def test_bad_gradients_are_refused_and_the_microbatch_kept() -> None:
    w = StageWorker(blocks(0), width=W, max_tokens=100)
    w.forward("m", torch.randn(2, 3, W), now=0.0)
    with pytest.raises(BadActivation):
        w.backward("m", torch.randn(2, 4, W), now=0.0)
    with pytest.raises(BadActivation):
        w.backward("m", torch.full((2, 3, W), float("nan")), now=0.0)
    w.backward("m", torch.ones(2, 3, W), now=0.0)  # a good one still works


def test_unknown_repeated_and_expired_backwards() -> None:
    w = StageWorker(blocks(0), width=W, max_tokens=100, ttl_s=10.0)
    with pytest.raises(UnknownMicrobatch):
        w.backward("never", torch.ones(1, 1, W), now=0.0)
    w.forward("m", torch.randn(1, 1, W), now=0.0)
    w.backward("m", torch.ones(1, 1, W), now=0.0)
    with pytest.raises(UnknownMicrobatch):
        w.backward("m", torch.ones(1, 1, W), now=0.0)
    w.forward("late", torch.randn(1, 1, W), now=0.0)
    with pytest.raises(UnknownMicrobatch):
        w.backward("late", torch.ones(1, 1, W), now=10.0)
    w.forward("old", torch.randn(1, 1, W), now=0.0)
    assert w.expire(now=10.0) == ["old"] and w.saved == 0


def test_a_full_worker_refuses_instead_of_evicting() -> None:
    w = StageWorker(blocks(0), width=W, max_tokens=100, max_saved=2)
    w.forward("a", torch.randn(1, 1, W), now=0.0)
    w.forward("b", torch.randn(1, 1, W), now=0.0)
    with pytest.raises(StageBusy):
        w.forward("c", torch.randn(1, 1, W), now=0.0)
    with pytest.raises(BadActivation):
        w.forward("a", torch.randn(1, 1, W), now=0.0)  # a duplicate id is the sender's bug
    w.backward("a", torch.ones(1, 1, W), now=0.0)
    w.forward("c", torch.randn(1, 1, W), now=0.0)  # room again


def test_infer_keeps_nothing_and_matches_forward() -> None:
    w = StageWorker(blocks(0), width=W, max_tokens=100)
    x = torch.randn(2, 3, W)
    y = w.infer(x)
    assert w.saved == 0 and not y.requires_grad
    assert torch.allclose(y, w.forward("m", x, now=0.0))
    with pytest.raises(BadActivation):
        w.infer(torch.full((2, 3, W), float("nan")))


def test_a_batch_of_microbatches_gives_the_gradients_they_give_one_by_one() -> None:
    one, many = blocks(3), blocks(3)
    xs = [torch.randn(2, 5, W), torch.randn(3, 5, W), torch.randn(1, 5, W)]
    gs = [torch.randn(x.shape) for x in xs]
    w1 = StageWorker(one, width=W, max_tokens=100)
    alone = []
    for i, (x, g) in enumerate(zip(xs, gs)):
        w1.forward(f"m{i}", x, now=0.0)
        alone.append(w1.backward(f"m{i}", g, now=0.0))
    wn = StageWorker(many, width=W, max_tokens=100)
    outs = wn.forward_many([(f"m{i}", x) for i, x in enumerate(xs)], now=0.0)
    assert [tuple(o.shape) for o in outs] == [tuple(x.shape) for x in xs]
    assert wn.backward_joined("m2", gs[2], now=0.0) is None  # waits for its batch
    assert wn.waiting("m2") and not wn.waiting("m0")
    assert wn.backward_joined("m0", gs[0], now=0.0) is None
    done = wn.backward_joined("m1", gs[1], now=0.0)
    assert done is not None and set(done) == {"m0", "m1", "m2"}
    for i in range(3):
        assert torch.allclose(done[f"m{i}"], alone[i], rtol=1e-5, atol=1e-6)
    for p, q in zip(one.parameters(), many.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert wn.saved == 0 and wn.samples_accumulated == w1.samples_accumulated == 6


def test_a_batch_whose_member_never_comes_back_is_finished_without_it() -> None:
    full, part = blocks(4), blocks(4)
    x0, x1 = torch.randn(2, 5, W), torch.randn(2, 5, W)
    g0 = torch.randn(2, 5, W)
    ref = StageWorker(part, width=W, max_tokens=100)
    ref.forward("a", x0, now=0.0)
    expected = ref.backward("a", g0, now=0.0)
    w = StageWorker(full, width=W, max_tokens=100)
    w.forward_many([("a", x0), ("b", x1)], now=0.0)
    assert w.backward_joined("a", g0, now=0.0) is None
    done = w.finish("a")  # "b" is given up: it counts as a zero gradient
    assert set(done) == {"a"} and torch.allclose(done["a"], expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(full.parameters(), part.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert w.samples_accumulated == 2 and w.saved == 0
    with pytest.raises(UnknownMicrobatch):
        w.backward_joined("b", torch.randn(2, 5, W), now=0.0)
    with pytest.raises(ValueError):
        w.forward_many([("c", torch.randn(1, 5, W)), ("d", torch.randn(1, 4, W))], now=0.0)


def test_a_step_between_forward_and_backward_uses_the_weights_the_forward_used() -> None:
    """Weight stashing: a step in place while a microbatch is in flight breaks nothing; its
    gradient is the one of the weights its forward ran with; the next forward uses the new."""
    module, ref = blocks(3), blocks(3)
    w = StageWorker(module, width=W, max_tokens=100)
    x, g = torch.randn(2, 3, W), torch.randn(2, 3, W)
    y = w.forward("old", x, now=0.0)
    with torch.no_grad():  # an optimizer step, in place
        for p in module.parameters():
            p.add_(0.5)
    gx = w.backward("old", g, now=0.0)
    # the reference: the old weights
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    assert torch.allclose(y, yr.detach(), atol=1e-6)
    yr.backward(g)
    assert torch.allclose(gx, xr.grad, atol=1e-6)
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    # a new forward runs on the stepped weights
    with torch.no_grad():
        for q in ref.parameters():
            q.add_(0.5)
        assert torch.allclose(w.forward("new", x, now=0.0), ref(x), atol=1e-6)


def test_microbatches_older_than_the_staleness_bound_are_dropped() -> None:
    w = StageWorker(blocks(0), width=W, max_tokens=100, max_staleness=2)
    w.forward("a", torch.randn(1, 2, W), now=0.0)
    assert w.stepped() == [] and w.stepped() == []
    w.forward("b", torch.randn(1, 2, W), now=0.0)
    assert w.stepped() == ["a"] and w.holds("b") and not w.holds("a")
    with pytest.raises(UnknownMicrobatch):
        w.backward("a", torch.ones(1, 2, W), now=0.0)
    w.backward("b", torch.ones(1, 2, W), now=0.0)


def test_backward_with_current_weights_runs_the_forward_again_after_a_step() -> None:
    """SWARM's answer, kept as an option: the gradient is the current weights' on the input
    kept; without a step in between the kept graph is used as is."""
    module, ref = blocks(4), blocks(4)
    w = StageWorker(module, width=W, max_tokens=100, backward_with="current")
    x, g = torch.randn(2, 3, W), torch.randn(2, 3, W)
    w.forward("m", x, now=0.0)
    with torch.no_grad():
        for p, q in zip(module.parameters(), ref.parameters()):
            p.add_(0.5)
            q.add_(0.5)
    gx = w.backward("m", g, now=0.0)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    assert torch.allclose(gx, xr.grad, atol=1e-6) and w.recomputed == 1
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    w.forward("n", x, now=0.0)
    w.backward("n", g, now=0.0)
    assert w.recomputed == 1
    with pytest.raises(ValueError):
        StageWorker(blocks(0), width=W, max_tokens=100, backward_with="later")


VOCAB = 50


def embedding_stage(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, W), nn.Linear(W, W), nn.GELU(), nn.Linear(W, W))


def test_a_stage_holding_the_embedding_takes_token_ids_and_sends_back_no_gradient() -> None:
    """Stage 0 of a model whose embedding it holds: ids (B, T) in, the embedding's gradient
    is the single-process one, the trainer gets an empty (B, T, 0) that says the chain is
    done; a batch of two is the same as one by one."""
    module, ref = embedding_stage(3), embedding_stage(3)
    w = StageWorker(module, width=W, max_tokens=100, vocab=VOCAB)
    x = torch.randint(VOCAB, (4, 5))
    out = w.forward("a", x[:2].to(torch.int32), now=0.0)  # the trainer sends int32
    out_b = w.forward("b", x[2:], now=0.0)
    grad = torch.randn(4, 5, W)
    assert w.backward("a", grad[:2], now=0.0).shape == (2, 5, 0)
    back = w.backward("b", grad[2:], now=0.0)
    assert back.shape == (2, 5, 0) and back.dtype == torch.float32
    ref(x).backward(grad)
    assert torch.allclose(torch.cat([out, out_b]), ref(x).detach(), atol=1e-6)
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.infer(x), ref(x).detach())
    assert w.samples_accumulated == 4 and w.saved == 0


@pytest.mark.parametrize("x, reason", [
    (torch.randn(2, 3), "dtype"),
    (torch.randn(2, 3, W), "shape"),
    (torch.zeros(2, 3, 1, dtype=torch.int64), "shape"),
    (torch.tensor([[0, 1, VOCAB]]), "out_of_range"),
    (torch.tensor([[0, -1, 2]]), "out_of_range"),
    (torch.zeros(2, 3, dtype=torch.bool), "dtype"),
    (torch.zeros(20, 10, dtype=torch.int64), "too_large"),
])
def test_bad_token_ids_are_refused_and_nothing_is_kept(x: torch.Tensor, reason: str) -> None:
    w = StageWorker(embedding_stage(0), width=W, max_tokens=100, vocab=VOCAB)
    with pytest.raises(BadActivation) as err:
        w.forward("m", x, now=0.0)
    assert err.value.reason == reason and w.saved == 0
    w.forward("ok", torch.zeros(1, 3, dtype=torch.int64), now=0.0)
    with pytest.raises(BadActivation):  # gradients are still (B, T, width) floats
        w.backward("ok", torch.zeros(1, 3, dtype=torch.int64), now=0.0)
