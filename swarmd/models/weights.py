"""Pretrained weights from safetensors files, read tensor by tensor through the library.

A peer serving one stage opens (``safetensors.safe_open``, framework "pt") only the shards that
hold its own tensors and takes only those tensors out of them: the library reads a file's
header and maps the rest, so the other stages' bytes are never read. Every dtype the
library and this torch know loads (FP8 included), converted to the module's dtype.
:attr:`Checkpoint.files_opened` and :attr:`Checkpoint.tensor_bytes_read` say what was taken.

``model.safetensors.index.json`` (written by ``save_pretrained`` for sharded checkpoints) maps
each tensor to its shard, so shards holding only other stages' tensors are never opened.

A file the library refuses (a truncated, oversized or malformed header), a tensor of another
shape, or of a dtype the model cannot take (integers for floating-point weights, a dtype this
torch cannot convert) is a :class:`~swarmd.errors.ModelError` naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from swarmd.errors import ModelError

__all__ = ["Checkpoint", "tensor_names"]

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
#: what to do about a file the library refuses
_RESAVE = ("re-save the weights with safetensors (save_pretrained, or "
           "safetensors.torch.save_file), or remove the file to start from random weights")
#: safetensors dtype names of floating-point data (the rest are integers, bool, complex)
_FLOAT_PREFIXES = ("F", "BF")


class Checkpoint:
    """The safetensors tensors of a directory (or one file); files are opened when needed."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        #: the shards opened so far, in order (a shard holding none of a part's tensors is not)
        self.files_opened: list[Path] = []
        #: the bytes of the tensors taken out of the files
        self.tensor_bytes_read = 0
        self._where: dict[str, Path] | None = None  # from the index, when there is one
        if self.path.is_file():
            self._files = [self.path]
        elif self.path.is_dir():
            index = self.path / INDEX_NAME
            self._files = sorted(self.path.glob("*.safetensors"))
            if index.is_file():
                self._where = self._read_index(index)
        else:
            raise ModelError(f"{self.path}: no such weights file or directory; point model.hf "
                             f"at a directory holding config.json and *.safetensors")
        if not self._files and self._where is None:
            raise ModelError(f"{self.path}: no *.safetensors file here; save the model with "
                             f"save_pretrained (safe_serialization) or leave weights out to "
                             f"initialise randomly")

    def _read_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            return {str(k): self.path / str(v) for k, v in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"{index}: not a safetensors index ({exc}); expected "
                             f'{{"weight_map": {{tensor name: shard file}}}}') from None

    def load_into(self, module: nn.Module, names: Mapping[str, str], *, what: str) -> None:
        """Fill ``module``'s tensors from the checkpoint: ``names`` maps each of the module's
        parameter and buffer names to its name in the checkpoint. Every tensor must be there
        with its shape; the checkpoint's dtype is converted to the module's."""
        own = dict(module.named_parameters()) | dict(module.named_buffers())
        with _Shards(self) as shards:
            for local, remote in names.items():
                target = own[local]
                found = shards.find(remote)
                if found is None:
                    where = (INDEX_NAME if self._where is not None
                             else ", ".join(f.name for f in self._files))
                    raise ModelError(f"{self.path}: tensor {remote} ({what}) is missing from "
                                     f"the checkpoint ({where}); the weights do not match "
                                     f"config.json")
                file, handle = found
                with torch.no_grad():
                    target.copy_(self._take(file, handle, remote, target, what))
        log.debug("%s: %d tensors of %s loaded from %d file(s)", self.path, len(names), what,
                  len(self.files_opened))

    def _take(self, file: Path, handle: Any, name: str, target: torch.Tensor,
              what: str) -> torch.Tensor:
        """Tensor ``name`` of ``file``, its shape and dtype checked against ``target`` first."""
        try:
            view = handle.get_slice(name)
            shape, dtype = tuple(view.get_shape()), str(view.get_dtype())
        except SafetensorError as exc:
            raise ModelError(f"{file}: tensor {name} ({what}) cannot be read ({exc}); "
                             f"{_RESAVE}") from None
        if shape != tuple(target.shape):
            raise ModelError(f"{file}: tensor {name} ({what}) has shape {list(shape)}, the "
                             f"model expects {list(target.shape)}; the weights do not match "
                             f"config.json")
        if target.is_floating_point() and not dtype.startswith(_FLOAT_PREFIXES):
            raise ModelError(f"{file}: tensor {name} ({what}) holds {dtype} values, the model "
                             f"expects floating-point weights ({_torch_name(target.dtype)}); "
                             f"the weights do not match config.json")
        try:
            tensor = handle.get_tensor(name)
            self.tensor_bytes_read += tensor.numel() * tensor.element_size()
            return tensor.to(target.dtype) if tensor.dtype != target.dtype else tensor
        except (SafetensorError, TypeError, ValueError, RuntimeError,
                NotImplementedError) as exc:
            raise ModelError(f"{file}: tensor {name} ({what}) is {dtype}, which torch "
                             f"{torch.__version__} cannot convert to "
                             f"{_torch_name(target.dtype)} ({_first_line(exc)}); convert the "
                             f"weights to float32, bfloat16 or float16") from None


class _Shards(contextlib.AbstractContextManager["_Shards"]):
    """The shards opened while one part loads, closed when it is done."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._open: dict[Path, Any] = {}
        #: the tensor names of each open shard
        self._keys: dict[Path, frozenset[str]] = {}
        self._stack = contextlib.ExitStack()

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def find(self, name: str) -> tuple[Path, Any] | None:
        """The shard holding tensor ``name`` and its open handle, or None."""
        c = self.checkpoint
        if c._where is not None:
            file = c._where.get(name)
            if file is None:
                return None
            handle = self._handle(file)
            return (file, handle) if name in self._keys[file] else None
        for file in c._files:
            handle = self._handle(file)
            if name in self._keys[file]:
                return file, handle
        return None

    def _handle(self, file: Path) -> Any:
        if file in self._open:
            return self._open[file]
        try:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt",
                                                         device="cpu"))
        except FileNotFoundError:
            raise ModelError(f"{file}: missing (listed in {INDEX_NAME}); copy every shard "
                             f"of the checkpoint") from None
        except OSError as exc:
            raise ModelError(f"{file}: cannot read the weights ({exc.strerror or exc})") from None
        except SafetensorError as exc:
            raise ModelError(f"{file}: not a usable safetensors file "
                             f"({_first_line(exc).removeprefix(_LIB_PREFIX)}: damaged, "
                             f"truncated or not safetensors); {_RESAVE}") from None
        self.checkpoint.files_opened.append(file)
        self._open[file] = handle
        self._keys[file] = frozenset(handle.keys())
        return handle


_LIB_PREFIX = "Error while deserializing header: "


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_names(module: nn.Module, prefix_map: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Checkpoint names of ``module``'s parameters and persistent buffers: each local name
    starting with a prefix of ``prefix_map`` (local, remote) has it replaced by ``remote``."""
    rules = list(prefix_map)
    out = {}
    for local in module.state_dict(keep_vars=True):
        for old, new in rules:
            if local.startswith(old):
                out[local] = new + local[len(old):]
                break
    return out
