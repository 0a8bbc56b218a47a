"""Hugging Face causal language models as swarmd stages, from the real transformers classes.

``model.hf = DIR`` names a local directory with a ``config.json`` (and optionally
``*.safetensors`` weights and a ``tokenizer.json``). Two families are supported:

* rotary decoders: Llama, Mistral, Qwen2 and Qwen3 (rotary positions, RMSNorm, gated MLP,
  grouped-query attention): a stage holds its ``<Family>DecoderLayer`` s and its own rotary
  embedding; the trainer holds the final ``norm`` and ``lm_head``. ``embed_tokens`` is stage
  0's (the trainer sends token ids: ``ModelSeam.stage0_embeds``), or the trainer's when
  ``tie_word_embeddings`` ties it to ``lm_head``;
* GPT-2: a stage holds its ``GPT2Block`` s; the trainer holds ``wte``, ``wpe``, ``ln_f`` and
  ``lm_head`` (tied to ``wte`` as in GPT-2).

The modules are taken from the family's ``*ForCausalLM`` built on the meta device (no memory, no
RNG), so each stage materialises only its own layers. Attention runs through the same mask
functions (``transformers.masking_utils``) and attention implementation ("sdpa") as the full
model, so a stage-split model computes what the single-process one does. Nothing is fetched from
a hub: the config is built from the local file.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from swarmd.errors import ModelError
from swarmd.models.seam import Device, ModelSeam, Setting, TrainerParts
from swarmd.models.weights import Checkpoint, tensor_names

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
else:
    PreTrainedConfig = Any

__all__ = ["HFCausalLM", "SUPPORTED", "load_hf_config"]

log = logging.getLogger(__name__)

#: bump when the way a stage computes changes, so peers with the old code are refused
ARCH = "swarmd-hf/2"  # 2: stage 0 holds an untied embedding
#: config.json keys that change nothing in the computation (left out of the fingerprint)
_VOLATILE = frozenset({
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
    "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict",
    "use_cache", "_attn_implementation_autoset", "task_specific_params",
})
#: the attention implementation of every stage and of the reference model
ATTENTION = "sdpa"


@dataclass(frozen=True, slots=True)
class _Family:
    base: str        # attribute of the *ForCausalLM holding the decoder
    layers: str      # attribute of the decoder holding the layer list
    rotary: bool


_ROTARY = _Family("model", "layers", rotary=True)
#: model_type in config.json -> how its modules are laid out
SUPPORTED: dict[str, _Family] = {
    "llama": _ROTARY, "mistral": _ROTARY, "qwen2": _ROTARY, "qwen3": _ROTARY,
    "gpt2": _Family("transformer", "h", rotary=False),
}


def _supported() -> str:
    return ", ".join(sorted(SUPPORTED))


def load_hf_config(directory: Path | str) -> PreTrainedConfig:
    """The transformers config of ``directory/config.json``; :class:`ModelError` naming the
    file when it is missing, unreadable or of an unsupported architecture."""
    from transformers import AutoConfig

    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the model config ({exc.strerror}); model.hf "
                         f"must be a directory holding a config.json") from None
    except ValueError as exc:
        raise ModelError(f"{path}: not a JSON config ({exc})") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise ModelError(f"{path}: model_type {model_type!r} (architectures "
                         f"{raw.get('architectures')}) is not supported; supported model types: "
                         f"{_supported()}")
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{path}: not a valid {model_type} config ({exc})") from None


# ----------------------------------------------------------------------------- the modules

def _mask(make: Any, config: PreTrainedConfig, x: torch.Tensor,
          position_ids: torch.Tensor) -> Any:
    """A causal mask for ``x`` with no padding and no cache, from ``transformers.masking_utils``.
    Its first four arguments go by position: the fourth is ``past_key_values`` in transformers
    5.17 and ``cache`` in 5.25, and a keyword for either is refused by the other (seen on a
    machine with 5.17: every Llama stage failed its first forward)."""
    return make(config, x, None, None, position_ids=position_ids)


class RotaryStage(nn.Module):
    """A slice of a rotary decoder: (B, T, W) -> (B, T, W) through layers ``first..``; with
    ``embed_tokens`` (stage 0 of an untied model), token ids (B, T) -> (B, T, W)."""

    def __init__(self, config: PreTrainedConfig, layers: dict[int, nn.Module],
                 rotary: nn.Module, embed_tokens: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.rotary_emb = rotary
        types = getattr(config, "layer_types", None)
        sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None)
        self.kinds = {i: (types[i] if types else
                          "sliding_attention" if sliding else "full_attention") for i in layers}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import (
            create_causal_mask, create_sliding_window_causal_mask)

        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (B, T) ids -> (B, T, W)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
        masks = {kind: _mask(create_sliding_window_causal_mask if kind == "sliding_attention"
                             else create_causal_mask, self.config, x, position_ids)
                 for kind in set(self.kinds.values())}
        position_embeddings = self.rotary_emb(x, position_ids)  # cos, sin: (1, T, head_dim)
        for name, layer in self.layers.items():
            x = layer(x, attention_mask=masks[self.kinds[int(name)]],
                      position_embeddings=position_embeddings, position_ids=position_ids)
        return x


class GPT2Stage(nn.Module):
    """A slice of GPT-2's blocks: (B, T, W) -> (B, T, W)."""

    def __init__(self, config: PreTrainedConfig, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = _mask(create_causal_mask, self.config, x, position_ids)
        for layer in self.layers.values():
            x = layer(x, attention_mask=mask, position_ids=position_ids)
        return x


class RotaryTrainer(TrainerParts):
    """embed_tokens first (None: stage 0 holds it, the ids go on as they are); the final norm
    and lm_head last."""

    def __init__(self, embed_tokens: nn.Module | None, norm: nn.Module, lm_head: nn.Linear,
                 tied: bool) -> None:
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        if tied:
            assert embed_tokens is not None, "a tied embedding stays with the head"
            self.lm_head.weight = embed_tokens.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return tokens  # (B, T): stage 0 looks them up
        return self.embed_tokens(tokens)  # (B, T, W)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # (B, T, vocab)


class GPT2Trainer(TrainerParts):
    """wte + wpe (and dropout) first; ln_f and lm_head (tied to wte unless configured) last."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module, ln_f: nn.Module,
                 lm_head: nn.Linear, tied: bool) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop, self.ln_f, self.lm_head = wte, wpe, drop, ln_f, lm_head
        if tied:
            self.lm_head.weight = self.wte.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.wpe.num_embeddings:
            raise ValueError(f"sequence of length {tokens.shape[1]} is longer than the model's "
                             f"{self.wpe.num_embeddings} positions")
        pos = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        return self.drop(self.wte(tokens) + self.wpe(pos))         # (B, T, W)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


# ------------------------------------------------------------------------------- the seam

class HFCausalLM(ModelSeam):
    """A transformers causal LM config (and optionally its safetensors weights) as a seam."""

    def __init__(self, config: PreTrainedConfig, *, source: Path | None = None) -> None:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            raise ModelError(f"{source or 'model config'}: model_type {model_type!r} is not "
                             f"supported; supported model types: {_supported()}")
        self.config = copy.deepcopy(config)
        self.config._attn_implementation = ATTENTION
        self.family = SUPPORTED[model_type]
        self.source = source
        self.factory = "swarmd.models.hf:HFCausalLM"
        self._skeleton: nn.Module | None = None

    @classmethod
    def from_dir(cls, directory: Path | str) -> HFCausalLM:
        return cls(load_hf_config(directory), source=Path(directory))

    def checkpoint(self) -> Checkpoint | None:
        """The directory's safetensors weights, or None when it holds none."""
        if self.source is None or not any(self.source.glob("*.safetensors")):
            return None
        return Checkpoint(self.source)

    # ------------------------------------------------------------------ what the seam states
    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def width(self) -> int:
        return int(self.config.hidden_size)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def stage0_embeds(self) -> bool:
        """Rotary decoders whose embedding the head does not share: stage 0 holds it."""
        return self.family.rotary and not self.tied

    def settings(self) -> dict[str, Setting]:
        fields = {k: v for k, v in self.config.to_dict().items()
                  if k not in _VOLATILE and not k.startswith("_")}
        return {"arch": ARCH, **{f"hf.{k}": v for k, v in sorted(fields.items())}}

    def checkpoint_names(self, module: nn.Module) -> dict[str, str]:
        """The checkpoint (``save_pretrained``) name of each tensor of a stage or the trainer's
        parts built by this seam; a tied ``lm_head.weight`` is left out (it is the
        embedding's)."""
        base = self.family.base
        if isinstance(module, (RotaryStage, GPT2Stage)):
            rules = [("layers.", f"{base}.{self.family.layers}."),
                     ("embed_tokens.", f"{base}.embed_tokens.")]
        elif isinstance(module, RotaryTrainer):
            rules = [("embed_tokens.", f"{base}.embed_tokens."), ("norm.", f"{base}.norm.")]
        else:
            rules = [(f"{n}.", f"{base}.{n}.") for n in ("wte", "wpe", "ln_f")]
        if not self.tied:
            rules.append(("lm_head.", "lm_head."))
        return tensor_names(module, rules)

    # ---------------------------------------------------------------------- building parts
    def _parts(self) -> nn.Module:
        """The whole *ForCausalLM on the meta device: modules to copy, no memory used."""
        if self._skeleton is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                self._skeleton = AutoModelForCausalLM.from_config(self.config)
        return self._skeleton

    def _generator(self, part: str, seed: int) -> torch.Generator:
        digest = hashlib.sha256(f"{self.fingerprint().hash}/{part}/{seed}".encode()).digest()
        return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "big") >> 1)

    @torch.no_grad()
    def _init_(self, module: nn.Module, part: str, seed: int) -> None:
        """N(0, initializer_range) weights (GPT-2's residual projections scaled by
        1/sqrt(2 n_layer)), zero biases, unit norms: from a generator of (hash, part, seed)."""
        generator = self._generator(part, seed)
        std = float(getattr(self.config, "initializer_range", 0.02))
        scaled = self.config.model_type == "gpt2"
        for name, sub in module.named_modules():
            is_norm = "norm" in type(sub).__name__.lower()
            for pname, p in sub.named_parameters(recurse=False):
                if pname == "bias":
                    p.zero_()
                elif is_norm:
                    p.fill_(1.0)
                else:
                    s = std / math.sqrt(2 * self.num_blocks) if (
                        scaled and name.endswith("c_proj")) else std
                    p.normal_(0.0, s, generator=generator)

    def _finish(self, module: nn.Module, parts: list[tuple[str, nn.Module]], names: dict[str, str],
                *, seed: int, device: Device, dtype: torch.dtype,
                weights: Checkpoint | None, what: str) -> nn.Module:
        """Initialise each (materialised) part from its generator, or load the module's tensors
        from ``weights``; then move to ``device`` and ``dtype``."""
        if weights is None:
            for part, sub in parts:
                self._init_(sub, part, seed)
        else:
            weights.load_into(module, names, what=what)
        return module.to(device=device or "cpu", dtype=dtype)

    @staticmethod
    def _take(module: nn.Module) -> nn.Module:
        """A CPU copy of a skeleton's module, its tensors allocated but not yet filled."""
        return copy.deepcopy(module).to_empty(device="cpu", recurse=True)

    def build_stage(self, index: int, num_stages: int, *, seed: int = 0, device: Device = None,
                    dtype: torch.dtype = torch.float32,
                    weights: Checkpoint | None = None) -> nn.Module:
        ranges = self.stage_ranges(num_stages)
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} out of range: expected 0 to {num_stages - 1}")
        decoder = getattr(self._parts(), self.family.base)
        all_layers = getattr(decoder, self.family.layers)
        layers = {i: self._take(all_layers[i]) for i in ranges[index]}
        parts = [(f"block{i}", layer) for i, layer in layers.items()]
        if self.family.rotary:
            rotary = type(decoder.rotary_emb)(config=self.config)  # buffers computed on the CPU
            embed = None
            if index == 0 and self.stage0_embeds:  # the same generator as the trainer's was
                embed = self._take(decoder.embed_tokens)
                parts.insert(0, ("embedding", embed))
            stage: nn.Module = RotaryStage(self.config, layers, rotary, embed)
        else:
            stage = GPT2Stage(self.config, layers)
        stage = self._finish(stage, parts, self.checkpoint_names(stage), seed=seed,
                             device=device, dtype=dtype, weights=weights,
                             what=f"stage {index} of {num_stages}")
        if self.family.rotary:  # rotary frequencies stay float32 whatever the model's dtype
            stage.rotary_emb = type(decoder.rotary_emb)(config=self.config).to(device or "cpu")
        return stage

    def build_trainer(self, *, seed: int = 0, device: Device = None,
                      dtype: torch.dtype = torch.float32,
                      weights: Checkpoint | None = None) -> TrainerParts:
        full = self._parts()
        decoder = getattr(full, self.family.base)
        if self.family.rotary:
            norm, lm_head = self._take(decoder.norm), self._take(full.lm_head)
            parts = [("head", norm), ("lm_head", lm_head)]
            embed = None if self.stage0_embeds else self._take(decoder.embed_tokens)
            if embed is not None:
                parts.insert(0, ("embedding", embed))
            trainer: TrainerParts = RotaryTrainer(embed, norm, lm_head, self.tied)
        else:
            wte, wpe = self._take(decoder.wte), self._take(decoder.wpe)
            ln_f, lm_head = self._take(decoder.ln_f), self._take(full.lm_head)
            parts = [("embedding", wte), ("positions", wpe), ("head", ln_f), ("lm_head", lm_head)]
            trainer = GPT2Trainer(wte, wpe, copy.deepcopy(decoder.drop), ln_f, lm_head, self.tied)
        if self.tied:
            parts = [p for p in parts if p[0] != "lm_head"]  # the embedding's weight
        built = self._finish(trainer, parts, self.checkpoint_names(trainer), seed=seed,
                             device=device, dtype=dtype, weights=weights,
                             what="the trainer's embedding and head")
        assert isinstance(built, TrainerParts)
        return built
