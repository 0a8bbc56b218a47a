"""The built-in byte-level GPT (``swarmd.models.gpt``) behind the model seam.

Stages cut between groups of shared layers (``model.share_layers``); weights are initialised
exactly as :func:`swarmd.models.gpt.build_stage` does, so a swarm that used the built-in
model before the seam computes the same. Pretrained weights, when given, are read from a
safetensors checkpoint whose names are those of one process's parts: ``embedding.*``,
``head.*`` and ``blocks.<group>.*`` (see :func:`checkpoint_names`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from swarmd.models.seam import Device, ModelSeam, Setting, TrainerParts
from swarmd.models.weights import Checkpoint
from swarmd.models import gpt

__all__ = ["BuiltinGPT", "BuiltinTrainer", "checkpoint_names"]


class BuiltinTrainer(TrainerParts):
    """The built-in model's :class:`~swarmd.models.gpt.Embedding` and
    :class:`~swarmd.models.gpt.Head`."""

    def __init__(self, embedding: gpt.Embedding, head: gpt.Head) -> None:
        super().__init__()
        self.embedding, self.head_module = embedding, head

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_module(hidden)


def checkpoint_names(module: nn.Module) -> dict[str, str]:
    """Checkpoint names of a built-in stage's or trainer's tensors: a stage's local block j is
    the checkpoint's ``blocks.<its global group>``; the trainer's are ``embedding.*``,
    ``head.*``."""
    names = {}
    for local in module.state_dict(keep_vars=True):
        if isinstance(module, gpt.Stage):
            _, j, rest = local.split(".", 2)  # blocks.<j>.<rest>
            names[local] = f"blocks.{module.groups[int(j)]}.{rest}"
        else:
            part, rest = local.split(".", 1)
            names[local] = f"{'head' if part == 'head_module' else part}.{rest}"
    return names


class BuiltinGPT(ModelSeam):
    """The seam of :class:`~swarmd.models.gpt.ModelConfig`'s GPT."""

    def __init__(self, config: gpt.ModelConfig) -> None:
        self.config = config
        self.factory = "swarmd.models.builtin:BuiltinGPT"

    @property
    def vocab_size(self) -> int:
        return self.config.vocab

    @property
    def max_seq_len(self) -> int:
        return self.config.seq_len

    @property
    def num_blocks(self) -> int:
        return self.config.layers

    @property
    def width(self) -> int:
        return self.config.width

    def settings(self) -> dict[str, Setting]:
        fields = dataclasses.asdict(self.config) | {"arch": gpt.ARCH}
        fields["dropout"] = float(fields["dropout"])
        return fields

    def stage_ranges(self, num_stages: int) -> list[range]:
        return gpt.stage_layers(self.config, num_stages)

    def build_stage(self, index: int, num_stages: int, *, seed: int = 0, device: Device = None,
                    dtype: torch.dtype = torch.float32,
                    weights: Checkpoint | None = None) -> nn.Module:
        stage = gpt.build_stage(self.config, index, num_stages, seed, device="cpu")
        if weights is not None:
            weights.load_into(stage, checkpoint_names(stage), what=f"stage {index} of {num_stages}")
        return stage.to(device=device or "cpu", dtype=dtype)

    def build_trainer(self, *, seed: int = 0, device: Device = None,
                      dtype: torch.dtype = torch.float32,
                      weights: Checkpoint | None = None) -> TrainerParts:
        trainer = BuiltinTrainer(gpt.build_embedding(self.config, seed, device="cpu"),
                                 gpt.build_head(self.config, seed, device="cpu"))
        if weights is not None:
            weights.load_into(trainer, checkpoint_names(trainer),
                              what="the trainer's embedding and head")
        return trainer.to(device=device or "cpu", dtype=dtype)
