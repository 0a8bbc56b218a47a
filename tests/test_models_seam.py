"""The model seam: the built-in GPT behind it, the registry, fingerprints, and bad model input
(configs, factories, safetensors shards) stopping with a message naming file and fault."""

from __future__ import annotations

import json
import os
import struct
import sys
import textwrap

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmd.errors import ModelError, ModelMismatch
from swarmd.models.builtin import BuiltinGPT, checkpoint_names
from swarmd.models.registry import make_seam, resolve_factory
from swarmd.models.seam import ModelSeam, check_fingerprint, split_evenly
from swarmd.models.weights import Checkpoint
from swarmd.models.gpt import FullModel, ModelConfig

CONFIG = ModelConfig(vocab=64, width=32, heads=4, layers=4, seq_len=16)


@pytest.mark.parametrize("stage0_embeds", [True, False])
def test_builtin_seam_computes_what_the_full_model_computes(stage0_embeds: bool) -> None:
    """Stage 0 holds the embedding (the trainer sends it the ids) or the trainer does: the
    same initial weights either way, so the same logits as one process; the two cuts are
    two models to a peer (their fingerprints differ)."""
    seam = BuiltinGPT(CONFIG, stage0_embeds=stage0_embeds)
    trainer = seam.build_trainer(seed=2)
    stages = [seam.build_stage(i, 2, seed=2) for i in range(2)]
    full = FullModel(CONFIG, num_stages=2, seed=2)
    x = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    h = trainer.embed(x)
    assert seam.stage0_embeds == stage0_embeds == torch.equal(h, x)
    assert any(n.startswith("embedding.") for n, _ in trainer.named_parameters()) \
        != stage0_embeds
    for stage in stages:
        h = stage(h)
    assert seam.activation(2, 16) .shape == tuple(h.shape) == (2, 16, 32)
    logits, _ = full(x)
    assert torch.equal(trainer.head(h), logits)
    assert seam.fingerprint().fields["arch"] == "swarmd-gpt/1"
    assert seam.fingerprint().fields["embedding"] == ("stage 0" if stage0_embeds else "trainer")
    assert seam.fingerprint() != BuiltinGPT(CONFIG, stage0_embeds=not stage0_embeds).fingerprint()
    # the checkpoint's names do not say who holds what
    names = {*checkpoint_names(trainer).values(), *checkpoint_names(stages[0]).values()}
    assert {"embedding.wte.weight", "embedding.wpe.weight", "head.lm_head.weight"} <= names


def test_builtin_stages_cut_between_shared_groups() -> None:
    seam = BuiltinGPT(ModelConfig(layers=6, share_layers=2))
    assert seam.stage_ranges(2) == [range(0, 4), range(4, 6)]
    with pytest.raises(ValueError, match="from 1 to 3"):
        seam.stage_ranges(4)


@given(st.integers(1, 64), st.integers(1, 64))
def test_split_evenly_covers_every_block_once_contiguously(blocks: int, stages: int) -> None:
    if stages > blocks:
        with pytest.raises(ValueError):
            split_evenly(blocks, stages)
        return
    ranges = split_evenly(blocks, stages)
    assert [i for r in ranges for i in r] == list(range(blocks))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_fingerprint_covers_factory_settings_dtype_and_optimizer() -> None:
    base = BuiltinGPT(CONFIG).fingerprint()
    assert BuiltinGPT(CONFIG).fingerprint() == base
    others = [BuiltinGPT(ModelConfig(vocab=64, width=32, heads=2, layers=4, seq_len=16)),
              BuiltinGPT(CONFIG)]
    others[1].factory = "mypkg.models:gpt"
    hashes = {base.hash, others[0].fingerprint().hash, others[1].fingerprint().hash,
              BuiltinGPT(CONFIG).fingerprint(dtype="bfloat16").hash,
              BuiltinGPT(CONFIG).fingerprint(optimizer="lamb").hash}
    assert len(hashes) == 5
    with pytest.raises(ModelMismatch, match="factory: 'swarmd.models.builtin:BuiltinGPT' here "
                                            "vs 'mypkg.models:gpt' there"):
        check_fingerprint(base, others[1].fingerprint().hash, others[1].fingerprint().fields)
    with pytest.raises(ModelMismatch, match="did not say"):
        check_fingerprint(base, "0" * 16)


def test_registry_resolves_a_users_factory(tmp_path, monkeypatch) -> None:
    (tmp_path / "mymodel.py").write_text(textwrap.dedent("""
        from swarmd.models.builtin import BuiltinGPT
        def make(config):
            return BuiltinGPT(config)
        def not_a_seam(config):
            return 42
        VALUE = 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    seam = make_seam(CONFIG, factory="mymodel:make")
    assert isinstance(seam, ModelSeam) and seam.factory == "mymodel:make"
    assert seam.fingerprint().fields["factory"] == "mymodel:make"
    assert isinstance(make_seam(CONFIG), BuiltinGPT)
    cases = {"mymodel:not_a_seam": "returned int, not a swarmd.models.seam.ModelSeam",
             "mymodel:VALUE": "not callable", "mymodel:absent": "has no attribute absent",
             "no_such_module_xyz:make": "cannot import no_such_module_xyz",
             "not a factory": 'expected "package.module:callable"'}
    for spec, message in cases.items():
        with pytest.raises(ModelError, match=message):
            make_seam(CONFIG, factory=spec)
    with pytest.raises(ModelError, match="set one of them"):
        make_seam(CONFIG, factory="mymodel:make", hf=str(tmp_path))
    assert resolve_factory("mymodel:make") is sys.modules["mymodel"].make
    with pytest.raises(ModelError, match="expected"):  # "$" alone matched before a newline
        resolve_factory("mymodel:make\n")


# ----------------------------------------------------------------------------- bad input

def test_unsupported_or_broken_config_json_is_refused_naming_the_file(tmp_path) -> None:
    with pytest.raises(ModelError, match=r"config.json: cannot read the model config"):
        make_seam(CONFIG, hf=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ModelError, match=r"config.json: model_type 'bert' \(architectures "
                                         r"\['BertForMaskedLM'\]\) is not supported; supported "
                                         r"model types: gpt2, llama, mistral, qwen2, qwen3"):
        make_seam(CONFIG, hf=str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json: not a JSON config"):
        make_seam(CONFIG, hf=str(tmp_path))


def _save(path, tensors: dict[str, torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _builtin_checkpoint(seam: BuiltinGPT) -> dict[str, torch.Tensor]:
    tensors = {}
    for part in (seam.build_trainer(seed=9), *(seam.build_stage(i, 2, seed=9) for i in range(2))):
        own = part.state_dict()
        tensors |= {remote: own[local] for local, remote in checkpoint_names(part).items()}
    return tensors


def test_builtin_loads_pretrained_slices(tmp_path) -> None:
    seam = BuiltinGPT(CONFIG)
    _save(tmp_path / "model.safetensors", _builtin_checkpoint(seam))
    stage = seam.build_stage(1, 2, weights=Checkpoint(tmp_path))
    assert all(torch.equal(a, b) for a, b in
               zip(stage.state_dict().values(), seam.build_stage(1, 2, seed=9).state_dict().values()))


def test_missing_or_misshapen_tensor_is_refused_naming_the_file(tmp_path) -> None:
    seam = BuiltinGPT(CONFIG)
    tensors = _builtin_checkpoint(seam)
    victim = "blocks.3.mlp.c_fc.weight"
    _save(tmp_path / "model.safetensors", {k: v for k, v in tensors.items() if k != victim})
    with pytest.raises(ModelError, match=rf"tensor {victim} \(stage 1 of 2\) is missing from the "
                                         r"checkpoint \(model.safetensors\)"):
        seam.build_stage(1, 2, weights=Checkpoint(tmp_path))
    seam.build_stage(0, 2, weights=Checkpoint(tmp_path))  # stage 0 needs none of it
    _save(tmp_path / "model.safetensors", tensors | {victim: torch.zeros(3, 5)})
    with pytest.raises(ModelError, match=rf"model.safetensors: tensor {victim} \(stage 1 of 2\) "
                                         r"has shape \[3, 5\], the model expects \[128, 32\]"):
        seam.build_stage(1, 2, weights=Checkpoint(tmp_path))


def test_damaged_safetensors_file_is_refused_naming_the_file(tmp_path) -> None:
    seam = BuiltinGPT(CONFIG)
    path = tmp_path / "model.safetensors"
    _save(path, _builtin_checkpoint(seam))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ModelError, match="model.safetensors: not a usable safetensors file "
                                         r"\(.*damaged, truncated or not safetensors\)"):
        seam.build_stage(1, 2, weights=Checkpoint(tmp_path))
    path.write_bytes(struct.pack("<Q", 5) + b"[1,2]")
    with pytest.raises(ModelError, match="model.safetensors: not a usable safetensors file"):
        seam.build_stage(1, 2, weights=Checkpoint(tmp_path))
    path.write_bytes(b"abc")
    with pytest.raises(ModelError, match="header too small"):
        seam.build_stage(1, 2, weights=Checkpoint(tmp_path))
    path.unlink()
    with pytest.raises(ModelError, match=r"no \*.safetensors file here"):
        Checkpoint(tmp_path)


def test_seam_from_config_fits_the_builtin_vocabulary_to_the_tokenizer(tmp_path) -> None:
    from swarmd.config import load_config
    from swarmd.models.registry import fingerprint_from_config, seam_from_config
    from swarmd.training.tokens import train_bpe

    seam, tok = seam_from_config(load_config(None, {}, {}))
    assert isinstance(seam, BuiltinGPT) and seam.vocab_size == tok.vocab_size == 256
    path = train_bpe(["words and more words, " * 50, "other words"], 270, tmp_path)
    config = load_config(None, {"SWARMD_DATA_TOKENIZER": str(path),
                                "SWARMD_TRAINING_OPTIMIZER": "lamb"}, {})
    seam, tok = seam_from_config(config)
    assert seam.vocab_size == tok.vocab_size > 256
    fp = fingerprint_from_config(config, seam)
    assert fp.fields["optimizer"] == "lamb" and fp.fields["vocab"] == tok.vocab_size
