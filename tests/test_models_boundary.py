"""The low-rank stage boundary (``model.boundary_rank``, swarmd.models.boundary): the parts'
shapes, a cut model computing what one process computes, the setting in the fingerprint and
the manifest, a width that is not the rank refused, export refusing it."""

from __future__ import annotations

import pytest
import torch

from swarmd.config import ConfigError, load_config
from swarmd.errors import BadActivation, ModelError
from swarmd.models.boundary import LowRankBoundary, boundary_basis, with_boundary
from swarmd.models.builtin import BuiltinGPT
from swarmd.models.gpt import ModelConfig

CONFIG = ModelConfig(vocab=64, width=32, heads=4, layers=4, seq_len=16)
RANK = 8
#: the built-in GPT with its embedding at the trainer: a boundary at hop 0 too
TRAINER_EMBEDS = BuiltinGPT(CONFIG, stage0_embeds=False)


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(64, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_every_part_sends_and_receives_rank_values_a_token() -> None:
    seam = LowRankBoundary(TRAINER_EMBEDS, RANK)
    trainer = seam.build_trainer(seed=1)
    stages = [seam.build_stage(i, 2, seed=1) for i in range(2)]
    h = trainer.embed(tokens())
    assert tuple(h.shape) == (2, 16, RANK) == seam.activation(2, 16).shape
    for stage in stages:
        h = stage(h)
        assert tuple(h.shape) == (2, 16, RANK)
    assert tuple(trainer.head(h).shape) == (2, 16, 64)
    # each part holds its boundaries' projections as ordinary parameters
    names = dict(stages[0].named_parameters())
    assert tuple(names["up.proj.weight"].shape) == (32, RANK)
    assert tuple(names["down.proj.weight"].shape) == (RANK, 32)
    assert tuple(names["up.proj.bias"].shape) == (32,) and "down.proj.bias" not in names
    assert {"down.proj.weight", "up.proj.weight", "up.proj.bias"} <= set(
        dict(trainer.named_parameters()))


def _parts(seam: LowRankBoundary, seed: int) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    return seam.build_trainer(seed=seed), [seam.build_stage(i, 2, seed=seed) for i in range(2)]


def _grads(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.grad for i, m in enumerate(modules) for n, p in m.named_parameters()}


def test_a_cut_model_computes_what_one_process_computes() -> None:
    """The trainer and two stages built apart (as three peers build them), run hop by hop as
    the pipeline runs them (each hop's tensor detached, gradients sent back one hop at a
    time) give the loss and every parameter's gradient one process gives."""
    seam = LowRankBoundary(TRAINER_EMBEDS, RANK)
    x, y = tokens(), tokens()

    trainer, stages = _parts(seam, 3)           # one process
    h = trainer.embed(x)
    for stage in stages:
        h = stage(h)
    whole = trainer.loss(trainer.head(h), y)
    whole.backward()
    expected = _grads(trainer, *stages)

    trainer, stages = _parts(seam, 3)           # the pipeline: trainer, stage 0, stage 1
    outputs, received = [trainer.embed(x)], []
    for stage in stages:
        hop = outputs[-1].detach().requires_grad_(True)
        assert hop.shape[-1] == RANK                    # what travels: rank values a token
        received.append(hop)
        outputs.append(stage(hop))
    last = outputs[-1].detach().requires_grad_(True)
    loss = trainer.loss(trainer.head(last), y)
    loss.backward()
    grad = last.grad
    for out, hop in zip(reversed(outputs[1:]), reversed(received)):
        assert grad.shape[-1] == RANK
        out.backward(grad)
        grad = hop.grad
    outputs[0].backward(grad)
    got = _grads(trainer, *stages)

    assert torch.equal(loss, whole)
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), name

    # each boundary's down (sender) and up (receiver) start as one orthonormal basis, so
    # up(down(v)) is the orthogonal projection of v onto a random subspace
    assert torch.allclose(stages[0].up.proj.weight, trainer.down.proj.weight.T)
    assert torch.allclose(stages[1].up.proj.weight, stages[0].down.proj.weight.T)
    assert torch.allclose(trainer.up.proj.weight, stages[1].down.proj.weight.T)
    down = trainer.down.proj.weight
    assert torch.allclose(down @ down.T, torch.eye(RANK), atol=1e-5)
    assert not torch.allclose(stages[0].down.proj.weight, down)  # boundaries differ


def test_the_inner_stages_are_the_plain_models() -> None:
    plain = BuiltinGPT(CONFIG)
    wrapped = LowRankBoundary(plain, RANK).build_stage(1, 2, seed=5)
    inner = plain.build_stage(1, 2, seed=5)
    for (name, a), (_, b) in zip(inner.state_dict().items(),
                                 wrapped.inner.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_basis_is_a_pure_function_of_its_key() -> None:
    a, b = boundary_basis("k", 32, 8), boundary_basis("k", 32, 8)
    assert torch.equal(a, b) and not torch.equal(a, boundary_basis("k2", 32, 8))
    assert torch.allclose(a @ a.T, torch.eye(8), atol=1e-5)


def test_the_rank_is_in_the_fingerprint_and_zero_is_the_plain_model() -> None:
    plain = BuiltinGPT(CONFIG)
    assert with_boundary(plain, 0) is plain
    eight, four = LowRankBoundary(plain, 8), LowRankBoundary(plain, 4)
    assert len({plain.fingerprint().hash, eight.fingerprint().hash,
                four.fingerprint().hash}) == 3
    assert eight.fingerprint().fields["boundary_rank"] == 8
    assert eight.width == 8 and eight.num_blocks == plain.num_blocks


@pytest.mark.parametrize("rank", [32, 33, -1, True])
def test_a_rank_not_below_the_width_is_refused(rank: object) -> None:
    with pytest.raises(ValueError, match="boundary_rank"):
        LowRankBoundary(BuiltinGPT(CONFIG), rank)  # type: ignore[arg-type]


def test_the_setting_builds_the_boundary_and_is_checked_against_the_width() -> None:
    from swarmd.models.registry import seam_from_config

    seam, _ = seam_from_config(load_config(None, {"SWARMD_MODEL_BOUNDARY_RANK": "32"}, {}))
    assert isinstance(seam, LowRankBoundary) and seam.width == 32
    seam, _ = seam_from_config(load_config(None, {}, {}))
    assert isinstance(seam, BuiltinGPT)
    with pytest.raises(ConfigError, match="model.boundary_rank"):
        load_config(None, {"SWARMD_MODEL_BOUNDARY_RANK": "128"}, {})


def test_the_manifest_holds_the_rank_only_when_set() -> None:
    from swarmd.manifest.document import decode
    from swarmd.manifest.local import manifest_of
    from swarmd.manifest.settle import settle
    from swarmd.manifest.local import own_keys

    plain, _ = manifest_of(load_config(None, {}, {}))
    assert "model.boundary_rank" not in plain.settings
    low, _ = manifest_of(load_config(None, {"SWARMD_MODEL_BOUNDARY_RANK": "32"}, {}))
    assert low.settings["model.boundary_rank"] == 32 and low.hash != plain.hash
    assert decode(low.to_bytes(), expect_hash=low.hash) == low
    # a peer that set another rank is refused by the swarm, naming the setting
    mine = load_config(None, {"SWARMD_MODEL_BOUNDARY_RANK": "16"}, {})
    ours, _ = manifest_of(mine)
    lines = [d.line() for d in settle(ours, own_keys(mine, ours), low).conflicts]
    assert lines == ["model.boundary_rank = 16 here, 32 in the swarm"]
    # a volunteer with no settings takes it
    volunteer = load_config(None, {}, {})
    outcome = settle(plain, own_keys(volunteer, plain), low)
    assert outcome.ok and "model.boundary_rank" in outcome.adopted


def test_a_manifest_holding_the_rank_at_its_default_is_malformed() -> None:
    import dataclasses

    from swarmd.manifest.local import manifest_of

    plain, _ = manifest_of(load_config(None, {}, {}))
    with pytest.raises(ValueError, match="boundary_rank"):
        dataclasses.replace(plain, settings={**plain.settings, "model.boundary_rank": 0})
    with pytest.raises(ValueError, match="boundary_rank"):
        dataclasses.replace(plain, settings={**plain.settings, "model.boundary_rank": "8"})


def test_a_received_tensor_of_the_models_width_is_refused_by_a_low_rank_stage() -> None:
    from swarmd.pipeline.messages import activation

    seam = LowRankBoundary(TRAINER_EMBEDS, RANK)
    activation(torch.zeros(1, 4, RANK), seam.width, 64, "activations")
    with pytest.raises(BadActivation) as caught:
        activation(torch.zeros(1, 4, 32), seam.width, 64, "activations")
    assert caught.value.reason == "shape"


def test_export_refuses_a_low_rank_boundary_naming_the_setting() -> None:
    from swarmd.export.parts import export_kind

    with pytest.raises(ModelError, match="model.boundary_rank = 8"):
        export_kind(LowRankBoundary(TRAINER_EMBEDS, RANK))
    assert export_kind(BuiltinGPT(CONFIG)) == "builtin"


@pytest.mark.integration
def test_one_step_through_a_low_rank_swarm_equals_one_process() -> None:
    """Two stage servers and a trainer over real libp2p (in this process, codec none) with
    the boundary: the stages accept rank-wide tensors, and the accumulated gradients of every
    part (projections included) are one process's."""
    import asyncio

    import uvloop

    from transport.codecs import CodecSpec

    from inprocess_swarm import two_stage_swarm

    seam = LowRankBoundary(TRAINER_EMBEDS, RANK)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (2, 16), generator=g),
                torch.randint(0, 64, (2, 16), generator=g)) for _ in range(2)]

    async def through_swarm() -> tuple[list[float], dict[str, torch.Tensor]]:
        async with two_stage_swarm(CONFIG, target_batch_size=1000, swarm="lowrank-test",
                                   codec=CodecSpec(name="none"), seam=seam,
                                   model_hash=seam.fingerprint().hash) as (servers, trainer):
            losses = await trainer.accumulate(batches)
            grads = {f"parts.{n}": p.grad for n, p in trainer.parts.named_parameters()}
            for s in servers:
                grads.update({f"stages.{s.stage}.{n}": p.grad
                              for n, p in s.module.named_parameters()})
            return losses, grads

    losses, grads = uvloop.run(asyncio.wait_for(through_swarm(), 120))
    trainer, stages = _parts(seam, 0)
    total = 0.0
    for x, y in batches:
        h = trainer.embed(x)
        for stage in stages:
            h = stage(h)
        loss = trainer.loss(trainer.head(h), y)
        (loss * x.shape[0]).backward()  # the swarm's gradients are sums over samples
        total += float(loss.detach())
    assert sum(losses) / len(losses) == pytest.approx(total / len(batches), rel=1e-6)
    expected = {**{f"parts.{n}": p.grad for n, p in trainer.named_parameters()},
                **{f"stages.{i}.{n}": p.grad for i, s in enumerate(stages)
                   for n, p in s.named_parameters()}}
    assert grads.keys() == expected.keys()
    assert {"parts.down.proj.weight", "stages.0.up.proj.weight",
            "stages.1.down.proj.weight"} <= set(grads)
    for name, r in expected.items():
        err = float((grads[name] - r).norm() / r.norm())
        assert err <= 1e-5, (name, err)


def test_a_hugging_face_model_takes_the_boundary_too() -> None:
    transformers = pytest.importorskip("transformers")
    from swarmd.models.hf import HFCausalLM

    inner = HFCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    seam = LowRankBoundary(inner, RANK)
    trainer = seam.build_trainer(seed=0)
    stages = [seam.build_stage(i, 2, seed=0) for i in range(2)]
    h = trainer.embed(tokens())
    assert seam.stage0_embeds and torch.equal(h, tokens())  # token ids: no boundary 0
    for stage in stages:
        h = stage(h)
        assert tuple(h.shape) == (2, 16, RANK)
    loss = trainer.loss(trainer.head(h), tokens())
    loss.backward()
    assert stages[1].up.proj.weight.grad is not None and trainer.up.proj.weight.grad is not None
    assert isinstance(stages[0].up, torch.nn.Identity) and isinstance(trainer.down,
                                                                       torch.nn.Identity)
    assert stages[0].inner.embed_tokens.weight.grad is not None
    assert seam.fingerprint().hash != inner.fingerprint().hash
