"""Weights into safetensors files, split as ``save_pretrained`` splits them.

The ``safetensors`` library writes each file; ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` decides the split (one ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` past
``max_shard_size``). Used by the Hugging Face and the built-in writers alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["write_shards", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"


def write_shards(directory: Path, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
                 max_shard_size: int | str) -> list[str]:
    """``tensors`` in ``dtype`` into ``directory``; the names of the files written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    weights = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    split = split_torch_state_dict_into_shards(
        weights, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    written = []
    for filename, names in split.filename_to_tensors.items():
        save_file({n: weights[n] for n in names}, Path(directory) / filename,
                  metadata={"format": "pt"})
        written.append(filename)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(t.numel() for t in weights.values()),
                              **split.metadata},
                 "weight_map": dict(split.tensor_to_filename)}
        (Path(directory) / INDEX_NAME).write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX_NAME)
    return written
