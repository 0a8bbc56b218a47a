"""swarmd.models.gpt: stage slicing, deterministic init, and the exactness of pipeline gradients;
the [model] configuration keys."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from swarmd import config as C
from swarmd.config import Config, ConfigError, load_config
from swarmd.models.gpt import (
    Embedding, FullModel, Head, ModelConfig, Stage, build_embedding, build_head, build_stage,
    resolve_device, resolve_dtype, stage_layers,
)
from swarmd.models.registry import model_config_of

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
SMALL = ModelConfig(width=32, heads=4, layers=4, seq_len=16)


def batch(config: ModelConfig, b: int = 3, t: int | None = None, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    t = t or config.seq_len
    idx = torch.randint(0, config.vocab, (b, t + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def parts(config: ModelConfig, num_stages: int, seed: int = 0):
    return (build_embedding(config, seed),
            [build_stage(config, i, num_stages, seed) for i in range(num_stages)],
            build_head(config, seed))


def pipeline_grads(embedding: Embedding, stages: Sequence[Stage], head: Head, idx: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward the way the swarm computes them; the loss and the gradients, named
    as in :class:`FullModel` (``embedding.*``, ``stages.<i>.*``, ``head.*``).

    Each stage sees only a detached leaf copy of what the previous part sent it, as if it had
    come over the network; backward runs the other way, each stage given the gradient of its
    output and handing back the gradient of its input (``input.grad``)."""
    for module in (embedding, *stages, head):
        module.zero_grad(set_to_none=True)
    sent = embedding(idx)                                     # trainer: (B, T, width)
    inputs, outputs, x = [], [], sent
    for stage in stages:                                      # stage server i
        received = x.detach().clone().requires_grad_(True)
        inputs.append(received)
        outputs.append(stage(received))
        x = outputs[-1]
    hidden = x.detach().clone().requires_grad_(True)          # back at the trainer
    loss = head.loss(head(hidden), targets)
    loss.backward()
    grad = hidden.grad
    for received, output in zip(reversed(inputs), reversed(outputs)):
        torch.autograd.backward(output, grad)                 # stage server, backward
        grad = received.grad
    torch.autograd.backward(sent, grad)                       # trainer: into the embedding
    grads = {f"embedding.{n}": p.grad for n, p in embedding.named_parameters()}
    for i, stage in enumerate(stages):
        grads |= {f"stages.{i}.{n}": p.grad for n, p in stage.named_parameters()}
    grads |= {f"head.{n}": p.grad for n, p in head.named_parameters()}
    return loss.detach(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------ config, hash

@pytest.mark.parametrize(("kwargs", "field"), [
    ({"width": 0}, "width"), ({"heads": -1}, "heads"), ({"layers": 1.5}, "layers"),
    ({"seq_len": True}, "seq_len"), ({"vocab": 0}, "vocab"), ({"share_layers": 0}, "share_layers"),
    ({"width": 30, "heads": 4}, "width"), ({"layers": 6, "share_layers": 4}, "share_layers"),
    ({"dropout": 1.0}, "dropout"), ({"dropout": -0.1}, "dropout"),
])
def test_model_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field} ="):
        ModelConfig(**kwargs)


def test_model_hash_is_short_stable_and_discriminating():
    h = ModelConfig().model_hash()
    assert len(h) == 16 and int(h, 16) >= 0
    assert h == ModelConfig().model_hash()
    variants = [{"width": 64}, {"layers": 8}, {"layers": 8, "share_layers": 2}, {"seq_len": 64},
                {"dropout": 0.1}, {"heads": 8}]
    others = {ModelConfig(**v).model_hash() for v in variants}
    assert len(others) == 6 and h not in others


# ------------------------------------------------------------------------------ stage slicing

@pytest.mark.parametrize(("layers", "share", "stages"), [
    (4, 1, 1), (4, 1, 2), (4, 1, 4), (5, 1, 3), (7, 1, 2), (8, 2, 1), (8, 2, 2), (8, 2, 3),
    (8, 2, 4), (12, 3, 4), (12, 4, 2), (24, 2, 5), (6, 6, 1),
])
def test_stages_cover_every_layer_once_contiguously(layers, share, stages):
    config = ModelConfig(width=8, heads=2, layers=layers, share_layers=share)
    ranges = stage_layers(config, stages)
    assert len(ranges) == stages
    assert [i for r in ranges for i in r] == list(range(layers))
    assert all(len(r) > 0 and r.start % share == 0 and len(r) % share == 0 for r in ranges)
    sizes = [len(r) // share for r in ranges]
    assert max(sizes) - min(sizes) <= 1  # as even as possible
    for index, r in enumerate(ranges):
        with torch.device("meta"):
            stage = Stage(config, index, stages)
        assert stage.layers == r and len(stage.blocks) == len(r) // share


@pytest.mark.parametrize(("layers", "share", "stages", "works"), [
    (4, 1, 5, "1 to 4"), (8, 2, 5, "1 to 4"), (4, 1, 0, "1 to 4"), (6, 3, 3, "1 to 2"),
])
def test_invalid_splits_name_the_numbers(layers, share, stages, works):
    config = ModelConfig(width=8, heads=2, layers=layers, share_layers=share)
    with pytest.raises(ValueError) as info:
        stage_layers(config, stages)
    message = str(info.value)
    assert f"{layers} layers" in message and f"into {stages} stages" in message and works in message


def test_stage_index_out_of_range():
    for index in (2, -1):
        with pytest.raises(ValueError, match=f"stage index {index} out of range: expected 0 to 1"):
            build_stage(SMALL, index, 2)


# ------------------------------------------------------------------------------ building

def test_full_model_equals_parts_composed_by_hand():
    config = ModelConfig(width=32, heads=4, layers=6, share_layers=2, seq_len=16)
    idx, targets = batch(config)
    full = FullModel(config, num_stages=3, seed=5)
    embedding, stages, head = parts(config, 3, seed=5)
    x = embedding(idx)
    for stage in stages:
        x = stage(x)
    logits, loss = full(idx, targets)
    assert torch.equal(logits, head(x))
    assert torch.equal(loss, head.loss(head(x), targets))
    assert full(idx)[1] is None
    # the weights of a block do not depend on how the model is cut
    one = FullModel(config, num_stages=1, seed=5)
    assert torch.equal(one(idx, targets)[0], logits)


def test_init_ignores_and_keeps_global_rng():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = build_stage(SMALL, 1, 2, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())  # not consumed either
    torch.manual_seed(999)
    torch.rand(17)
    b = build_stage(SMALL, 1, 2, seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_init_is_identical_in_another_process(tmp_path):
    out = tmp_path / "stage.pt"
    code = ("import torch; from swarmd.models.gpt import ModelConfig, build_stage, build_head; "
            "c = ModelConfig(width=32, heads=4, layers=4, seq_len=16); "
            f"torch.save({{'hash': c.model_hash(), 'stage': build_stage(c, 1, 2, 3).state_dict(), "
            f"'head': build_head(c, 3).state_dict()}}, {str(out)!r})")
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, check=True, timeout=60)
    theirs = torch.load(out)
    assert theirs["hash"] == SMALL.model_hash()
    for name, mine in (("stage", build_stage(SMALL, 1, 2, 3)), ("head", build_head(SMALL, 3))):
        ours = mine.state_dict()
        assert list(ours) == list(theirs[name])
        assert all(torch.equal(ours[k], theirs[name][k]) for k in ours)


def test_different_stages_and_seeds_differ_and_init_has_nanogpt_scale():
    s0, s1 = build_stage(SMALL, 0, 2, seed=0), build_stage(SMALL, 1, 2, seed=0)
    s0b = build_stage(SMALL, 0, 2, seed=1)
    w = lambda s: s.blocks[0].attn.c_attn.weight  # noqa: E731
    assert not torch.equal(w(s0), w(s1)) and not torch.equal(w(s0), w(s0b))
    assert not torch.equal(build_head(SMALL, 0).lm_head.weight, build_head(SMALL, 1).lm_head.weight)
    big = build_stage(ModelConfig(width=256, heads=4, layers=8), 0, 1)
    assert abs(big.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 1e-3
    assert abs(big.blocks[0].mlp.c_proj.weight.std().item() - 0.02 / 4) < 1e-3
    assert big.blocks[0].attn.c_attn.bias.abs().max() == 0
    assert torch.equal(big.blocks[0].ln_1.weight, torch.ones(256))


def test_dtype_and_device_arguments():
    stage = build_stage(SMALL, 0, 2, dtype=torch.bfloat16, device="cpu")
    ref = build_stage(SMALL, 0, 2)
    for p, q in zip(stage.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
        assert torch.equal(p, q.to(torch.bfloat16))
    x = torch.randn(2, 8, SMALL.width, dtype=torch.bfloat16)
    assert stage(x).shape == (2, 8, SMALL.width)
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match='unknown dtype "fp8"'):
        resolve_dtype("fp8")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    for bad in ("gpu", "cuda:x", "cuda:", "tpu:0"):
        with pytest.raises(ValueError, match="expected"):
            resolve_device(bad)
    with pytest.raises(ValueError, match="cuda:99"):
        resolve_device("cuda:99")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_sequence_longer_than_seq_len_is_refused():
    with pytest.raises(ValueError, match="longer than the model's seq_len 16"):
        build_embedding(SMALL)(torch.zeros(1, 17, dtype=torch.long))


# ----------------------------------------------------------------- the exactness of the pipeline

@pytest.mark.parametrize(("layers", "share", "stages"), [
    (4, 1, 1), (4, 1, 2), (5, 1, 3), (6, 2, 3), (8, 2, 2),
])
def test_pipeline_gradients_equal_single_process_gradients(layers, share, stages):
    config = ModelConfig(width=32, heads=4, layers=layers, share_layers=share, seq_len=16)
    idx, targets = batch(config)
    embedding, stage_list, head = parts(config, stages, seed=7)
    loss, grads = pipeline_grads(embedding, stage_list, head, idx, targets)

    full = FullModel(config, num_stages=stages, seed=7)
    _, full_loss = full(idx, targets)
    full_loss.backward()
    assert torch.allclose(loss, full_loss.detach(), rtol=1e-6, atol=0)
    named = dict(full.named_parameters())
    assert set(grads) == set(named)
    for name, p in named.items():
        assert rel_err(grads[name], p.grad) <= 1e-5, name


def test_a_few_steps_learn():
    config = ModelConfig(width=32, heads=4, layers=2, seq_len=16)
    model = FullModel(config)
    idx, targets = batch(config, b=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(idx, targets)[1].item()
    assert abs(first - math.log(256)) < 0.1  # uniform guess at init
    for _ in range(20):
        opt.zero_grad()
        model(idx, targets)[1].backward()
        opt.step()
    assert model(idx, targets)[1].item() < first - 0.5


# ---------------------------------------------------------------------------- configuration

def test_model_config_from_config():
    assert model_config_of(Config()) == ModelConfig()
    config = load_config(None, {"SWARMD_MODEL_LAYERS": "8"},
                         {"model.share_layers": 2, "model.width": 64, "model.heads": 8,
                          "model.seq_len": 256, "model.dtype": "bfloat16",
                          "model.device": "cuda:1"})
    assert model_config_of(config) == ModelConfig(width=64, heads=8, layers=8, seq_len=256,
                                                share_layers=2)
    assert config.model.dtype == "bfloat16" and config.model.device == "cuda:1"
    assert isinstance(model_config_of(config), ModelConfig)
    assert config.training.batch_size == 8 and config.training.lr == 3e-3
    assert config.training.seed == 0


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"model.dtype": "fp16"}, 'command line flag: model.dtype = "fp16" is invalid'),
    ({"model.device": "gpu"}, 'command line flag: model.device = "gpu" is invalid'),
    ({"model.heads": 3}, "command line flag: model.heads = 3 is invalid: model.width (128)"),
    ({"model.share_layers": 3}, "command line flag: model.share_layers = 3 is invalid"),
    ({"swarm.stages": 5}, "command line flag: swarm.stages = 5 is invalid"),
    ({"model.layers": 1}, "command line flag: model.layers = 1 is invalid"),
    ({"training.lr": 0}, "command line flag: training.lr = 0 is invalid"),
    ({"training.batch_size": 0}, "command line flag: training.batch_size = 0 is invalid"),
])
def test_bad_model_keys_are_config_errors(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, overrides)
    assert needle in str(info.value)


def test_cross_check_blames_the_strongest_source(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nlayers = 2\n")
    with pytest.raises(ConfigError, match=r"^environment variable SWARMD_SWARM_STAGES: "
                                          r"swarm\.stages = 3 is invalid.*at most 2 stage"):
        load_config(path, {"SWARMD_SWARM_STAGES": "3"}, {})
    path.write_text("[model]\nlayers = 1\n")
    with pytest.raises(ConfigError, match=r"^.*c\.toml: model\.layers = 1 is invalid"):
        load_config(path, {}, {"swarm.stages": None})
    with pytest.raises(ConfigError, match=r"model\.heads = 5 is invalid"):
        Config(model=C.ModelSection(heads=5))  # direct construction checks it too


def test_unused_parameters_are_none():
    # every parameter takes part in the loss: nothing the trainer would have to special-case
    config = ModelConfig(width=16, heads=2, layers=2, seq_len=8)
    model = FullModel(config, num_stages=2)
    idx, targets = batch(config)
    model(idx, targets)[1].backward()
    assert all(isinstance(p.grad, torch.Tensor) for p in model.parameters())
