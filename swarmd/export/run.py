"""One export: gather the parts (``swarmd.export.collect``), write the directory atomically.

:func:`export_model` is what ``swarmd export`` (through :mod:`swarmd.export.client`) and a
trainer's periodic export (:mod:`swarmd.export.periodic`) share: the target and the model are
checked before anything is downloaded, the parts gathered over the given host and view, and
the directory written in a temporary one next to ``out`` and renamed at the end
(``swarmd.export.target``): on any failure nothing is left in ``out``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmd.errors import ConfigError
from swarmd.export.collect import (Collected, CollectSettings, PartReport, PartsSource, Progress,
                                   SwarmView, collect)
from swarmd.export.manifest import ExportManifest
from swarmd.export.parts import export_kind
from swarmd.export.target import check_target, staging
from swarmd.export.tokenizer_files import tokenizer_files
from swarmd.models.registry import model_hash_of, model_seam_of

__all__ = ["ExportResult", "export_model", "EXPORT_DTYPES", "parse_dtype"]

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


@dataclass(frozen=True)
class ExportResult:
    out: str
    #: "hf" (a Hugging Face directory) or "builtin" (the built-in GPT)
    kind: str
    dtype: str
    #: the one step of every stage; None: a mixed cut (see ``parts``)
    step: int | None
    parts: tuple[PartReport, ...]
    files: tuple[str, ...]
    #: bytes of the files written
    bytes: int
    seconds: float


def parse_dtype(name: str) -> torch.dtype:
    if name not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {name!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


async def export_model(host: Any, view: SwarmView, config: Any, out: Path, *,
                       parts: PartsSource, dtype: str = "float32",
                       settings: CollectSettings = CollectSettings(),
                       max_shard_size: int | str = "50GB", replace: bool = False,
                       progress: Progress | None = None,
                       say: Callable[[str], None] = lambda line: None) -> ExportResult:
    """Export the model ``config`` trains, from the swarm ``host`` and ``view`` reach, into
    ``out`` (``replace``: an old export there is replaced, for the periodic export)."""
    from swarmd.models.gpt import resolve_dtype

    t0 = time.monotonic()
    wanted = parse_dtype(dtype)
    seam, _ = model_seam_of(config)
    kind = export_kind(seam)
    check_target(out, replace=replace)
    from swarmd.training.tokens import tokenizer_spec

    tokenizer = tokenizer_files(tokenizer_spec(config.data.tokenizer, config.model.hf))
    collected = await collect(host, view, seam, swarm=config.swarm.name,
                              num_stages=config.swarm.stages, model_hash=model_hash_of(config),
                              dtype=resolve_dtype(config.model.dtype), parts=parts,
                              settings=settings, progress=progress, say=say)
    manifest = ExportManifest(kind=kind, swarm=config.swarm.name,
                              model_hash=model_hash_of(config), dtype=dtype,
                              step=collected.step, tokenizer=tokenizer.spec,
                              parts=collected.reports)
    with staging(out, replace=replace) as tmp:
        files = await asyncio.to_thread(_write, tmp, kind, seam, collected, wanted, tokenizer,
                                        max_shard_size)
        files.append(manifest.write(tmp).name)
        size = sum((tmp / name).stat().st_size for name in files)
    return ExportResult(out=str(out), kind=kind, dtype=dtype, step=collected.step,
                        parts=collected.reports, files=tuple(files), bytes=size,
                        seconds=time.monotonic() - t0)


def _write(tmp: Path, kind: str, seam: Any, collected: Collected, dtype: torch.dtype,
           tokenizer: Any, max_shard_size: int | str) -> list[str]:
    tensors: dict[str, torch.Tensor] = {}
    for part in (*collected.stages.values(), collected.trainer):
        tensors.update(part.tensors)
    if kind == "hf":
        from swarmd.export.hf_writer import write_hf

        return write_hf(tmp, seam, tensors, dtype=dtype, tokenizer=tokenizer,
                        max_shard_size=max_shard_size)
    from swarmd.export.builtin_writer import write_builtin

    return write_builtin(tmp, seam, tensors, dtype=dtype, tokenizer=tokenizer,
                         max_shard_size=max_shard_size)
