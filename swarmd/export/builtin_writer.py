"""The built-in GPT from a swarm's parts: safetensors and a config swarmd loads.

* ``model.safetensors`` (sharded as the Hugging Face writer shards, with
  ``model.safetensors.index.json``, past ``max_shard_size``): the names
  ``swarmd.models.builtin.checkpoint_names`` gives (``embedding.*``, ``head.*``,
  ``blocks.<group>.*``), which ``BuiltinGPT.build_stage`` / ``build_trainer`` read with
  ``weights=Checkpoint(DIR)``;
* ``config.toml``: a swarmd config whose ``[model]`` is the swarm's (width, heads, layers,
  seq_len, share_layers, the export's dtype) and whose ``data.tokenizer`` is ``bytes`` or the
  ``tokenizer.json`` beside it (``swarmd.export.sample`` resolves it against the directory);
* the tokenizer file (``swarmd.export.tokenizer_files``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from swarmd.errors import InternalError
from swarmd.export.shards import write_shards
from swarmd.export.tokenizer_files import TokenizerFiles

__all__ = ["write_builtin", "CONFIG_NAME"]

CONFIG_NAME = "config.toml"


def write_builtin(directory: Path, seam: object, tensors: Mapping[str, torch.Tensor], *,
                  dtype: torch.dtype, tokenizer: TokenizerFiles,
                  max_shard_size: int | str) -> list[str]:
    """Write the model into ``directory``; the names of the files written."""
    from swarmd.models.builtin import checkpoint_names

    directory = Path(directory)
    config = seam.config  # type: ignore[attr-defined]  # swarmd.models.gpt.ModelConfig
    # every name of the whole model: the trainer's parts and all blocks as one stage
    expected = set(checkpoint_names(seam.build_trainer()).values())  # type: ignore[attr-defined]
    expected |= set(checkpoint_names(seam.build_stage(0, 1)).values())  # type: ignore[attr-defined]
    if set(tensors) != expected:
        raise InternalError(f"the parts' names do not cover the built-in GPT: missing "
                            f"{sorted(expected - set(tensors))[:5]}, unexpected "
                            f"{sorted(set(tensors) - expected)[:5]}")
    written = write_shards(directory, tensors, dtype=dtype, max_shard_size=max_shard_size)
    dtype_name = str(dtype).removeprefix("torch.")
    lines = ["# The built-in GPT exported by `swarmd export`: `swarmd sample --model DIR`",
             "[model]", f"width = {config.width}", f"heads = {config.heads}",
             f"layers = {config.layers}", f"seq_len = {config.seq_len}",
             f"share_layers = {config.share_layers}", f'dtype = "{dtype_name}"', "",
             "[data]", f"tokenizer = {json.dumps(tokenizer.spec)}", ""]
    (directory / CONFIG_NAME).write_text("\n".join(lines))
    written.append(CONFIG_NAME)
    written += tokenizer.copy_into(directory)
    return written
