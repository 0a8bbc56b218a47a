"""Pretrained weights from safetensors files, read slice by slice.

A peer serving one stage reads the headers of the shards it needs and then exactly the byte
ranges of its own tensors, nothing of the other stages' (the format is an 8-byte little-endian
header length, a JSON header of ``name -> {dtype, shape, data_offsets}``, then the raw bytes;
see the safetensors documentation). :attr:`Checkpoint.bytes_read` counts every byte read.

``model.safetensors.index.json`` (written by ``save_pretrained`` for sharded checkpoints) maps
each tensor to its shard, so shards holding only other stages' tensors are never opened.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from swarmd.errors import ModelError

__all__ = ["Checkpoint", "TensorInfo", "SAFETENSORS_DTYPES", "MAX_HEADER_BYTES"]

log = logging.getLogger(__name__)

#: safetensors dtype names and their torch types
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
#: largest JSON header accepted (the format's own reference limit is 100 MB)
MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    """Where one tensor lies: its shard, type, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


class Checkpoint:
    """The safetensors tensors of a directory (or one file); headers are read when needed."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        #: every byte read: headers and tensors
        self.bytes_read = 0
        #: the bytes of tensors read (without the headers)
        self.tensor_bytes_read = 0
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
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

    def _header(self, file: Path) -> dict[str, TensorInfo]:
        if file in self._headers:
            return self._headers[file]
        try:
            with open(file, "rb") as f:
                raw = f.read(8)
                self.bytes_read += len(raw)
                if len(raw) < 8:
                    raise ModelError(f"{file}: not a safetensors file (shorter than 8 bytes)")
                (size,) = struct.unpack("<Q", raw)
                if size > MAX_HEADER_BYTES:
                    raise ModelError(f"{file}: not a safetensors file (header of {size} bytes)")
                text = f.read(size)
                self.bytes_read += len(text)
                file_size = f.seek(0, 2)
        except OSError as exc:
            raise ModelError(f"{file}: cannot read the weights ({exc.strerror})") from None
        self._headers[file] = _parse_header(file, text, 8 + size, file_size)
        return self._headers[file]

    def info(self, name: str) -> TensorInfo | None:
        """Where tensor ``name`` lies, or None when no shard holds it."""
        if self._where is not None:
            file = self._where.get(name)
            return None if file is None else self._header(file).get(name)
        for file in self._files:
            if name in (header := self._header(file)):
                return header[name]
        return None

    def read(self, name: str, info: TensorInfo) -> torch.Tensor:
        """The bytes of one tensor as a CPU tensor (a copy: the file may be closed after)."""
        try:
            with open(info.file, "rb") as f:
                f.seek(info.start)
                data = f.read(info.stop - info.start)
        except OSError as exc:
            raise ModelError(f"{info.file}: cannot read tensor {name} ({exc.strerror})") from None
        self.bytes_read += len(data)
        self.tensor_bytes_read += len(data)
        if len(data) != info.stop - info.start:
            raise ModelError(f"{info.file}: tensor {name} is cut short (the file is truncated)")
        if not data:
            return torch.empty(info.shape, dtype=info.dtype)
        return torch.frombuffer(bytearray(data), dtype=info.dtype).reshape(info.shape)

    def load_into(self, module: nn.Module, names: Mapping[str, str], *, what: str) -> None:
        """Fill ``module``'s tensors from the checkpoint: ``names`` maps each of the module's
        parameter and buffer names to its name in the checkpoint. Every tensor must be there
        with its shape; the checkpoint's dtype is converted to the module's."""
        own = dict(module.named_parameters()) | dict(module.named_buffers())
        for local, remote in names.items():
            target = own[local]
            info = self.info(remote)
            if info is None:
                where = (INDEX_NAME if self._where is not None
                         else ", ".join(f.name for f in self._files))
                raise ModelError(f"{self.path}: tensor {remote} ({what}) is missing from the "
                                 f"checkpoint ({where}); the weights do not match config.json")
            if info.shape != tuple(target.shape):
                raise ModelError(f"{info.file}: tensor {remote} ({what}) has shape "
                                 f"{list(info.shape)}, the model expects {list(target.shape)}; "
                                 f"the weights do not match config.json")
            with torch.no_grad():
                target.copy_(self.read(remote, info))
        log.debug("%s: %d tensors of %s loaded, %d bytes read so far", self.path, len(names),
                  what, self.bytes_read)


def _parse_header(file: Path, text: bytes, data_start: int,
                  file_size: int) -> dict[str, TensorInfo]:
    """The tensors a safetensors header describes, each checked against the file's size."""
    try:
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as exc:
        raise ModelError(f"{file}: not a safetensors file ({exc})") from None
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{file}: tensor {name} has an unusable header entry {entry!r}; "
                             f"supported dtypes: {', '.join(SAFETENSORS_DTYPES)}") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (min(shape, default=0) < 0 or not 0 <= begin <= end
                or end - begin != math.prod(shape) * itemsize
                or data_start + end > file_size):
            raise ModelError(f"{file}: tensor {name} of shape {list(shape)} does not fit its "
                             f"byte range {begin}..{end} (the file is damaged or truncated)")
        tensors[name] = TensorInfo(file=file, dtype=dtype, shape=shape,
                                   start=data_start + begin, stop=data_start + end)
    return tensors


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
