"""Weights through safetensors.safe_open: every dtype the library and torch know, bad files
refused in one line naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from swarmd.errors import ModelError
from swarmd.models.weights import Checkpoint

NAMES = {"weight": "w", "bias": "b"}
#: safetensors dtype names of floating-point data and their torch types, where torch has them
FLOATS = {name: getattr(torch, attr) for name, attr in [
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")] if hasattr(torch, attr)}


def _values(shape: tuple[int, ...]) -> torch.Tensor:
    """Small multiples of 1/2: exact in every floating-point type, FP8 included."""
    return (torch.arange(int(torch.tensor(shape).prod())) % 5 / 2 - 1).reshape(shape)


def _load(path: Path) -> nn.Linear:
    module = nn.Linear(4, 3)
    Checkpoint(path).load_into(module, NAMES, what="the test's layer")
    return module


def _raw_file(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file written byte by byte (to say what the library would not write)."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("dtype_name", sorted(FLOATS))
def test_every_floating_point_dtype_loads_converted_to_the_modules(tmp_path: Path,
                                                                  dtype_name: str) -> None:
    dtype = FLOATS[dtype_name]
    weight, bias = _values((3, 4)), _values((3,))
    save_file({"w": weight.to(dtype), "b": bias.to(dtype)}, str(tmp_path / "m.safetensors"))
    module = _load(tmp_path / "m.safetensors")
    assert module.weight.dtype == torch.float32
    assert torch.equal(module.weight.detach(), weight) and torch.equal(module.bias.detach(), bias)


def test_only_the_tensors_asked_for_are_taken(tmp_path: Path) -> None:
    save_file({"w": _values((3, 4)), "b": _values((3,)), "other": torch.zeros(1000)},
              str(tmp_path / "m.safetensors"))
    checkpoint = Checkpoint(tmp_path)
    checkpoint.load_into(nn.Linear(4, 3), NAMES, what="the test's layer")
    assert checkpoint.tensor_bytes_read == (12 + 3) * 4
    assert checkpoint.files_opened == [tmp_path / "m.safetensors"]


def _refused(path: Path, *patterns: str) -> str:
    with pytest.raises(ModelError) as caught:
        _load(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path))
    for pattern in patterns:
        assert pattern in message, message
    return message


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": _values((3, 4)), "b": _values((3,))}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    _refused(path, "not a usable safetensors file", "truncated", "re-save the weights")
    path.write_bytes(data[:20])  # inside the header
    _refused(path, "not a usable safetensors file", "re-save the weights")
    path.write_bytes(data[:3])
    _refused(path, "header too small")


def test_an_oversized_header_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _refused(path, "header too large", "re-save the weights")


def test_a_dtype_the_library_does_not_know_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _raw_file(path, {"w": {"dtype": "F7", "shape": [3, 4], "data_offsets": [0, 48]},
                     "b": {"dtype": "F32", "shape": [3], "data_offsets": [48, 60]}}, bytes(60))
    _refused(path, "not a usable safetensors file", "F7")


def test_integer_values_for_floating_point_weights_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(3, 4, dtype=torch.int32), "b": _values((3,))}, str(path))
    _refused(path, "tensor w (the test's layer) holds I32 values",
             "expects floating-point weights (float32)")


def test_a_shape_the_model_does_not_expect_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": _values((4, 3)), "b": _values((3,))}, str(path))
    _refused(path, "tensor w (the test's layer) has shape [4, 3], the model expects [3, 4]")


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no FP4")
def test_a_dtype_torch_cannot_convert_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _raw_file(path, {"w": {"dtype": "F4", "shape": [3, 4], "data_offsets": [0, 6]},
                     "b": {"dtype": "F32", "shape": [3], "data_offsets": [6, 18]}}, bytes(18))
    _refused(path, "tensor w (the test's layer)", "F4", "convert the weights")
