"""``swarmd sample``: text from an exported model.

The prompt is encoded with the tokenizer the swarm trained with (the export's manifest:
``bytes``, or its ``tokenizer.json``), then continued ``max_new_tokens`` tokens:

* a Hugging Face export: ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``generate``
  (sampling at ``temperature``; 0: greedy);
* the built-in GPT: its own modules (``swarmd.models.builtin``: all blocks as one stage,
  the embedding first, and the trainer's head) loaded from the directory's safetensors, and a plain
  loop: the last ``seq_len`` tokens in, the next token drawn from the softmax of the last
  logits over ``temperature``.

Randomness comes from ``seed`` alone: equal arguments, equal text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmd.errors import ConfigError, ModelError
from swarmd.export.manifest import ExportManifest
from swarmd.models.registry import model_config_of

__all__ = ["SampleResult", "sample"]


@dataclass(frozen=True)
class SampleResult:
    model: str
    prompt: str
    #: the continuation (the prompt not repeated)
    text: str
    tokens: int


def sample(directory: Path, prompt: str, *, max_new_tokens: int = 64,
           temperature: float = 0.8, seed: int = 0) -> SampleResult:
    if max_new_tokens < 1 or temperature < 0:
        raise ConfigError("swarmd sample needs --max-new-tokens >= 1 and --temperature >= 0")
    directory = Path(directory)
    manifest = ExportManifest.read(directory)
    tokenizer = _tokenizer(directory, manifest)
    ids = tokenizer.encode(prompt) or [tokenizer.eot]
    generator = torch.Generator().manual_seed(seed)
    if manifest.kind == "hf":
        new = _hf(directory, ids, max_new_tokens, temperature, seed)
    else:
        new = _builtin(directory, ids, max_new_tokens, temperature, generator)
    return SampleResult(model=str(directory), prompt=prompt, text=tokenizer.decode(new),
                        tokens=len(new))


def _tokenizer(directory: Path, manifest: ExportManifest) -> Any:
    from swarmd.training.tokens import load_tokenizer

    spec = manifest.tokenizer
    return load_tokenizer("bytes" if spec == "bytes" else str(directory / spec))


def _hf(directory: Path, ids: list[int], max_new: int, temperature: float,
        seed: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{directory}: transformers cannot load it ({exc})") from None
    model.eval()
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if limit:
        ids = ids[-max(1, limit - max_new):]
        max_new = min(max_new, limit - len(ids))
    if max_new < 1:
        return []
    torch.manual_seed(seed)  # generate() draws from the global generator
    options: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        options = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    pad = model.generation_config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=pad, **options)
    return out[0, len(ids):].tolist()


def _builtin(directory: Path, ids: list[int], max_new: int, temperature: float,
             generator: torch.Generator) -> list[int]:
    import dataclasses

    from swarmd.config import load_config
    from swarmd.models.builtin import BuiltinGPT
    from swarmd.models.weights import Checkpoint
    from swarmd.models.gpt import resolve_dtype
    from swarmd.training.tokens import load_tokenizer

    from swarmd.export.builtin_writer import CONFIG_NAME

    config = load_config(directory / CONFIG_NAME, {})
    spec = config.data.tokenizer
    vocab = load_tokenizer(spec if spec == "bytes" else str(directory / spec)).vocab_size
    seam = BuiltinGPT(dataclasses.replace(model_config_of(config), vocab=vocab))
    weights = Checkpoint(directory)
    dtype = resolve_dtype(config.model.dtype)
    parts = seam.build_trainer(weights=weights, dtype=dtype).eval()
    blocks = seam.build_stage(0, 1, weights=weights, dtype=dtype).eval()
    seq_len = seam.max_seq_len
    tokens = torch.tensor([ids])
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = parts.head(blocks(parts.embed(tokens[:, -seq_len:])))[0, -1].float()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            new.append(token)
            tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)
    return new
