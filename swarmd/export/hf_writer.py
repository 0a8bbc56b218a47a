"""A Hugging Face model directory from a swarm's parts: what ``from_pretrained`` loads.

Written into a directory the caller owns (``swarmd.export.target.staging``):

* ``config.json``: the swarm's model config (``model.hf``'s), its ``architectures`` the
  family's ``*ForCausalLM`` and its ``dtype`` the export's;
* the weights, by their ``save_pretrained`` names (``swarmd.export.parts``), in safetensors
  files written by the ``safetensors`` library, split into shards by ``huggingface_hub``'s
  ``split_torch_state_dict_into_shards`` as ``save_pretrained`` splits them
  (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and
  ``model.safetensors.index.json`` past ``max_shard_size``);
* ``generation_config.json``: the model directory's, else one derived from the config;
* the tokenizer files (``swarmd.export.tokenizer_files``).

Before a byte is written the names are checked against the model's own: every tensor of the
``*ForCausalLM`` (built on the meta device: no memory) exactly once, a tied ``lm_head`` aside.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from swarmd.errors import InternalError
from swarmd.export.shards import INDEX_NAME, write_shards
from swarmd.export.tokenizer_files import TokenizerFiles

__all__ = ["write_hf", "DEFAULT_MAX_SHARD_SIZE", "INDEX_NAME"]

#: what ``save_pretrained`` shards at by default (transformers 5)
DEFAULT_MAX_SHARD_SIZE = "50GB"
GENERATION_CONFIG = "generation_config.json"


def write_hf(directory: Path, seam: object, tensors: Mapping[str, torch.Tensor], *,
             dtype: torch.dtype, tokenizer: TokenizerFiles,
             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write the model into ``directory``; the names of the files written."""
    directory = Path(directory)
    skeleton = seam._parts()  # type: ignore[attr-defined]  # the *ForCausalLM, meta device
    _check_names(skeleton, tensors, tied=bool(getattr(seam, "tied", False)))
    written = write_shards(directory, tensors, dtype=dtype, max_shard_size=max_shard_size)
    config = copy.deepcopy(seam.config)  # type: ignore[attr-defined]
    config.architectures = [type(skeleton).__name__]
    config.dtype = dtype
    config.save_pretrained(directory)
    written.append("config.json")
    written.append(_generation_config(directory, config, getattr(seam, "source", None)))
    written += tokenizer.copy_into(directory)
    return written


def _check_names(skeleton: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *,
                 tied: bool) -> None:
    expected = set(skeleton.state_dict()) - ({"lm_head.weight"} if tied else set())
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise InternalError(f"the parts' names do not cover {type(skeleton).__name__}: "
                            f"missing {missing[:5]}, unexpected {extra[:5]}")


def _generation_config(directory: Path, config: object, source: Path | None) -> str:
    from transformers import GenerationConfig

    own = Path(source) / GENERATION_CONFIG if source is not None else None
    if own is not None and own.is_file():
        shutil.copyfile(own, directory / GENERATION_CONFIG)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(directory)
    return GENERATION_CONFIG
