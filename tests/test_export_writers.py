"""The export's writers without a network: a Hugging Face model cut into stages and parts as a
swarm cuts it, written back by ``write_hf`` (one file, or shards with their index as
``save_pretrained`` writes them), computes what the original computes once
``from_pretrained`` loads it; tied embeddings stay tied; a model whose parameters the export
cannot name is refused before anything is fetched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmd.export.parts import export_kind, stage_part, trainer_part
from swarmd.export.tokenizer_files import tokenizer_files

transformers = pytest.importorskip("transformers")


def llama(directory: Path, *, tied: bool) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def exported(seam, stages: int) -> dict[str, torch.Tensor]:
    """Every part as a swarm's peers hold it, named back (``swarmd.export.parts``)."""
    weights = seam.own_weights()
    tensors: dict[str, torch.Tensor] = {}
    for i in range(stages):
        params = seam.build_stage(i, stages, weights=weights).state_dict()
        tensors.update(stage_part(seam, i, stages, params, dtype=torch.float32).tensors)
    params = seam.build_trainer(weights=weights).state_dict()
    tensors.update(trainer_part(seam, params, dtype=torch.float32).tensors)
    return tensors


@pytest.mark.parametrize("tied, shard", [(False, "50GB"), (True, 40_000)])
def test_an_hf_export_computes_what_the_original_computes(tmp_path: Path, tied: bool,
                                                          shard: int | str) -> None:
    from swarmd.export.hf_writer import write_hf
    from swarmd.models.hf import HFCausalLM

    source = llama(tmp_path / "source", tied=tied)
    seam = HFCausalLM.from_dir(source)
    out = tmp_path / "out"
    out.mkdir()
    files = write_hf(out, seam, exported(seam, 2), dtype=torch.float32,
                     tokenizer=tokenizer_files("bytes"), max_shard_size=shard)
    if isinstance(shard, int):  # sharded as save_pretrained shards, with its index
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards == sorted(f for f in files if f.endswith(".safetensors"))
        assert all(f.startswith("model-0000") for f in shards)
    else:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    assert loaded.config.tie_word_embeddings == tied
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, original(tokens).logits)


def test_an_hf_export_in_bfloat16_says_so(tmp_path: Path) -> None:
    from swarmd.export.hf_writer import write_hf
    from swarmd.models.hf import HFCausalLM

    seam = HFCausalLM.from_dir(llama(tmp_path / "source", tied=False))
    out = tmp_path / "out"
    out.mkdir()
    write_hf(out, seam, exported(seam, 2), dtype=torch.bfloat16,
             tokenizer=tokenizer_files("bytes"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_a_model_export_cannot_name_is_refused() -> None:
    from swarmd.errors import ModelError
    from swarmd.models.seam import ModelSeam

    class Custom(ModelSeam):  # a user's model.factory: its parameters have no known names
        vocab_size = max_seq_len = num_blocks = width = 1

        def settings(self):  # pragma: no cover - not called
            return {}

        def build_stage(self, *a, **k):  # pragma: no cover - not called
            raise AssertionError

        def build_trainer(self, *a, **k):  # pragma: no cover - not called
            raise AssertionError

    with pytest.raises(ModelError, match="Hugging Face models .* and the built-in GPT"):
        export_kind(Custom())
