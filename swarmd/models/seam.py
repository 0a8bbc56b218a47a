"""The model seam: what a model provides to swarmd, whatever its architecture.

A model is cut into the trainer's parts (embedding first, head and loss last: one module, so
tied input/output embeddings stay one parameter) and ``num_stages`` contiguous slices of its
blocks, one per pipeline stage. Between two stages travels one activation of
:meth:`ModelSeam.activation` shape and dtype. Everything else is the model's business:

=====================================  ==========================================================
``seam.fingerprint(dtype, optimizer)``  what peers compare: a hash over the factory, every
                                        setting that changes the computation, dtype, optimizer
``seam.stage_ranges(num_stages)``       the blocks of each stage (contiguous, covering all once)
``seam.build_stage(i, n, ...)``         stage i of n: an ``nn.Module`` (B, T, W) -> (B, T, W),
                                        initialised deterministically or loaded from weights
``seam.build_trainer(...)``             :class:`TrainerParts`: ``embed``, ``head``, ``loss``
``seam.activation(batch, seq_len)``     the shape and dtype between stages
``seam.stage0_embeds``                  whether stage 0 holds the token embedding: the trainer
                                        then sends token ids (B, T) to stage 0 (its ``embed``
                                        returns them as they are) and gets no gradient back
=====================================  ==========================================================

Initialisation depends only on (fingerprint, part, seed), never on the global RNG, so every peer
of a stage starts from identical weights. With ``weights`` given, a part reads exactly its own
tensors from the checkpoint (``swarmd.models.weights``) and nothing else.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from swarmd.errors import ModelMismatch

__all__ = ["Device", "ActivationSpec", "Fingerprint", "TrainerParts", "ModelSeam", "split_evenly",
           "fingerprint_of", "check_fingerprint"]

#: a JSON-able value in a fingerprint
Setting = str | int | float | bool | None | tuple | list
#: where a part is built
Device = torch.device | str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationSpec:
    """The tensor between two stages: ``shape`` (batch, seq_len, width) and ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    """What two peers must agree on to train together: ``hash`` is a digest of ``fields``."""

    fields: Mapping[str, Setting] = field(default_factory=dict)
    hash: str = ""

    def differences(self, other: Mapping[str, Setting]) -> list[str]:
        """``key: ours vs theirs`` for every field that differs, sorted by key."""
        keys = sorted(set(self.fields) | set(other))
        missing = "(absent)"
        return [f"{k}: {self.fields.get(k, missing)!r} here vs {other.get(k, missing)!r} there"
                for k in keys if self.fields.get(k, missing) != other.get(k, missing)]


def fingerprint_of(fields: Mapping[str, Setting]) -> Fingerprint:
    """The fingerprint of ``fields``: a 16-hex-digit sha256 of their canonical JSON."""
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), default=str)
    return Fingerprint(fields=dict(json.loads(canonical)),
                       hash=hashlib.sha256(canonical.encode()).hexdigest()[:16])


def check_fingerprint(ours: Fingerprint, their_hash: str,
                      their_fields: Mapping[str, Setting] | None = None) -> None:
    """Raise :class:`ModelMismatch` naming what differs when a peer's model is not ours."""
    if their_hash == ours.hash:
        return
    if their_fields is None:
        raise ModelMismatch(f"model hash {their_hash} differs from ours ({ours.hash}); the peer "
                            f"did not say which setting differs")
    diffs = ours.differences(their_fields) or ["(same fields, another hash: another code version)"]
    raise ModelMismatch(f"model hash {their_hash} differs from ours ({ours.hash}): "
                        + "; ".join(diffs))


def split_evenly(blocks: int, num_stages: int, *, unit: int = 1) -> list[range]:
    """Cut ``blocks`` (in groups of ``unit``) into ``num_stages`` contiguous ranges; the first
    ``groups % num_stages`` stages hold one group more."""
    groups = blocks // unit
    if not isinstance(num_stages, int) or not 1 <= num_stages <= groups:
        raise ValueError(f"cannot cut {blocks} blocks into {num_stages} stages: the number of "
                         f"stages must be from 1 to {groups}")
    base, extra = divmod(groups, num_stages)
    ranges, start = [], 0
    for index in range(num_stages):
        end = start + (base + (index < extra)) * unit
        ranges.append(range(start, end))
        start = end
    return ranges


class TrainerParts(nn.Module, abc.ABC):
    """The trainer's side of a model: tokens (B, T) -> activation (B, T, W) -> logits -> loss."""

    @abc.abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) int64 -> the first stage's input: (B, T, W), or the ids themselves
        when stage 0 holds the embedding (``ModelSeam.stage0_embeds``)."""

    @abc.abstractmethod
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's output (B, T, W) -> logits (B, T, vocab)."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of logits (B, T, vocab) against targets (B, T), in float32."""
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                           targets.reshape(-1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not used
        raise TypeError("call embed() and head() of the trainer's parts, not the module itself")


class ModelSeam(abc.ABC):
    """One model as swarmd sees it. Implementations: :class:`swarmd.models.builtin.BuiltinGPT`,
    :class:`swarmd.models.hf.HFCausalLM`, or a user's own behind ``model.factory``."""

    #: ``"package.module:callable"`` that built this seam (set by the registry)
    factory: str = ""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids the embedding accepts: 0 to vocab_size - 1."""

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int:
        """Longest sequence the model takes."""

    @property
    @abc.abstractmethod
    def num_blocks(self) -> int:
        """Blocks (layers) the stages share out."""

    @property
    @abc.abstractmethod
    def width(self) -> int:
        """Last dimension of the activation between stages."""

    @abc.abstractmethod
    def settings(self) -> dict[str, Setting]:
        """Every setting that changes the computation, JSON-able (hashed by fingerprint)."""

    @abc.abstractmethod
    def build_stage(self, index: int, num_stages: int, *, seed: int = 0,
                    device: Device = None, dtype: torch.dtype = torch.float32,
                    weights: object | None = None) -> nn.Module:
        """Stage ``index`` of ``num_stages``: holds only its own blocks."""

    @abc.abstractmethod
    def build_trainer(self, *, seed: int = 0, device: Device = None,
                      dtype: torch.dtype = torch.float32,
                      weights: object | None = None) -> TrainerParts:
        """The trainer's embedding, head and loss."""

    @property
    def stage0_embeds(self) -> bool:
        """Whether stage 0 looks the tokens up (its module takes token ids (B, T) int64) and
        the trainer's ``embed`` hands the ids on unchanged: hop 0 then carries a few bytes a
        token instead of a compressed activation, and its gradient need not travel back.
        Only for an embedding the head does not share (tied weights stay with the trainer)."""
        return False

    def own_weights(self) -> object | None:
        """The weights a model directory ships (its ``checkpoint()``), None for a seam that
        has none: parts are then initialised deterministically."""
        checkpoint = getattr(self, "checkpoint", None)
        return checkpoint() if callable(checkpoint) else None

    def stage_ranges(self, num_stages: int) -> list[range]:
        """The blocks of each stage; override to cut elsewhere (e.g. between shared groups)."""
        return split_evenly(self.num_blocks, num_stages)

    def activation(self, batch_size: int, seq_len: int,
                   dtype: torch.dtype = torch.float32) -> ActivationSpec:
        """What travels between stages for ``batch_size`` sequences of ``seq_len`` tokens."""
        return ActivationSpec(shape=(batch_size, seq_len, self.width), dtype=dtype)

    def fingerprint(self, *, dtype: str = "float32", optimizer: str = "adamw") -> Fingerprint:
        """The fingerprint peers compare: factory, settings, dtype and optimizer."""
        return fingerprint_of({"factory": self.factory or type(self).__qualname__,
                               **self.settings(), "dtype": dtype, "optimizer": optimizer})
