"""The built-in byte-level GPT (``swarmd.models.gpt``) behind the model seam.

Stages cut between groups of shared layers (``model.share_layers``); stage 0 holds the
embedding (``ModelSeam.stage0_embeds``: the trainer sends it token ids, and no gradient comes
back to the trainer at hop 0), the trainer the head. Weights are initialised exactly as
:func:`swarmd.models.gpt.build_stage` and :func:`~swarmd.models.gpt.build_embedding` do, each
part from its own generator, so the model computes what :class:`~swarmd.models.gpt.FullModel`
does however it is cut. Pretrained weights, when given, are read from a safetensors
checkpoint whose names are those of one process's parts: ``embedding.*``, ``head.*`` and
``blocks.<group>.*`` (see :func:`checkpoint_names`).
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
    """The built-in model's :class:`~swarmd.models.gpt.Head`, and its
    :class:`~swarmd.models.gpt.Embedding` when stage 0 does not hold it (None: the ids go on
    as they are)."""

    def __init__(self, embedding: gpt.Embedding | None, head: gpt.Head) -> None:
        super().__init__()
        self.embedding, self.head_module = embedding, head

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embedding is None:
            return tokens  # (B, T): stage 0 looks them up
        return self.embedding(tokens)  # (B, T, width)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_module(hidden)


def checkpoint_names(module: nn.Module) -> dict[str, str]:
    """Checkpoint names of a built-in stage's or trainer's tensors: a stage's local block j is
    the checkpoint's ``blocks.<its global group>``; the embedding is ``embedding.*`` whoever
    holds it, the head ``head.*``."""
    names = {}
    for local in module.state_dict(keep_vars=True):
        if isinstance(module, gpt.Stage) and not local.startswith("embedding."):
            _, j, rest = local.split(".", 2)  # blocks.<j>.<rest>
            names[local] = f"blocks.{module.groups[int(j)]}.{rest}"
        else:
            part, rest = local.split(".", 1)
            names[local] = f"{'head' if part == 'head_module' else part}.{rest}"
    return names


class BuiltinGPT(ModelSeam):
    """The seam of :class:`~swarmd.models.gpt.ModelConfig`'s GPT. ``stage0_embeds``: where
    the embedding is (stage 0, what a swarm uses; False: the trainer, for tests of a hop 0
    that carries activations)."""

    def __init__(self, config: gpt.ModelConfig, *, stage0_embeds: bool = True) -> None:
        self.config = config
        self._stage0_embeds = stage0_embeds
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

    @property
    def stage0_embeds(self) -> bool:
        return self._stage0_embeds

    def settings(self) -> dict[str, Setting]:
        # (the cut is in the fingerprint: a peer that embeds at the trainer is another model
        # to us; the initial weights come from ModelConfig.model_hash(), which it leaves alone)
        fields = dataclasses.asdict(self.config) | {
            "arch": gpt.ARCH, "embedding": "stage 0" if self.stage0_embeds else "trainer"}
        fields["dropout"] = float(fields["dropout"])
        return fields

    def stage_ranges(self, num_stages: int) -> list[range]:
        return gpt.stage_layers(self.config, num_stages)

    def build_stage(self, index: int, num_stages: int, *, seed: int = 0, device: Device = None,
                    dtype: torch.dtype = torch.float32,
                    weights: Checkpoint | None = None) -> nn.Module:
        stage = gpt.build_stage(self.config, index, num_stages, seed, device="cpu",
                                embeds=index == 0 and self.stage0_embeds)
        if weights is not None:
            weights.load_into(stage, checkpoint_names(stage), what=f"stage {index} of {num_stages}")
        return stage.to(device=device or "cpu", dtype=dtype)

    def build_trainer(self, *, seed: int = 0, device: Device = None,
                      dtype: torch.dtype = torch.float32,
                      weights: Checkpoint | None = None) -> TrainerParts:
        embedding = None if self.stage0_embeds else gpt.build_embedding(self.config, seed,
                                                                          device="cpu")
        trainer = BuiltinTrainer(embedding, gpt.build_head(self.config, seed, device="cpu"))
        if weights is not None:
            weights.load_into(trainer, checkpoint_names(trainer), what="the trainer's head")
        return trainer.to(device=device or "cpu", dtype=dtype)
