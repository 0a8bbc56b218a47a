"""Tensor codecs: how one tensor becomes payload bytes on the wire, and back.

Pure functions, no I/O, nothing read from the environment. The sender picks a :class:`CodecSpec`;
:func:`encode` returns an :class:`EncodedTensor` whose ``meta()`` goes into the frame header and
whose ``parts`` are the payload. The receiver calls :func:`expected_payload_bytes` on the
(untrusted) header to learn how many bytes to read, then :func:`decode`.

Codecs (``CODECS`` maps a base name to a codec object; ``"+zstd"`` may follow any of them):

- ``none``: the raw bytes of the tensor, bit-exact for every dtype (bfloat16, NaN payloads too).
- ``fp16``: floating tensors travel as float16 and are decoded back to their own dtype (values
  beyond +-65504 become +-inf); integer and bool tensors travel raw (``params["mode"] == "raw"``).
- ``int8``: blockwise absmax quantisation of floating tensors. The flattened tensor is cut into
  blocks of ``block_size`` values (the last one may be shorter; nothing is padded). Per block,
  ``scale = max(absmax / 127, s_min)`` rounded *up* to ``scale_dtype`` (``s_min``: the smallest
  positive float16, or the smallest normal float32) and ``q = round(x * (1 / scale))`` (half to
  even) as int8, so ``|q| <= 127`` and an all-zero block decodes to zeros. Payload: the scales,
  then the int8 values. If a float16 scale would overflow (absmax above ~8.3e6) the whole tensor
  is sent with float32 scales, as ``params`` records. float16 scales lose resolution in blocks
  whose absmax is below ~1e-3 (subnormal scales): use ``scale_dtype="float32"`` for tiny values.
  NaN/Inf are not rejected: a block holding a NaN or +-Inf decodes to non-finite values (NaN or
  +-Inf) throughout; other blocks are unaffected. Callers validate their tensors. float64 input
  is quantised through float32. Integer and bool tensors travel raw.
- ``+zstd``: the base payload compressed as one zstd frame; ``params["raw_nbytes"]`` is the base
  payload length, checked against the limits and the frame header before decompressing.

Adding a codec means registering one object with the :class:`Codec` methods in ``CODECS``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Protocol

import torch
import zstandard

from .lowbit import block_rows
from .lowbit import decode_into as _unpack_into
from .lowbit import encode as _pack
from .lowbit import packed_bytes as _packed_bytes
from .errors import CodecError, LimitExceeded, LocalUsageError, UnknownCodec
from .limits import Limits

__all__ = ["CODECS", "DTYPES", "Codec", "CodecSpec", "EncodedTensor", "decode", "encode",
           "expected_payload_bytes"]

#: wire dtype names and the torch dtypes they stand for (read-only)
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
})
_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({v: k for k, v in DTYPES.items()})
_FLOATING = frozenset({"float32", "float16", "bfloat16", "float64"})
_SCALE_DTYPES = MappingProxyType({"float16": torch.float16, "float32": torch.float32})
_LOWBIT_SCALE_DTYPES = MappingProxyType({**_SCALE_DTYPES, "bfloat16": torch.bfloat16})
#: the packed low-bit codecs and their bit widths
_LOWBIT = MappingProxyType({"int4": 4, "int2": 2})
#: a codec's block size when the spec names none
DEFAULT_BLOCKS: Mapping[str, int] = MappingProxyType({"int8": 64, "int4": 64, "int2": 256})
_ZSTD = "zstd"
#: float32 values per quantisation chunk: the temporary (1 MiB) stays in L2 and is reused
_CHUNK_ELEMS = 1 << 18

Params = dict[str, int | str]


class Codec(Protocol):
    """What ``CODECS`` holds. ``dtype`` arguments are wire names (keys of ``DTYPES``)."""

    name: str

    def encode(self, x: torch.Tensor, spec: CodecSpec) -> tuple[Params, tuple[torch.Tensor, ...]]:
        """Encode a flat, contiguous CPU tensor: params, and the payload as 1-D tensors."""

    def payload_bytes(self, dtype: str, numel: int, params: Params) -> int:
        """Validate untrusted ``params`` (``CodecError``); the exact payload size. No allocation."""

    def decode(self, payload: memoryview, dtype: str, numel: int, params: Params) -> torch.Tensor:
        """A writable payload of ``payload_bytes`` bytes (``numel > 0``) -> a flat ``dtype``
        tensor, which may alias ``payload``."""


def _split_name(name: str) -> tuple[str, bool] | None:
    """``"int8+zstd"`` -> ``("int8", True)``; None when the base or a suffix is unknown."""
    base, *suffixes = name.split("+")
    if base not in CODECS or suffixes not in ([], [_ZSTD]):
        return None
    return base, bool(suffixes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _valid_block_size(value: object) -> bool:
    return _is_int(value) and 16 <= value <= 65536 and value & (value - 1) == 0  # type: ignore


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecSpec:
    """What the sender chooses; validated when built (``ValueError`` naming the bad value)."""

    #: ``"none" | "fp16" | "int8"``, optionally with a ``"+zstd"`` suffix, e.g. ``"int8+zstd"``
    name: str
    #: int8, int4, int2: values per scale block (power of two, 16..65536); None: the codec's
    #: own (``DEFAULT_BLOCKS``: 64, or 256 for int2)
    block_size: int = None  # type: ignore[assignment]  # resolved in __post_init__
    #: int8: ``"float16"`` or ``"float32"``; int4, int2: also ``"bfloat16"`` (their default)
    scale_dtype: str = None  # type: ignore[assignment]  # resolved in __post_init__
    #: zstd level (1..22) when ``name`` ends with ``"+zstd"``
    zstd_level: int = 1
    #: int4, int2: ``"nearest"`` or ``"stochastic"`` (unbiased; see ``transport.lowbit``)
    rounding: str = "nearest"
    #: int4, int2: subtract each channel's mean over the rows (the last dimension's values)
    #: before quantising and send the means (float16); ignored by the other codecs
    center: bool = False
    #: ``((message kind, rounding), ...)``: the rounding of the tensors of those kinds (e.g.
    #: stochastic for gradients, nearest for activations); ``for_kind`` applies it
    kind_rounding: tuple[tuple[str, str], ...] = ()
    #: message kinds whose tensors are not centred although ``center`` is set (gradients: they
    #: carry no shared offset, and their means would cost bytes); ``for_kind`` applies it
    uncentred_kinds: tuple[str, ...] = ()
    #: message kinds whose payload is compressed with zstd although ``name`` has no ``+zstd``
    #: (int2/int4 gradients rounded stochastically: their codes crowd the inner levels and
    #: compress to 0.6-0.7); ``for_kind`` applies it
    zstd_kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or _split_name(self.name) is None:
            raise ValueError(f"unknown codec {self.name!r}: expected one of "
                             f"{sorted(CODECS)}, optionally followed by '+zstd'")
        lowbit = self.base in _LOWBIT
        if self.block_size is None:
            object.__setattr__(self, "block_size", DEFAULT_BLOCKS.get(self.base, 64))
        if self.scale_dtype is None:
            object.__setattr__(self, "scale_dtype", "bfloat16" if lowbit else "float16")
        if not _valid_block_size(self.block_size):
            raise ValueError(f"block_size must be a power of two in 16..65536, "
                             f"got {self.block_size!r}")
        allowed = _LOWBIT_SCALE_DTYPES if lowbit else _SCALE_DTYPES
        if not isinstance(self.scale_dtype, str) or self.scale_dtype not in allowed:
            raise ValueError(f"scale_dtype must be one of {sorted(allowed)} for {self.base}, "
                             f"got {self.scale_dtype!r}")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be nearest or stochastic, got {self.rounding!r}")
        if not isinstance(self.center, bool):
            raise ValueError(f"center must be true or false, got {self.center!r}")
        if not isinstance(self.kind_rounding, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and pair[1] in ("nearest", "stochastic") for pair in self.kind_rounding):
            raise ValueError(f"kind_rounding must be ((kind, 'nearest' | 'stochastic'), ...), "
                             f"got {self.kind_rounding!r}")
        for name in ("uncentred_kinds", "zstd_kinds"):
            kinds = getattr(self, name)
            if not isinstance(kinds, tuple) or not all(isinstance(k, str) for k in kinds):
                raise ValueError(f"{name} must be a tuple of message kinds, got {kinds!r}")
        if not (_is_int(self.zstd_level) and 1 <= self.zstd_level <= 22):
            raise ValueError(f"zstd_level must be an integer in 1..22, got {self.zstd_level!r}")

    def for_kind(self, kind: str) -> CodecSpec:
        """The spec for a message of ``kind``: its rounding from ``kind_rounding``, if named,
        no centring if it is one of ``uncentred_kinds``, zstd if one of ``zstd_kinds``."""
        changes: dict[str, Any] = {}
        for named, rounding in self.kind_rounding:
            if named == kind and rounding != self.rounding:
                changes["rounding"] = rounding
        if self.center and kind in self.uncentred_kinds:
            changes["center"] = False
        if kind in self.zstd_kinds and not self.zstd:
            changes["name"] = f"{self.name}+{_ZSTD}"
        if not changes:
            return self
        return replace(self, **changes, kind_rounding=(), uncentred_kinds=(), zstd_kinds=())

    @property
    def base(self) -> str:
        """The registered codec name, without the ``+zstd`` suffix."""
        return self.name.split("+", 1)[0]

    @property
    def zstd(self) -> bool:
        return self.name.endswith("+" + _ZSTD)

    @classmethod
    def parse(cls, text: str, **options: Any) -> CodecSpec:
        """A spec from text such as ``"int8+zstd"`` and keyword options (decimal strings are
        accepted for the integer options, as config files may give them)."""
        if not isinstance(text, str):
            raise ValueError(f"codec spec must be a string, got {text!r}")
        name = text.strip()
        base, _, suffix = name.partition("+")
        if base not in CODECS:
            raise ValueError(f"unknown codec {base!r} in {text!r}; known: {sorted(CODECS)}")
        if suffix and suffix != _ZSTD:
            raise ValueError(f"unknown codec suffix {suffix!r} in {text!r}: only '+zstd' exists")
        known = {f.name for f in fields(cls)} - {"name"}
        for key, value in options.items():
            if key not in known:
                raise ValueError(f"unknown codec option {key!r}: expected one of {sorted(known)}")
            if key in ("block_size", "zstd_level") and isinstance(value, str):
                if not value.strip().isdigit():
                    raise ValueError(f"{key} must be an integer, got {value!r}")
                options[key] = int(value)
        return cls(name=name, **options)


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodedTensor:
    """One encoded tensor. ``parts`` are read-only views that may alias the input tensor (codec
    ``none`` and the raw modes): do not modify the tensor until the parts have been sent."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    params: Params
    parts: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        """Payload length: the sum of the part lengths."""
        return sum(part.nbytes for part in self.parts)

    def meta(self) -> dict[str, Any]:
        """The msgpack-able header entry that :func:`decode` takes back."""
        return {"codec": self.codec, "dtype": self.dtype, "shape": list(self.shape),
                "params": dict(self.params), "nbytes": self.nbytes}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a contiguous CPU tensor, without copying (keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    buf._owner = t  # type: ignore[attr-defined]  # the view holds buf, buf holds the tensor
    return memoryview(buf).cast("B").toreadonly()


def _raw_tensor(payload: memoryview, dtype: str) -> torch.Tensor:
    """A writable, non-empty payload as a flat tensor; aliases it unless misaligned."""
    raw = torch.frombuffer(payload, dtype=torch.uint8)
    if dtype == "bool":
        return raw != 0  # a byte other than 0/1 is not a valid torch bool
    torch_dtype = DTYPES[dtype]
    if raw.data_ptr() % torch_dtype.itemsize:
        raw = raw.clone()  # misaligned inside a larger buffer: copy to aligned memory
    return raw.view(torch_dtype)


def _expect_params(params: Params, expected: Mapping[str, object]) -> None:
    if params != expected:
        raise CodecError(f"codec params {params!r} do not match the expected {dict(expected)!r}")


def _raw_payload_bytes(dtype: str, numel: int, params: Params, **expected: object) -> int:
    _expect_params(params, expected)
    return numel * DTYPES[dtype].itemsize


class _NoneCodec:
    """Raw tensor bytes, bit-exact for every dtype."""

    name = "none"

    def encode(self, x: torch.Tensor, spec: CodecSpec) -> tuple[Params, tuple[torch.Tensor, ...]]:
        return {}, (x,)

    def payload_bytes(self, dtype: str, numel: int, params: Params) -> int:
        return _raw_payload_bytes(dtype, numel, params)

    def decode(self, payload: memoryview, dtype: str, numel: int, params: Params) -> torch.Tensor:
        return _raw_tensor(payload, dtype)


class _Fp16Codec:
    """Floating tensors as float16; integer and bool tensors raw."""

    name = "fp16"

    def encode(self, x: torch.Tensor, spec: CodecSpec) -> tuple[Params, tuple[torch.Tensor, ...]]:
        if _DTYPE_NAMES[x.dtype] not in _FLOATING:
            return {"mode": "raw"}, (x,)
        return {"mode": "half"}, (x.to(torch.float16),)

    def payload_bytes(self, dtype: str, numel: int, params: Params) -> int:
        if dtype not in _FLOATING:
            return _raw_payload_bytes(dtype, numel, params, mode="raw")
        return _raw_payload_bytes("float16", numel, params, mode="half")

    def decode(self, payload: memoryview, dtype: str, numel: int, params: Params) -> torch.Tensor:
        if dtype not in _FLOATING:
            return _raw_tensor(payload, dtype)
        return _raw_tensor(payload, "float16").to(DTYPES[dtype])


class _Int8Codec:
    """Blockwise absmax int8 quantisation of floating tensors (see the module docstring)."""

    name = "int8"

    def encode(self, x: torch.Tensor, spec: CodecSpec) -> tuple[Params, tuple[torch.Tensor, ...]]:
        if _DTYPE_NAMES[x.dtype] not in _FLOATING:
            return {"mode": "raw"}, (x,)
        block = spec.block_size
        if x.numel() == 0:
            return self._params(block, spec.scale_dtype), ()
        rows = block_rows(x.float(), block)
        absmax = [_absmax(r) for r in rows]
        scale = (absmax[0] if len(absmax) == 1 else torch.cat(absmax)).div_(127)
        wire, scale_dtype, wide = _wire_scales(scale, spec.scale_dtype)
        inverse = wide.reciprocal()
        q = torch.empty(x.numel(), dtype=torch.int8)
        for r, q_rows in zip(rows, block_rows(q, block)):
            _quantize_rows(r, inverse[:r.shape[0]], q_rows)
            inverse = inverse[r.shape[0]:]
        return self._params(block, scale_dtype), (wire, q)

    @staticmethod
    def _params(block: int, scale_dtype: str) -> Params:
        return {"mode": "int8", "block_size": block, "scale_dtype": scale_dtype}

    def payload_bytes(self, dtype: str, numel: int, params: Params) -> int:
        if dtype not in _FLOATING:
            return _raw_payload_bytes(dtype, numel, params, mode="raw")
        block, scale_dtype = params.get("block_size"), params.get("scale_dtype")
        if not _valid_block_size(block) or scale_dtype not in _SCALE_DTYPES:
            raise CodecError(f"bad int8 params {params!r}")
        _expect_params(params, self._params(block, scale_dtype))  # type: ignore[arg-type]
        blocks = -(-numel // block)  # type: ignore[operator]
        return blocks * _SCALE_DTYPES[scale_dtype].itemsize + numel  # type: ignore[index]

    def decode(self, payload: memoryview, dtype: str, numel: int, params: Params) -> torch.Tensor:
        if dtype not in _FLOATING:
            return _raw_tensor(payload, dtype)
        scale_bytes = len(payload) - numel
        scale = _raw_tensor(payload[:scale_bytes], str(params["scale_dtype"])).float()
        out = torch.frombuffer(payload[scale_bytes:], dtype=torch.int8).to(torch.float32)
        for r in block_rows(out, int(params["block_size"])):
            r.mul_(scale[:r.shape[0], None])
            scale = scale[r.shape[0]:]
        return out if dtype == "float32" else out.to(DTYPES[dtype])


class _LowBitCodec:
    """Packed 4-bit or 2-bit blockwise quantisation of floating tensors (``transport.lowbit``).

    Params: ``{"mode": "packed", "bits": 4|2, "block_size": B, "scale_dtype": ...,
    "channels": C}`` and, when ``C > 0``, ``"mean_dtype"``. Payload: with ``C > 0`` first the
    mean of each of the ``C`` channels (the tensor seen as rows of ``C`` values: its last
    dimension) over the rows (a sample of them in a large tensor: ``_channel_means``), which
    is subtracted before quantising and added back after;
    then the block steps; then the packed codes. A step or mean that is NaN or infinite, or a
    negative step, is the sender's fault (``CodecError``, raised before the output is
    allocated): a tensor holding NaN or inf cannot be sent this way, its receiver refuses it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bits = _LOWBIT[name]

    def encode(self, x: torch.Tensor, spec: CodecSpec, channels: int = 0
               ) -> tuple[Params, tuple[torch.Tensor, ...]]:
        """``channels``: the tensor's last dimension, centred when ``spec.center`` (0: not)."""
        if _DTYPE_NAMES[x.dtype] not in _FLOATING:
            return {"mode": "raw"}, (x,)
        block, scale_dtype = spec.block_size, spec.scale_dtype
        if not spec.center or not 0 < channels < x.numel():
            channels = 0
        if x.numel() == 0:
            return self._params(block, scale_dtype, 0, None), ()
        x = x.float()
        parts: tuple[torch.Tensor, ...] = ()
        mean_dtype, mean = None, None
        if channels:
            exact = _channel_means(x.view(-1, channels))
            mean_dtype, sent = "float16", exact.to(torch.float16)
            if bool((sent.isinf() & exact.isfinite()).any()):
                mean_dtype, sent = "float32", exact
            mean, parts = sent.float(), (sent,)
        stochastic = spec.rounding == "stochastic"
        encoded = _pack(x, block, self.bits, scale_dtype=_LOWBIT_SCALE_DTYPES[scale_dtype],
                        stochastic=stochastic, mean=mean)
        if encoded is None:  # a step beyond the scale dtype: every step goes as float32
            scale_dtype = "float32"
            encoded = _pack(x, block, self.bits, scale_dtype=torch.float32,
                            stochastic=stochastic, mean=mean)
        assert encoded is not None  # float32 steps cannot overflow float32
        wire, packed = encoded
        return self._params(block, scale_dtype, channels, mean_dtype), (*parts, wire, packed)

    def _params(self, block: int, scale_dtype: str, channels: int,
                mean_dtype: str | None) -> Params:
        params: Params = {"mode": "packed", "bits": self.bits, "block_size": block,
                          "scale_dtype": scale_dtype, "channels": channels}
        if channels:
            params["mean_dtype"] = str(mean_dtype)
        return params

    def payload_bytes(self, dtype: str, numel: int, params: Params) -> int:
        if dtype not in _FLOATING:
            return _raw_payload_bytes(dtype, numel, params, mode="raw")
        bits, block, scale_dtype, channels, mean_dtype = (
            params.get(k) for k in ("bits", "block_size", "scale_dtype", "channels",
                                    "mean_dtype"))
        if bits != self.bits or not _is_int(bits):
            raise CodecError(f"{self.name} carries {self.bits}-bit codes, params say {bits!r}")
        if not _valid_block_size(block) or scale_dtype not in _LOWBIT_SCALE_DTYPES:
            raise CodecError(f"bad {self.name} params {params!r}")
        if not _is_int(channels) or channels < 0 or (  # type: ignore[operator]
                channels and (channels >= numel or numel % channels  # type: ignore[operator]
                              or mean_dtype not in _SCALE_DTYPES)):
            raise CodecError(f"bad {self.name} channels {channels!r} (mean_dtype "
                             f"{mean_dtype!r}) for {numel} values")
        _expect_params(params, self._params(block, scale_dtype, channels,  # type: ignore
                                            mean_dtype))  # type: ignore[arg-type]
        blocks = -(-numel // block)  # type: ignore[operator]
        means = channels * _SCALE_DTYPES[mean_dtype].itemsize if channels else 0  # type: ignore
        return (means + blocks * _LOWBIT_SCALE_DTYPES[scale_dtype].itemsize  # type: ignore
                + _packed_bytes(numel, self.bits))

    def decode(self, payload: memoryview, dtype: str, numel: int, params: Params) -> torch.Tensor:
        if dtype not in _FLOATING:
            return _raw_tensor(payload, dtype)
        channels = int(params["channels"])
        mean_bytes = channels * _SCALE_DTYPES[str(params["mean_dtype"])].itemsize if channels else 0
        scale_end = len(payload) - _packed_bytes(numel, self.bits)
        scale = _raw_tensor(payload[mean_bytes:scale_end], str(params["scale_dtype"]))
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise CodecError(f"{self.name} block scales must be finite and non-negative")
        mean = _raw_tensor(payload[:mean_bytes], str(params["mean_dtype"])) if channels else None
        if mean is not None and not bool(torch.isfinite(mean).all()):
            raise CodecError(f"{self.name} channel means must be finite")
        packed = torch.frombuffer(payload[scale_end:], dtype=torch.uint8)
        out = torch.empty(numel, dtype=torch.float32)
        _unpack_into(packed, scale.float(), int(params["block_size"]), self.bits, out,
                     None if mean is None else mean.float())
        return out if dtype == "float32" else out.to(DTYPES[dtype])


#: the channel means of centring come from at most about this many rows of a larger tensor
#: (evenly spaced); see ``_channel_means``
MEAN_SAMPLE_ROWS = 1024


def _channel_means(rows: torch.Tensor) -> torch.Tensor:
    """Each column's mean over ``rows`` (float32, contiguous), or over every ``k``-th row when
    there are at least twice ``MEAN_SAMPLE_ROWS`` of them. The means only centre the values
    before quantising and travel with them, so they need not be exact: from 1,024 rows a
    mean is within about 3% of its column's spread, far inside a 2-bit step, and reading a
    sixteenth of a 64 MB activation instead of all of it saves a memory pass (a quarter of
    the centred int2 encode). ``k`` is odd, so rows of power-of-two sequences are sampled at
    every token position alike (position 0's outliers are not over-weighted)."""
    stride = max(1, rows.shape[0] // MEAN_SAMPLE_ROWS) | 1
    sample = rows[::stride]  # a strided view: BLAS reads its rows where they are
    # a matrix-vector product: 6x faster than mean(0)
    return torch.mv(sample.t(), torch.full((sample.shape[0],), 1 / sample.shape[0]))


def _absmax(rows: torch.Tensor) -> torch.Tensor:
    """Per-row max of |x| (NaN where the row holds a NaN) of a float32 (rows, block) view.

    The largest positive value comes from an int32 reduction over the float bits (positive floats
    order like their bit patterns, and integer reductions are ~1.6x faster than float ones here);
    the most negative one from a float ``amin``."""
    positive = rows.view(torch.int32).amax(1).view(torch.float32)  # < 0 if no value is > 0
    return torch.maximum(positive, rows.amin(1).neg_())


def _wire_scales(scale: torch.Tensor, scale_dtype: str) -> tuple[torch.Tensor, str, torch.Tensor]:
    """Round float32 block scales *up* to ``scale_dtype``, so that ``|x| / scale <= 127``.

    Returns the scales as sent, the scale dtype actually used (float32 when a float16 scale
    would overflow) and the sent scales as float32."""
    if scale_dtype == "float16":
        wide = scale.clamp_min(2.0 ** -24)  # the smallest positive float16; NaN stays NaN
        half = wide.to(torch.float16)
        # positive float16 bit patterns are ordered: +1 is the next float16 up (65504 -> inf)
        half.view(torch.int16).add_(half.float() < wide)
        if int(half.view(torch.int16).amax()) < 0x7C00:  # no +inf (nor positive NaN)
            return half, "float16", half.float()
    wide = scale.clamp_min_(torch.finfo(torch.float32).tiny)
    return wide, "float32", wide


def _quantize_rows(x: torch.Tensor, inverse: torch.Tensor, q: torch.Tensor) -> None:
    """``q = round(x * inverse[:, None])`` for (rows, block) views, in L2-sized chunks."""
    rows, block = x.shape
    step = max(1, _CHUNK_ELEMS // block)
    tmp = torch.empty(min(step, rows), block)
    for x_part, inverse_part, q_part in zip(x.split(step), inverse[:, None].split(step),
                                            q.split(step)):
        chunk = tmp if x_part.shape[0] == tmp.shape[0] else tmp[:x_part.shape[0]]
        torch.mul(x_part, inverse_part, out=chunk)
        q_part.copy_(chunk.round_())


#: the registered codecs by base name; ``+zstd`` applies on top of any of them
CODECS: dict[str, Codec] = {c.name: c for c in (_NoneCodec(), _Fp16Codec(), _Int8Codec(),
                                                 _LowBitCodec("int4"), _LowBitCodec("int2"))}


def encode(tensor: torch.Tensor, spec: CodecSpec) -> EncodedTensor:
    """Encode ``tensor`` as ``spec`` says.

    The tensor is detached, copied to CPU if it lives on another device (a synchronous copy)
    and made contiguous if it is not. The parts may alias that CPU tensor (codec ``none`` and
    raw modes). Raises ``LocalUsageError`` for a tensor that cannot be sent.
    """
    if not isinstance(spec, CodecSpec):
        raise LocalUsageError(f"spec must be a CodecSpec, got {type(spec).__name__}")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise LocalUsageError(f"can only encode dense torch tensors, got {type(tensor).__name__}")
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise LocalUsageError(f"unsupported dtype {tensor.dtype}: expected one of {list(DTYPES)}")
    x = tensor.detach().cpu().resolve_neg().contiguous().view(-1)
    codec = CODECS[spec.base]
    if isinstance(codec, _LowBitCodec):  # centring needs the channels: the last dimension
        params, tensors = codec.encode(x, spec, tensor.shape[-1] if tensor.dim() > 1 else 0)
    else:
        params, tensors = codec.encode(x, spec)
    parts = tuple(_tensor_bytes(t.contiguous()) for t in tensors if t.numel())
    if spec.zstd:
        raw = sum(p.nbytes for p in parts)
        compressor = zstandard.ZstdCompressor(level=spec.zstd_level).compressobj(size=raw)
        chunks = [compressor.compress(p) for p in parts] + [compressor.flush()]
        parts = tuple(memoryview(c) for c in chunks if c)
        params = {**params, "raw_nbytes": raw}
    return EncodedTensor(codec=spec.name, dtype=dtype, shape=tuple(tensor.shape),
                         params=params, parts=parts)


class _Checked(NamedTuple):
    codec: Codec
    zstd: bool
    dtype: str
    shape: tuple[int, ...]
    numel: int
    params: Params  # without "raw_nbytes"
    nbytes: int  # payload bytes on the wire
    raw_nbytes: int  # payload bytes after zstd (== nbytes without zstd)


def _check(meta: object, limits: Limits) -> _Checked:
    """Validate an untrusted meta; integer arithmetic only, nothing allocated."""
    if not isinstance(meta, Mapping):
        raise CodecError(f"tensor meta must be a map, got {type(meta).__name__}")
    name = meta.get("codec")
    if not isinstance(name, str):
        raise CodecError(f"codec name must be a string, got {name!r}")
    split = _split_name(name)
    if split is None:
        raise UnknownCodec(f"unknown codec {name[:64]!r}")
    dtype = meta.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CodecError(f"unknown dtype {dtype!r}")
    shape = meta.get("shape")
    if not isinstance(shape, (list, tuple)):
        raise CodecError(f"shape must be a list, got {type(shape).__name__}")
    if len(shape) > limits.max_dims:
        raise LimitExceeded(f"tensor has {len(shape)} dims, limit is {limits.max_dims}")
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise CodecError(f"shape must hold non-negative integers, got {shape!r}")
    # every dimension is bounded too, so that an empty tensor cannot declare absurd strides
    itemsize, numel, span = DTYPES[dtype].itemsize, 1, 1
    for d in shape:
        numel, span = numel * d, span * max(d, 1)
        if span * itemsize > limits.max_tensor_bytes:
            raise LimitExceeded(f"{dtype} {shape!r} exceeds {limits.max_tensor_bytes=}")
    params = meta.get("params")
    if not isinstance(params, Mapping) or not all(
            isinstance(k, str) and (_is_int(v) or isinstance(v, str)) for k, v in params.items()):
        raise CodecError(f"codec params must map strings to ints or strings, got {params!r}")
    params = dict(params)
    raw_nbytes = params.pop("raw_nbytes", None) if split[1] else None
    codec = CODECS[split[0]]
    expected = codec.payload_bytes(dtype, numel, params)
    nbytes = meta.get("nbytes")
    if not _is_int(nbytes) or nbytes < 0:
        raise CodecError(f"nbytes must be a non-negative integer, got {nbytes!r}")
    if nbytes > limits.max_message_bytes:
        raise LimitExceeded(f"payload of {nbytes} bytes exceeds {limits.max_message_bytes=}")
    if not split[1]:
        if nbytes != expected:
            raise CodecError(f"nbytes={nbytes} but codec {name} needs {expected} payload bytes")
        raw_nbytes = expected
    elif raw_nbytes != expected or not _is_int(raw_nbytes):
        raise CodecError(f"raw_nbytes={raw_nbytes!r} but codec {name} needs {expected} bytes")
    if raw_nbytes > limits.max_tensor_bytes:  # type: ignore[operator]
        raise LimitExceeded(f"decompressed payload of {raw_nbytes} bytes exceeds limits")
    return _Checked(codec, split[1], dtype, tuple(shape), numel, params, nbytes,
                    raw_nbytes)  # type: ignore[arg-type]


def expected_payload_bytes(meta: dict, limits: Limits) -> int:
    """Validate an untrusted tensor meta and return how many payload bytes must follow.

    Raises ``UnknownCodec`` for an unknown codec, ``CodecError`` when dtype, shape, params or
    ``nbytes`` are malformed or inconsistent, ``LimitExceeded`` when dims, decoded size or payload
    size exceed ``limits``. Allocates nothing.
    """
    return _check(meta, limits).nbytes


def _unzstd(payload: memoryview, raw_nbytes: int) -> memoryview:
    """Decompress one zstd frame that must yield exactly ``raw_nbytes`` bytes."""
    try:
        declared = zstandard.frame_content_size(payload)  # -1: the header does not say
        if declared not in (-1, raw_nbytes):
            raise CodecError(f"zstd frame declares {declared} bytes, params say {raw_nbytes}")
        out = zstandard.ZstdDecompressor().decompress(
            payload, max_output_size=max(raw_nbytes, 1), allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"bad zstd payload: {exc}") from exc
    if len(out) != raw_nbytes:
        raise CodecError(f"zstd payload decompressed to {len(out)} bytes, expected {raw_nbytes}")
    return memoryview(bytearray(out))


def decode(meta: dict, payload: memoryview, limits: Limits) -> torch.Tensor:
    """Decode one tensor from an untrusted ``meta`` and its payload.

    Validates like :func:`expected_payload_bytes`, and ``len(payload)`` must equal
    ``meta["nbytes"]``. Bad input raises only ``PeerProtocolError`` subclasses
    (``LocalUsageError`` if ``payload`` is not a byte buffer at all). Zero-copy: when the payload
    is writable memory (e.g. a ``bytearray``) holding raw tensor bytes (codec ``none``, the raw
    modes of ``fp16``/``int8``, ``fp16`` of a float16 tensor), the result aliases it; a read-only
    payload is copied first.
    """
    checked = _check(meta, limits)
    try:
        view = memoryview(payload).cast("B")
    except (TypeError, ValueError) as exc:
        raise LocalUsageError(f"payload must be a contiguous byte buffer: {exc}") from exc
    if view.nbytes != checked.nbytes:
        raise CodecError(f"payload has {view.nbytes} bytes, meta says {checked.nbytes}")
    if checked.zstd:
        view = _unzstd(view, checked.raw_nbytes)
    elif view.readonly and checked.numel:
        view = memoryview(bytearray(view))
    torch_dtype = DTYPES[checked.dtype]
    if checked.numel == 0:
        return torch.empty(checked.shape, dtype=torch_dtype)
    flat = checked.codec.decode(view, checked.dtype, checked.numel, checked.params)
    if flat.dtype != torch_dtype or flat.numel() != checked.numel:
        raise CodecError(f"codec {checked.codec.name} decoded {flat.numel()} x {flat.dtype}, "
                         f"expected {checked.numel} x {torch_dtype}")
    return flat.view(checked.shape)
