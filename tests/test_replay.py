"""Catch-up by replay: the gradient log (bounds, ``since``, gaps), the exactness of a replay
(bitwise the weights and optimizer state of the peer that stepped), and the ``state_replay``
messages (every malformed reply a typed error)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.stepping import Stepper
from swarmd.pipeline.worker import StageWorker
from swarmd.state.encoding import capture, decode, encode, restore
from swarmd.state.messages import ReplayRequest, parse_replay, parse_request
from swarmd.state.replay import ReplayLog
from swarmd.state.serve import StateServer
from swarmd.state.transfer import BadStateRequest
from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer
from transport.frames import Message


def vec(value: float, n: int = 4) -> torch.Tensor:
    return torch.full((n,), float(value), dtype=torch.float32)


# ---- the log ---------------------------------------------------------------------------------


def test_since_gives_the_vectors_from_a_step_to_the_newest_and_none_before_the_oldest() -> None:
    log = ReplayLog(max_steps=3, max_bytes=1 << 20)
    assert log.since(0) is None  # empty: nothing to replay, not even zero steps
    for step in range(10, 15):
        log.record(step, vec(step))
    assert (log.oldest, log.newest, len(log)) == (12, 15, 3)
    assert [float(v[0]) for v in log.since(12)] == [12, 13, 14]  # type: ignore[union-attr]
    assert [float(v[0]) for v in log.since(14)] == [14]  # type: ignore[union-attr]
    assert log.since(15) == []
    assert log.since(11) is None and log.since(16) is None
    assert [float(v[0]) for v in log.between(12, 2)] == [12, 13]  # type: ignore[union-attr]


def test_the_byte_bound_drops_the_oldest_and_a_too_big_vector_clears_the_log() -> None:
    log = ReplayLog(max_steps=100, max_bytes=3 * 16)  # three vectors of 4 float32
    for step in range(5):
        log.record(step, vec(step))
    assert (log.oldest, log.newest, log.nbytes) == (2, 5, 48)
    log.record(5, vec(5, n=13))  # 52 bytes: more than the whole bound
    assert len(log) == 0 and log.since(5) is None and log.nbytes == 0
    log.record(6, vec(6))  # refilled by the steps after
    assert log.since(7) == [] and len(log.since(6) or []) == 1 and log.oldest == 6


def test_a_gap_or_a_clear_means_no_replay_across_it() -> None:
    log = ReplayLog(max_steps=8, max_bytes=1 << 20)
    log.extend(0, [vec(0), vec(1)])
    log.record(5, vec(5))  # steps 2..4 are not known here
    assert log.since(0) is None and log.since(1) is None and len(log.since(5)) == 1  # type: ignore[arg-type]
    log.clear()
    assert log.since(5) is None and log.since(6) is None


def test_a_disabled_log_keeps_nothing() -> None:
    for log in (ReplayLog(max_steps=0, max_bytes=1 << 20), ReplayLog(max_steps=8, max_bytes=0)):
        log.record(0, vec(0))
        assert not log.enabled and len(log) == 0 and log.since(0) is None
    with pytest.raises(ValueError):
        ReplayLog(max_steps=-1, max_bytes=1)


@settings(max_examples=200, deadline=None)
@given(max_steps=st.integers(0, 6), max_vectors=st.integers(0, 6),
       ops=st.lists(st.one_of(st.tuples(st.just("step"), st.integers(1, 3)),
                              st.tuples(st.just("jump"), st.integers(2, 4)),
                              st.tuples(st.just("clear"), st.just(0))), max_size=30))
def test_the_log_is_bounded_and_since_always_leads_to_the_newest_step(
        max_steps: int, max_vectors: int, ops: list[tuple[str, int]]) -> None:
    n = 4
    log = ReplayLog(max_steps=max_steps, max_bytes=max_vectors * n * 4)
    step, valid_from = 0, 0  # the log may only answer for steps since the last gap
    for op, arg in ops:
        if op == "clear":
            log.clear()
            valid_from = step
            continue
        if op == "jump":
            step += arg
            valid_from = step
        for _ in range(arg if op == "step" else 1):
            log.record(step, vec(step, n))
            step += 1
        assert len(log) <= max_steps and log.nbytes <= max_vectors * n * 4
        assert log.nbytes == len(log) * n * 4
    for start in range(0, step + 2):
        got = log.since(start)
        if got is None:
            continue
        assert valid_from <= start <= step
        assert [float(v[0]) for v in got] == [float(s) for s in range(start, step)]
    if log.enabled and len(log):
        assert log.newest == step and log.since(step) == []
        assert len(log) == min(max_steps, max_vectors, step - valid_from)


# ---- exactness: a replay gives the weights and optimizer state of the peer that stepped ------


def make_peer(seed: int, settings_: OptimSettings,
              dtype: torch.dtype = torch.float32) -> tuple[Stepper, list[int]]:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                 torch.nn.Linear(16, 8)).to(dtype)
    worker = StageWorker(module, width=8, max_tokens=1024, dtype=dtype)
    step = [0]
    stepper = Stepper(module, worker, SwarmOptimizer(module.parameters(), settings_,
                                                     dtype=dtype),
                      Counter(), replay=ReplayLog(max_steps=8, max_bytes=1 << 20),
                      step=lambda: step[0])
    return stepper, step


def backward(stepper: Stepper, seed: int, samples: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g).to(next(stepper.module.parameters()).dtype)
    stepper.module(x).pow(2).sum().backward()
    stepper.worker.samples_accumulated += samples


def flat(stepper: Stepper) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in stepper.module.parameters()])


def same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("name,dtype", [("adamw", torch.float32), ("lamb", torch.float32),
                                        ("adamw", torch.bfloat16)])
def test_replaying_the_logged_steps_onto_the_old_state_is_bitwise_the_stepped_peer(
        name: str, dtype: torch.dtype) -> None:
    # warmup makes the lr depend on the step count; a tight clip scales gradients in place
    opt = OptimSettings(name=name, lr=1e-2, grad_clip=0.5, schedule="cosine",
                        warmup_steps=3, decay_steps=20)
    ahead, ahead_step = make_peer(1, opt, dtype)
    for i in range(3):  # some history first: moments that are not zero
        backward(ahead, 100 + i)
        ahead.step_alone()
        ahead_step[0] += 1
    # as a joiner gets it: over the wire (a bf16/fp16 stage's float32 masters included)
    old = decode(encode(capture(ahead.module, ahead.optimizer, stage=0, step=3,
                                model_hash="h")))
    for i in range(5):  # k = 5 steps after the state was taken: alone and in rounds
        if i % 2:
            backward(ahead, 200 + i)
            ahead.step_alone()
        else:
            backward(ahead, 200 + i)
            vector, _ = ahead.take_gradient()
            backward(ahead, 300 + i)  # accumulated meanwhile: kept aside, not stepped with
            ahead.apply_gradient(vector * 0.5)
        ahead_step[0] += 1
    vectors = ahead.replay.since(3)
    assert vectors is not None and len(vectors) == 5

    behind, _ = make_peer(2, opt, dtype)  # other initial weights: all comes from the state
    restore(old, behind.module, behind.optimizer, stage=0, model_hash="h")
    behind.forget(3)
    for i, vector in enumerate(vectors):
        behind.apply_gradient(vector.clone(), at=3 + i)

    ahead.worker.zero_grad()
    assert torch.equal(flat(ahead), flat(behind))
    assert same_tree(ahead.optimizer.state_dict(), behind.optimizer.state_dict())
    assert ahead.round_digest() == behind.round_digest()
    # the replayed steps are the replayer's history now: it can serve them in turn
    assert behind.replay.newest == 8 and len(behind.replay.since(3) or []) == 5


def test_a_replayed_vector_is_logged_before_the_optimizer_clips_it() -> None:
    stepper, _ = make_peer(3, OptimSettings(name="adamw", lr=1e-2, grad_clip=1e-3))
    vector = torch.full((stepper.numel,), 5.0)
    stepper.apply_gradient(vector, at=0)
    assert torch.equal(stepper.replay.since(0)[0], torch.full((stepper.numel,), 5.0))  # type: ignore[index]


def test_a_lone_step_with_a_parameter_without_gradient_cannot_be_replayed() -> None:
    stepper, step = make_peer(4, OptimSettings())
    backward(stepper, 1)
    stepper.step_alone()
    step[0] += 1
    assert stepper.replay.since(0) is not None
    stepper.module[0].bias.grad = None  # the optimizer skips it; a zero gradient would not
    for p in list(stepper.module.parameters())[1:]:
        p.grad = torch.ones_like(p)
    stepper.step_alone()
    assert stepper.replay.since(0) is None and len(stepper.replay) == 0


def test_a_stage_whose_gradient_exceeds_the_byte_bound_keeps_none_and_copies_none() -> None:
    stepper, step = make_peer(6, OptimSettings())
    stepper.replay = ReplayLog(max_steps=8, max_bytes=stepper.numel * 4 - 1)
    assert not stepper.replay.keeps(stepper.numel * 4)
    backward(stepper, 1)
    stepper.step_alone()
    stepper.apply_gradient(torch.zeros(stepper.numel), at=1)
    assert len(stepper.replay) == 0 and stepper.replay.since(0) is None


# ---- the wire -------------------------------------------------------------------------------


ASK = ReplayRequest(stage=1, model_hash="h", since=10, count=3)


def reply(tensors: tuple[Any, ...], **meta: Any) -> Any:
    return parse_replay("mate", "state_replay", {"since": 10, "step": 13, "kept": True, **meta},
                        tensors, asked=ASK, numel=4)


def test_a_good_replay_reply_and_a_not_kept_one_parse() -> None:
    got = reply((vec(1), vec(2)), step=14, extra="dropped")
    assert got.peer == "mate" and got.step == 14 and len(got.vectors) == 2  # type: ignore[arg-type]
    none = parse_replay("mate", "state_replay", {"since": 10, "step": 40, "kept": False}, (),
                        asked=ASK, numel=4)
    assert none.vectors is None and none.step == 40


@pytest.mark.parametrize("tensors,meta", [
    ((vec(1).double(),), {}),                                 # not float32
    ((vec(1, n=5),), {}),                                     # wrong length
    ((vec(1).reshape(2, 2),), {}),                            # not flat
    ((torch.tensor([1.0, float("nan"), 0.0, 0.0]),), {}),     # NaN
    ((torch.tensor([1.0, float("inf"), 0.0, 0.0]),), {}),     # Inf
    ((vec(1),) * 4, {"step": 20}),                            # more than asked
    ((vec(1),) * 3, {"step": 12}),                            # past the step it claims
    ((), {}),                                                 # kept, but nothing
    ((vec(1),), {"kept": False}),                             # not kept, with tensors
    ((vec(1),), {"since": 9}),                                # answers another request
    ((vec(1),), {"step": -1}),
    ((vec(1),), {"step": True}),
    ((vec(1),), {"kept": "yes"}),
    (("not a tensor",), {}),
])
def test_every_malformed_replay_reply_is_a_typed_error(tensors: tuple[Any, ...],
                                                      meta: dict[str, Any]) -> None:
    with pytest.raises(BadStateRequest):
        reply(tensors, **meta)
    with pytest.raises(BadStateRequest):
        parse_replay("mate", "state_digest", {"since": 10, "step": 13, "kept": True},
                     (vec(1),), asked=ASK, numel=4)


@pytest.mark.parametrize("meta,tensors", [
    ({"since": -1, "count": 1}, ()), ({"since": 0, "count": 0}, ()),
    ({"since": 0, "count": 5000}, ()), ({"since": True, "count": 1}, ()),
    ({"since": 0}, ()), ({"since": 0, "count": 1}, (vec(1),)),
])
def test_a_malformed_replay_request_is_a_typed_error(meta: dict[str, Any],
                                                     tensors: tuple[Any, ...]) -> None:
    with pytest.raises(BadStateRequest):
        parse_request("state_replay", {"stage": 1, "model_hash": "h", **meta}, tensors)
    ok = parse_request("state_replay", {"stage": 1, "model_hash": "h", "since": 3, "count": 2,
                                        "other": 1})
    assert ok == ReplayRequest(stage=1, model_hash="h", since=3, count=2)


def test_the_server_answers_kept_gradients_within_its_message_limit_or_not_kept() -> None:
    log = ReplayLog(max_steps=8, max_bytes=1 << 20)
    log.extend(10, [vec(i, n=64 << 10) for i in range(4)])  # 256 KiB each
    host = SimpleNamespace(peer_id="me", options=SimpleNamespace(
        limits=SimpleNamespace(max_message_bytes=(64 << 10) + 2 * (256 << 10) + 100)))

    async def replay(since: int, count: int) -> tuple[int, list[torch.Tensor] | None]:
        return 14, log.between(since, count)

    async def nothing() -> None:
        return None

    server = StateServer(host, "p", nothing, stage=1, model_hash="h", replay=replay)  # type: ignore[arg-type]

    def ask(since: int, count: int) -> Message:
        meta = {"stage": 1, "model_hash": "h", "since": since, "count": count}
        return asyncio.run(server.serve(Message(kind="state_replay", meta=meta), "peer"))

    got = ask(10, 4)
    assert got.meta == {"since": 10, "step": 14, "kept": True} and len(got.tensors) == 2
    asked = ReplayRequest(stage=1, model_hash="h", since=10, count=4)
    assert len(parse_replay("me", got.kind, got.meta, got.tensors, asked=asked,
                            numel=64 << 10).vectors or ()) == 2
    gone = ask(3, 4)
    assert gone.meta == {"since": 3, "step": 14, "kept": False} and not gone.tensors
    with pytest.raises(BadStateRequest):
        ask(3, 0)
    assert server.counters["bad_requests.replay"] == 1


def test_the_weights_step_follows_the_steps_taken_and_the_state_taken_over() -> None:
    """What a capture or a digest in the compute thread labels the weights with: the stage's
    step moves on the event loop only after a step returned."""
    stepper, step = make_peer(5, OptimSettings())
    step[0] = 4
    stepper.apply_gradient(torch.zeros(stepper.numel))
    assert stepper.weights_step == 5  # while the stage's step still says 4
    stepper.apply_gradient(torch.zeros(stepper.numel), at=9)
    assert stepper.weights_step == 10 and stepper.replay.since(9) is not None
    assert stepper.replay.since(4) is None  # 5..8 were not stepped here: a gap
    stepper.forget(2)
    assert stepper.weights_step == 2 and len(stepper.replay) == 0
