"""A compression-aware stage boundary (SWARM's): a learned low-rank projection at every hop.

With ``model.boundary_rank = r`` (0: off), every part of the model ends with a learned linear
``down`` (width d -> r) and the next part begins with a learned ``up`` (r -> d, with a bias):
the trainer's embedding sends r values a token to stage 0, each stage receives r and sends r,
and the head receives r. So what travels between stages, both ways (activations and their
gradients), is r / d of the plain model's values; the wire codec still quantizes it.

:class:`LowRankBoundary` wraps any :class:`~swarmd.models.seam.ModelSeam`: its parts are the
inner model's, each between its boundaries' projections; its :attr:`~LowRankBoundary.width` is
r (what a stage server checks received tensors against), its settings the inner model's plus
``boundary_rank`` (so peers with another rank have another fingerprint). The projections are
ordinary parameters of their part: averaged among a stage's peers and checkpointed with it.

Boundary ``b`` of ``n`` stages lies before part ``b`` (0: between the embedding and stage 0,
``n``: between the last stage and the head). Its ``down`` and ``up`` start as one random
orthonormal basis Q (r x d) drawn from (the inner model's fingerprint, ``b``, ``n``, seed):
``down = Q``, ``up = Q^T`` with a zero bias, so ``up(down(x))`` starts as the orthogonal
projection of x onto a random r-dimensional subspace, the same on every peer. A model built
from pretrained weights (its seam's ``own_weights``) is treated alike; initialising from the
principal components of measured activations is not done (docs/compression.md).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from swarmd.models.seam import Device, ModelSeam, Setting, TrainerParts

__all__ = ["Down", "Up", "BoundaryStage", "BoundaryTrainer", "LowRankBoundary",
           "boundary_basis", "with_boundary"]


class Down(nn.Module):
    """The sending side of a boundary: (B, T, d) -> (B, T, r), no bias."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, rank, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Up(nn.Module):
    """The receiving side of a boundary: (B, T, r) -> (B, T, d), with a bias (the residual
    stream's shared offset need not travel)."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(rank, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class BoundaryStage(nn.Module):
    """One stage of the inner model between its boundaries: (B, T, r) -> up -> the inner
    stage (B, T, d) -> down -> (B, T, r). Stage 0 of an inner model whose stage 0 embeds
    (``stage0_embeds``) takes token ids: ``up`` is the identity there (no boundary 0)."""

    def __init__(self, inner: nn.Module, up: nn.Module, down: Down) -> None:
        super().__init__()
        self.up, self.inner, self.down = up, inner, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.inner(self.up(x)))


class BoundaryTrainer(TrainerParts):
    """The inner model's trainer parts: the embedding followed by boundary 0's ``down`` (the
    identity when stage 0 embeds: token ids go on as they are), the head preceded by the last
    boundary's ``up``."""

    def __init__(self, inner: TrainerParts, down: nn.Module, up: Up) -> None:
        super().__init__()
        self.inner, self.down, self.up = inner, down, up

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(self.inner.embed(tokens))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.head(self.up(hidden))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner.loss(logits, targets)


def boundary_basis(key: str, width: int, rank: int) -> torch.Tensor:
    """A random (rank, width) matrix with orthonormal rows, a pure function of ``key``."""
    digest = hashlib.sha256(key.encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "big") >> 1)
    gaussian = torch.randn(width, rank, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)          # q: (width, rank), orthonormal columns
    q = q * torch.sign(torch.diagonal(r))     # a unique basis for a given draw
    return q.T.to(torch.float32).contiguous()  # (rank, width)


class LowRankBoundary(ModelSeam):
    """``inner`` with a learned ``width -> rank -> width`` projection at every stage boundary
    (the module's doc)."""

    def __init__(self, inner: ModelSeam, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank < inner.width:
            raise ValueError(f"model.boundary_rank = {rank!r}: expected an integer from 1 to "
                             f"{inner.width - 1} (below the model's width {inner.width}), or 0 "
                             f"(off)")
        self.inner, self.rank = inner, rank
        self.factory = inner.factory

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.inner.max_seq_len

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def width(self) -> int:
        """What travels between parts: ``rank`` values a token."""
        return self.rank

    @property
    def stage0_embeds(self) -> bool:
        """As the inner model's: token ids then need no boundary 0."""
        return self.inner.stage0_embeds

    def settings(self) -> dict[str, Setting]:
        return {**self.inner.settings(), "boundary_rank": self.rank}

    def own_weights(self) -> object | None:
        return self.inner.own_weights()

    def stage_ranges(self, num_stages: int) -> list[range]:
        return self.inner.stage_ranges(num_stages)

    def _pair(self, boundary: int, num_stages: int, seed: int) -> tuple[Down, Up]:
        """Boundary ``boundary``'s projections, initialised as the module's doc says. The
        first and last boundaries are keyed by position alone: the trainer's parts do not
        know how many stages lie between them."""
        d, r = self.inner.width, self.rank
        where = ("first" if boundary == 0 else "last" if boundary == num_stages
                 else f"{boundary}/{num_stages}")
        basis = boundary_basis(f"{self.inner.fingerprint().hash}/boundary/{where}/{r}/{seed}",
                               d, r)
        down, up = Down(d, r), Up(d, r)
        with torch.no_grad():
            down.proj.weight.copy_(basis)
            up.proj.weight.copy_(basis.T)
            up.proj.bias.zero_()
        return down, up

    def build_stage(self, index: int, num_stages: int, *, seed: int = 0,
                    device: Device = None, dtype: torch.dtype = torch.float32,
                    weights: object | None = None) -> nn.Module:
        inner = self.inner.build_stage(index, num_stages, seed=seed, device=device, dtype=dtype,
                                       weights=weights)
        up: nn.Module = nn.Identity() if index == 0 and self.stage0_embeds else self._pair(
            index, num_stages, seed)[1]
        down, _ = self._pair(index + 1, num_stages, seed)
        return BoundaryStage(inner, up, down).to(device=device or "cpu", dtype=dtype)

    def build_trainer(self, *, seed: int = 0, device: Device = None,
                      dtype: torch.dtype = torch.float32,
                      weights: object | None = None) -> TrainerParts:
        inner = self.inner.build_trainer(seed=seed, device=device, dtype=dtype, weights=weights)
        down: nn.Module = nn.Identity() if self.stage0_embeds else self._pair(0, 1, seed)[0]
        _, up = self._pair(1, 1, seed)     # the last
        return BoundaryTrainer(inner, down, up).to(device=device or "cpu", dtype=dtype)


def with_boundary(seam: ModelSeam, rank: int) -> ModelSeam:
    """``seam`` itself for ``rank`` 0, else :class:`LowRankBoundary` ``(seam, rank)``."""
    return seam if rank == 0 else LowRankBoundary(seam, rank)
