"""A GPT-style byte-level language model, cut into pipeline stages as in SWARM.

Stage 0 holds the :class:`Embedding` (tokens and positions in; ``build_stage(..., embeds=True)``,
as the swarm cuts it: ``swarmd.models.builtin``), the trainer the :class:`Head` (final
LayerNorm, logits, loss); each :class:`Stage` is a contiguous slice of the block list, served by
the peers of that stage. :class:`FullModel` chains the very same parts in one process: the
reference every pipeline result is compared with.

With ``share_layers = k``, each group of k consecutive layers applies one set of weights k times
(SWARM's experiments share layers this way); stage boundaries fall between groups.

Weights depend only on (model hash, part, seed), never on the global RNG, so every peer of a
stage starts from identical parameters. Blocks follow karpathy/nanoGPT's ``model.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn as nn
from torch.nn import functional as F

__all__ = [
    "ModelConfig", "CausalSelfAttention", "MLP", "Block", "Embedding", "Head", "Stage",
    "FullModel", "stage_layers", "build_embedding", "build_stage", "build_head",
    "resolve_device", "resolve_dtype", "wire_tensor", "DTYPES", "ARCH",
]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)

#: architecture tag hashed with the config: bump it when the computation below changes, so
#: peers running the old code are refused
ARCH = "swarmd-gpt/1"
#: names accepted for ``model.dtype``
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the model; equal configs (equal :meth:`model_hash`) train together."""

    vocab: int = 256        # bytes
    width: int = 128        # residual stream, n_embd in nanoGPT
    heads: int = 4
    layers: int = 4         # blocks applied, counting each shared application
    seq_len: int = 128      # longest context, size of the position table
    share_layers: int = 1   # consecutive layers sharing one set of weights
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "heads", "layers", "seq_len", "share_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} = {value!r}: expected a positive integer")
        if self.width % self.heads:
            raise ValueError(f"ModelConfig.width = {self.width} is not a multiple of "
                             f"ModelConfig.heads = {self.heads}")
        if self.layers % self.share_layers:
            raise ValueError(f"ModelConfig.share_layers = {self.share_layers} does not divide "
                             f"ModelConfig.layers = {self.layers}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout = {self.dropout!r}: expected a number in [0, 1)")

    @property
    def groups(self) -> int:
        """Number of distinct blocks: layers // share_layers."""
        return self.layers // self.share_layers

    def model_hash(self) -> str:
        """Short stable hex digest of the architecture; every announcement carries it."""
        fields = dataclasses.asdict(self) | {"arch": ARCH}
        fields["dropout"] = float(fields["dropout"])
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ the blocks

class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.width, 3 * config.width)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.width, config.width)      # residual projection
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.width, 4 * config.width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.width, config.width)  # residual projection
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


# ------------------------------------------------------------------ the parts of the pipeline

class Embedding(nn.Module):
    """Stage 0's, first: byte ids (B, T) -> token + position embeddings (B, T, width)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Embedding(config.seq_len, config.width)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len "
                             f"{self.seq_len}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, width)


class Head(nn.Module):
    """Trainer side, last: hidden states (B, T, width) -> logits (B, T, vocab), and the loss."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)  # not tied to wte

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of logits (B, T, vocab) against byte targets (B, T), in float32."""
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def stage_layers(config: ModelConfig, num_stages: int) -> list[range]:
    """The layers of each stage: contiguous, covering all layers once, cut between groups.

    The ``config.groups`` groups of ``share_layers`` layers are split as evenly as possible:
    the first ``groups % num_stages`` stages hold one group more than the others.
    """
    groups = config.groups
    if not isinstance(num_stages, int) or not 1 <= num_stages <= groups:
        shared = (f" of {config.share_layers} shared layers" if config.share_layers > 1 else "")
        raise ValueError(
            f"cannot cut {config.layers} layers ({groups} groups{shared}) into {num_stages} "
            f"stages: the number of stages must be from 1 to {groups}")
    base, extra = divmod(groups, num_stages)
    ranges, start = [], 0
    for index in range(num_stages):
        end = start + (base + (index < extra)) * config.share_layers
        ranges.append(range(start, end))
        start = end
    return ranges


class Stage(nn.Module):
    """Stage ``index`` of ``num_stages``: its distinct blocks, each applied share_layers times;
    with ``embeds`` (stage 0 only), the :class:`Embedding` first: byte ids (B, T) in."""

    def __init__(self, config: ModelConfig, index: int, num_stages: int, *,
                 embeds: bool = False) -> None:
        super().__init__()
        all_layers = stage_layers(config, num_stages)
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} out of range: expected 0 to {num_stages - 1}")
        self.index, self.num_stages, self.share = index, num_stages, config.share_layers
        self.layers = all_layers[index]
        #: global indices of this stage's distinct blocks
        self.groups = range(self.layers.start // self.share, self.layers.stop // self.share)
        self.blocks = nn.ModuleList(Block(config) for _ in self.groups)
        if embeds and index != 0:
            raise ValueError(f"only stage 0 can hold the embedding, not stage {index}")
        self.embedding = Embedding(config) if embeds else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)       # (B, T) ids -> (B, T, width)
        for block in self.blocks:       # (B, T, width) all the way
            for _ in range(self.share):
                x = block(x)
        return x


# --------------------------------------------------------------------- deterministic building

def _generator(config: ModelConfig, part: str, seed: int) -> torch.Generator:
    """A CPU generator seeded from (model hash, part, seed) alone."""
    digest = hashlib.sha256(f"{config.model_hash()}/{part}/{seed}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "big") >> 1)


@torch.no_grad()
def _init_(module: nn.Module, config: ModelConfig, generator: torch.Generator) -> None:
    """nanoGPT's init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2*layers)), zero bias."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            std = 0.02 / math.sqrt(2 * config.layers) if name.endswith("c_proj") else 0.02
            sub.weight.normal_(0.0, std, generator=generator)
            if sub.bias is not None:
                sub.bias.zero_()
        elif isinstance(sub, nn.Embedding):
            sub.weight.normal_(0.0, 0.02, generator=generator)
        elif isinstance(sub, nn.LayerNorm):
            sub.weight.fill_(1.0)
            sub.bias.zero_()


def _materialise(make: Callable[[], M], parts: Callable[[M], list[tuple[str, nn.Module]]],
                 config: ModelConfig, seed: int, device: torch.device | str | None,
                 dtype: torch.dtype) -> M:
    """Build on the meta device (so no global RNG is used), fill each part from its own
    generator on the CPU, then move to ``device`` and ``dtype``."""
    with torch.device("meta"):
        module = make()
    module.to_empty(device="cpu")
    for part, sub in parts(module):
        _init_(sub, config, _generator(config, part, seed))
    return module.to(device=device or "cpu", dtype=dtype)


def build_embedding(config: ModelConfig, seed: int = 0, *, device: torch.device | str | None = None,
                    dtype: torch.dtype = torch.float32) -> Embedding:
    """The trainer's embedding, initialised from (model hash, "embedding", seed)."""
    return _materialise(lambda: Embedding(config), lambda m: [("embedding", m)],
                        config, seed, device, dtype)


def build_head(config: ModelConfig, seed: int = 0, *, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.float32) -> Head:
    """The trainer's head, initialised from (model hash, "head", seed)."""
    return _materialise(lambda: Head(config), lambda m: [("head", m)], config, seed, device, dtype)


def build_stage(config: ModelConfig, index: int, num_stages: int, seed: int = 0, *,
                device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32, embeds: bool = False) -> Stage:
    """Stage ``index`` of ``num_stages``. Block g is initialised from (model hash, "block<g>",
    seed): a block's weights do not depend on how the model is cut. ``embeds`` (stage 0):
    the embedding too, initialised as :func:`build_embedding` does."""
    def parts(s: Stage) -> list[tuple[str, nn.Module]]:
        own = [(f"block{g}", b) for g, b in zip(s.groups, s.blocks)]
        return own if s.embedding is None else [("embedding", s.embedding), *own]

    return _materialise(lambda: Stage(config, index, num_stages, embeds=embeds), parts,
                        config, seed, device, dtype)


class FullModel(nn.Module):
    """Embedding, every stage in order, head, in one process: the reference for the swarm."""

    def __init__(self, config: ModelConfig, *, num_stages: int = 1, seed: int = 0,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embedding = build_embedding(config, seed, device=device, dtype=dtype)
        self.stages = nn.ModuleList(
            build_stage(config, i, num_stages, seed, device=device, dtype=dtype)
            for i in range(num_stages))
        self.head = build_head(config, seed, device=device, dtype=dtype)
        log.debug("model %s: %d parameters in %d stages", config.model_hash(),
                  sum(p.numel() for p in self.parameters()), num_stages)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Byte ids (B, T) -> logits (B, T, vocab), and the loss when targets (B, T) are given."""
        x = self.embedding(idx)  # (B, T, width)
        for stage in self.stages:
            x = stage(x)         # (B, T, width)
        logits = self.head(x)    # (B, T, vocab)
        loss = None if targets is None else self.head.loss(logits, targets)
        return logits, loss


# ------------------------------------------------------------------------- device and dtype

def resolve_device(name: str) -> torch.device:
    """``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    kind, sep, number = name.partition(":")
    if kind != "cuda" or (sep and not number.isdigit()):
        raise ValueError(f'unknown device "{name}": expected "auto", "cpu", "cuda" or "cuda:N"')
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f'device "{name}": CUDA is not available here (torch {torch.__version__}, '
                         f'{built}); use "cpu" or "auto"')
    count = torch.cuda.device_count()
    if number and int(number) >= count:
        raise ValueError(f'device "{name}": this machine has {count} CUDA device(s), '
                         f"cuda:0 to cuda:{count - 1}")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` as a torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f'unknown dtype "{name}": expected one of '
                         + ", ".join(f'"{n}"' for n in DTYPES)) from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's values as bytes, on the CPU, for hashing: one copy at most, never a Python
    loop over elements (``bytes(storage)`` is one: seconds for a few MB)."""
    data = t.detach().to("cpu").contiguous()
    return memoryview(data.reshape(-1).view(torch.uint8).numpy())


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """``t`` on ``device`` (and in ``dtype``): to a CUDA device from pinned memory without
    blocking the host (the compute that uses it is queued behind the copy), elsewhere as
    ``Tensor.to``."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device, dtype) if dtype is not None else t.to(device)
    src = t if t.is_pinned() else t.pin_memory()
    return src.to(device, dtype, non_blocking=True) if dtype is not None else src.to(
        device, non_blocking=True)


def wire_tensor(t: torch.Tensor) -> torch.Tensor:
    """What crosses the network: float32 on the CPU (the codecs quantize from there); token
    ids (integers) on the CPU as they are."""
    if not t.is_floating_point():
        return t.cpu()
    return t.to("cpu", torch.float32) if t.device.type != "cpu" or t.dtype != torch.float32 else t
