"""A stage's training state as one value, and its byte format. Pure: no I/O.

A :class:`StageState` is what a peer joining a stage needs to continue where its peers are: the
module's ``state_dict`` (parameters and buffers), the optimizer's ``state_dict`` (any
``torch.optim`` optimizer: AdamW, LAMB, ...), the step number and a little metadata. It is
captured from a live module (:func:`capture`), restored into a fresh one (:func:`restore`), and
turned into bytes for checkpoints and state transfer (:func:`encode`, :func:`decode`).

The byte format never runs pickle or ``torch.load``: the bytes may come from any peer. ::

    prefix   16 bytes  b"SWST", version (u8), 3 reserved zero bytes, header length (u64 LE)
    header   msgpack map {"stage", "step", "model_hash", "meta", "tensors": [[dtype, shape]...],
                          "params": [[name, ref], ...], "optimizer": tree}
    data     the tensors' raw little-endian bytes, one after another, in table order

In the optimizer tree a tensor is ``ExtType(1, index)`` into the tensor table and a tuple is
``ExtType(2, msgpack list)``; every tensor is referenced exactly once. :func:`decode` checks every
size before it allocates (dtype whitelist, dims, shape x itemsize against the bytes present, total
against ``max_bytes``), bounds nesting, and raises :class:`BadStageState` for anything wrong.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import msgpack
import torch
from torch import nn

from swarmd.errors import SwarmdError
from swarmd.state.layout import PIECE_BYTES, BytesReader, Layout, Reader, byte_view
from swarmd.training.precision import masters_mismatch

__all__ = ["StageState", "BadStageState", "NonFiniteState", "StateMismatch", "capture",
           "restore", "encode", "decode", "decode_from", "layout", "peek", "digest",
           "check_finite_state", "state_bytes_bound", "MAX_STATE_BYTES"]

MAGIC = b"SWST"
VERSION = 1
PREFIX = struct.Struct("<4sB3xQ")
#: default bound on an encoded state when the caller names none (a daemon passes what its
#: stage's module implies: ``state_bytes_bound``); memory is bounded by a piece, not by this
MAX_STATE_BYTES = 16 << 30
#: largest msgpack header (names, shapes, optimizer hyper-parameters)
MAX_HEADER_BYTES = 4 << 20
MAX_DIMS = 8
MAX_DEPTH = 16
MAX_MODEL_HASH_CHARS = 256
_EXT_TENSOR = 1
_EXT_TUPLE = 2
_INDEX = struct.Struct("<I")

#: wire dtype names and the torch dtypes they stand for (read-only)
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
})
_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({v: k for k, v in DTYPES.items()})


class BadStageState(SwarmdError):
    """Bytes that are not a valid encoded stage state (truncated, corrupt, hostile, too large).
    When they came from a peer, that peer is at fault: fetch the state from another one."""

    code = "bad_stage_state"


class NonFiniteState(BadStageState):
    """A well-formed stage state whose weights or optimizer state hold NaN/Inf."""

    code = "non_finite_state"


class StateMismatch(SwarmdError):
    """A valid stage state that does not fit this module or optimizer (another stage, model,
    parameter name, shape or dtype). Nothing was changed; the message names the mismatch."""

    code = "state_mismatch"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StageState:
    """A frozen snapshot of one stage: CPU tensors owned by nobody else. Do not mutate."""

    stage: int
    step: int
    model_hash: str
    #: ``module.state_dict()``: name -> tensor
    params: Mapping[str, torch.Tensor]
    #: ``optimizer.state_dict()``: nested dicts/lists/tuples of tensors and plain values
    optimizer: Mapping[str, Any]
    #: small plain values (samples seen, ...): str keys; no tensors
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _is_int(self.stage) or self.stage < 0:
            raise ValueError(f"stage must be a non-negative integer, got {self.stage!r}")
        if not _is_int(self.step) or self.step < 0:
            raise ValueError(f"step must be a non-negative integer, got {self.step!r}")
        if not isinstance(self.model_hash, str) or not self.model_hash:
            raise ValueError(f"model_hash must be a non-empty string, got {self.model_hash!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (parameters, buffers and optimizer state)."""
        total = sum(t.numel() * t.element_size() for t in self.params.values())
        return total + sum(t.numel() * t.element_size() for t in _tensors(self.optimizer))


# ---- capture and restore ------------------------------------------------------------------

def capture(module: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int, step: int,
            model_hash: str, meta: Mapping[str, Any] | None = None) -> StageState:
    """Copy the module's and optimizer's state to CPU. Call it between optimizer steps."""
    params = {name: _copy(t) for name, t in module.state_dict().items()}
    return StageState(stage=stage, step=step, model_hash=model_hash, params=params,
                      optimizer=_copy_tree(optimizer.state_dict()), meta=dict(meta or {}))


def restore(state: StageState, module: nn.Module, optimizer: torch.optim.Optimizer, *,
            stage: int, model_hash: str) -> None:
    """Load ``state`` into ``module`` and ``optimizer`` (in place: parameters keep their
    identity). Everything is checked first: on ``StateMismatch`` nothing has changed."""
    if state.model_hash != model_hash:
        raise StateMismatch(f"the state is of model {state.model_hash}, this peer trains "
                            f"{model_hash}")
    if state.stage != stage:
        raise StateMismatch(f"the state is of stage {state.stage}, this peer serves stage {stage}")
    mine = module.state_dict()
    missing = sorted(set(mine) - set(state.params))
    extra = sorted(set(state.params) - set(mine))
    if missing or extra:
        raise StateMismatch(f"stage {stage} state has different tensors: missing {missing[:5]}, "
                            f"unexpected {extra[:5]}")
    for name, t in mine.items():
        got = state.params[name]
        if tuple(got.shape) != tuple(t.shape) or got.dtype != t.dtype:
            raise StateMismatch(f"stage {stage} tensor {name!r} is {got.dtype} "
                                f"{tuple(got.shape)} in the state, {t.dtype} {tuple(t.shape)} here")
    _check_optimizer(state.optimizer, optimizer, stage)
    module.load_state_dict(dict(state.params), strict=True)
    # the optimizer keeps the tensors it is given and updates them in place: give it copies
    optimizer.load_state_dict(_copy_tree(state.optimizer))


def _check_optimizer(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                     stage: int) -> None:
    groups = saved.get("param_groups")
    entries = saved.get("state")
    if not isinstance(groups, list) or not isinstance(entries, dict):
        raise StateMismatch(f"stage {stage} optimizer state lacks 'param_groups' or 'state'")
    if len(groups) != len(optimizer.param_groups):
        raise StateMismatch(f"stage {stage} optimizer state has {len(groups)} parameter groups, "
                            f"this optimizer {len(optimizer.param_groups)}")
    params: dict[Any, torch.Tensor] = {}
    for i, (g, mine) in enumerate(zip(groups, optimizer.param_groups)):
        ids = g.get("params") if isinstance(g, dict) else None
        if not isinstance(ids, list) or len(ids) != len(mine["params"]):
            raise StateMismatch(f"stage {stage} optimizer group {i} has "
                                f"{len(ids) if isinstance(ids, list) else '?'} parameters, this "
                                f"optimizer {len(mine['params'])}")
        params.update(zip(ids, mine["params"]))
    masters = saved.get("masters")  # float32 master weights (``SwarmOptimizer``)
    if masters is not None:
        reason = masters_mismatch(masters, [tuple(p.shape) for g in optimizer.param_groups
                                            for p in g["params"]])
        if reason is not None:
            raise StateMismatch(f"stage {stage}: {reason}")
    for key, entry in entries.items():
        if key not in params or not isinstance(entry, dict):
            raise StateMismatch(f"stage {stage} optimizer state names unknown parameter {key!r}")
        shape = tuple(params[key].shape)
        for name, value in entry.items():
            # element-wise state (AdamW, LAMB moments) has its parameter's shape; scalars pass
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                raise StateMismatch(f"stage {stage} optimizer state {name!r} of parameter {key} "
                                    f"is {tuple(value.shape)}, the parameter is {shape}")


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", copy=True)


def _copy_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _copy(obj)
    if isinstance(obj, dict):
        return {k: _copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_tree(v) for v in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ---- encoding -----------------------------------------------------------------------------

def digest(data: bytes | bytearray | memoryview) -> str:
    """blake2b-256 of encoded bytes, hex: the identity of a snapshot."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def layout(state: StageState) -> Layout:
    """The state's encoding as its header and its tensors' own memory (no copy of a tensor):
    what checkpoints, digests and transfer chunks are made from, piece by piece."""
    _require_little_endian()
    if _tensors(state.meta):
        raise ValueError("stage state meta must not hold tensors")
    table: list[torch.Tensor] = []
    header = {"stage": state.stage, "step": state.step, "model_hash": state.model_hash,
              "meta": _to_wire(state.meta, table),
              "params": [[str(name), _to_wire(t, table)] for name, t in state.params.items()],
              "optimizer": _to_wire(state.optimizer, table)}
    header["tensors"] = [[_DTYPE_NAMES[t.dtype], list(t.shape)] for t in table]
    body = _pack(header)
    return Layout(PREFIX.pack(MAGIC, VERSION, len(body)) + body, table)


def encode(state: StageState) -> bytes:
    """The state as bytes (deterministic: equal states give equal bytes). A whole copy: for
    large states use :func:`layout`."""
    return b"".join(layout(state).pieces())


def _to_wire(obj: Any, table: list[torch.Tensor]) -> Any:
    """A tree msgpack packs as it is: tensors become references into ``table``."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor dtype {obj.dtype} cannot be encoded; known: "
                             f"{sorted(DTYPES)}")
        if obj.dim() > MAX_DIMS:
            raise ValueError(f"tensor of {obj.dim()} dims; at most {MAX_DIMS}")
        table.append(obj.detach().to("cpu").contiguous())
        return msgpack.ExtType(_EXT_TENSOR, _INDEX.pack(len(table) - 1))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack([_to_wire(v, table) for v in obj]))
    if isinstance(obj, Mapping):
        return {_plain(k): _to_wire(v, table) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_wire(v, table) for v in obj]
    return _plain(obj)


def _plain(obj: Any) -> Any:
    if obj is None or type(obj) in (bool, int, float, str, bytes):
        return obj
    for kind in (bool, int, float, str):  # subclasses: IntEnum, numpy-free scalars, ...
        if isinstance(obj, kind):
            return kind(obj)
    raise ValueError(f"cannot encode a {type(obj).__name__} in a stage state")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover
        raise NotImplementedError("stage state encoding needs a little-endian machine")


# ---- decoding (hostile input) -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Ref:
    index: int


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_STATE_BYTES
           ) -> StageState:
    """Parse bytes from :func:`encode`; ``BadStageState`` for anything else."""
    view = memoryview(data).cast("B")
    return decode_from(BytesReader(view), len(view), max_bytes=max_bytes)


def decode_from(reader: Reader, total: int, *, max_bytes: int = MAX_STATE_BYTES,
                piece: int = PIECE_BYTES) -> StageState:
    """Parse the ``total`` bytes ``reader`` gives (a file, :class:`BytesReader`): the header
    first, then each tensor read straight into its own memory, ``piece`` bytes at a time, so
    nothing but the state and one piece is held. ``BadStageState`` for anything wrong."""
    start, header = _read_header(reader, total, max_bytes)
    stage, step, model_hash = _identity(header)
    meta = header.get("meta")
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise BadStageState("stage state meta must be a map with string keys")
    _check_tree(meta, 0, allow_refs=False)
    specs = _tensor_specs(header.get("tensors"), total - start, max_bytes)
    param_refs, optimizer = _references(header, len(specs))
    tensors = _materialize(reader, specs, piece)
    params = {name: tensors[i] for name, i in param_refs.items()}
    return StageState(stage=stage, step=step, model_hash=model_hash, params=params,
                      optimizer=_resolve(optimizer, tensors), meta=meta)


def peek(reader: Reader, total: int, *, max_bytes: int = MAX_STATE_BYTES
         ) -> tuple[int, int, str]:
    """(stage, step, model hash) of an encoded state, read from its header alone."""
    _, header = _read_header(reader, total, max_bytes)
    return _identity(header)


def _identity(header: dict[Any, Any]) -> tuple[int, int, str]:
    stage, step, model_hash = header.get("stage"), header.get("step"), header.get("model_hash")
    if not _is_int(stage) or stage < 0 or not _is_int(step) or step < 0:
        raise BadStageState(f"stage state has invalid stage {stage!r} or step {step!r}")
    if not isinstance(model_hash, str) or not 0 < len(model_hash) <= MAX_MODEL_HASH_CHARS:
        raise BadStageState("stage state has an invalid model hash")
    return stage, step, model_hash


def _read_exactly(reader: Reader, into: memoryview, what: str) -> None:
    done = 0
    while done < len(into):
        n = reader.readinto(into[done:])
        if not n:
            raise BadStageState(f"stage state is truncated: it ends inside {what}")
        done += n


def _read_header(reader: Reader, total: int, max_bytes: int) -> tuple[int, dict[Any, Any]]:
    """Where the tensor data starts, and the header map."""
    _require_little_endian()
    if total > max_bytes:
        raise BadStageState(f"stage state of {total} bytes is over the limit of {max_bytes}")
    if total < PREFIX.size:
        raise BadStageState(f"stage state of {total} bytes is shorter than its prefix")
    prefix = bytearray(PREFIX.size)
    _read_exactly(reader, memoryview(prefix), "its prefix")
    magic, version, header_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise BadStageState(f"not a stage state (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise BadStageState(f"stage state format version {version} is not known here "
                            f"(expected {VERSION})")
    if header_len > min(MAX_HEADER_BYTES, total - PREFIX.size):
        raise BadStageState(f"stage state header of {header_len} bytes does not fit "
                            f"(limit {MAX_HEADER_BYTES}, {total - PREFIX.size} present)")
    body = bytearray(header_len)
    _read_exactly(reader, memoryview(body), "its header")
    header = _unpack(bytes(body), 0)
    if not isinstance(header, dict):
        raise BadStageState("stage state header is not a map")
    return PREFIX.size + header_len, header


def _references(header: dict[Any, Any], count: int) -> tuple[dict[str, int], dict[Any, Any]]:
    """The parameters' tensor indices by name, and the optimizer tree; every one of the
    ``count`` tensors is referenced exactly once."""
    used = [False] * count

    def take(ref: Any) -> int:
        if not isinstance(ref, _Ref) or ref.index >= count or used[ref.index]:
            raise BadStageState("stage state references a tensor that is missing or reused")
        used[ref.index] = True
        return ref.index

    raw_params = header.get("params")
    if not isinstance(raw_params, list):
        raise BadStageState("stage state params must be a list")
    param_refs: dict[str, int] = {}
    for item in raw_params:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise BadStageState("stage state params must be [name, tensor] pairs")
        if item[0] in param_refs:
            raise BadStageState(f"stage state names parameter {item[0][:100]!r} twice")
        param_refs[item[0]] = take(item[1])
    optimizer = header.get("optimizer")
    if not isinstance(optimizer, dict):
        raise BadStageState("stage state optimizer must be a map")
    _check_tree(optimizer, 0, allow_refs=True, take=take)
    if not all(used):
        raise BadStageState("stage state carries tensors that nothing references")
    return param_refs, optimizer


def check_finite_state(state: StageState) -> None:
    """Raise :class:`NonFiniteState` if a floating-point tensor of ``state`` (parameters,
    buffers, optimizer state) holds NaN or Inf: such a state is never restored or served.
    Touches every byte: call it off the event loop."""
    named = [(f"parameter {n!r}", t) for n, t in state.params.items()]
    named += [("optimizer state", t) for t in _tensors(state.optimizer)]
    for what, t in named:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise NonFiniteState(f"stage {state.stage} state at step {state.step}: {what} "
                                 f"holds NaN/Inf values")


def _unpack(data: memoryview | bytes, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise BadStageState(f"stage state is nested more than {MAX_DEPTH} levels deep")

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == _EXT_TENSOR and len(payload) == _INDEX.size:
            return _Ref(_INDEX.unpack(payload)[0])
        if code == _EXT_TUPLE:
            inner = _unpack(payload, depth + 1)
            if not isinstance(inner, list):
                raise BadStageState("stage state tuple is not a list")
            return tuple(inner)
        raise BadStageState(f"stage state holds unknown extension type {code}")

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook,
                               use_list=True)
    except BadStageState:
        raise
    except Exception as exc:  # msgpack raises many types for garbage
        raise BadStageState(f"stage state header is not valid msgpack: "
                            f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _check_tree(obj: Any, depth: int, *, allow_refs: bool, take: Any = None) -> None:
    """Plain values only: None, bool, int, float, str, bytes, lists/tuples, maps with str or
    int keys, and (in the optimizer) tensor references, each taken once."""
    if depth > MAX_DEPTH:
        raise BadStageState(f"stage state is nested more than {MAX_DEPTH} levels deep")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return
    if isinstance(obj, _Ref):
        if not allow_refs:
            raise BadStageState("stage state meta must not hold tensors")
        take(obj)
        return
    if isinstance(obj, (list, tuple)):
        for v in obj:
            _check_tree(v, depth + 1, allow_refs=allow_refs, take=take)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise BadStageState(f"stage state map key of type {type(k).__name__}")
            _check_tree(v, depth + 1, allow_refs=allow_refs, take=take)
        return
    raise BadStageState(f"stage state holds a value of type {type(obj).__name__}")


def _tensor_specs(raw: Any, available: int, max_bytes: int
                  ) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    if not isinstance(raw, list):
        raise BadStageState("stage state tensor table must be a list")
    specs, total = [], 0
    for i, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 2):
            raise BadStageState(f"stage state tensor {i} must be [dtype, shape]")
        name, shape = item
        if not isinstance(name, str) or name not in DTYPES:
            raise BadStageState(f"stage state tensor {i} has unknown dtype {str(name)[:40]!r}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
                and all(_is_int(d) and d >= 0 for d in shape)):
            raise BadStageState(f"stage state tensor {i} has an invalid shape")
        dtype = DTYPES[name]
        if math.prod(d for d in shape if d) * dtype.itemsize > max(max_bytes, available):
            # an empty tensor (a 0 among the dims) still gets strides from the other dims
            raise BadStageState(f"stage state tensor {i} has an impossible shape "
                                f"{shape[:MAX_DIMS]}")
        size = math.prod(shape) * dtype.itemsize  # exact: Python integers
        total += size
        if total > available:
            raise BadStageState(f"stage state tensors need more than the {available} data bytes "
                                f"present (tensor {i} of shape {shape[:MAX_DIMS]})")
        specs.append((dtype, tuple(shape), size))
    if total != available:
        raise BadStageState(f"stage state tensors take {total} bytes, {available} follow the "
                            f"header")
    return specs


def _materialize(reader: Reader, specs: list[tuple[torch.dtype, tuple[int, ...], int]],
                 piece: int) -> list[torch.Tensor]:
    """Each tensor, its bytes read into its own memory ``piece`` bytes at a time."""
    out = []
    for i, (dtype, shape, size) in enumerate(specs):
        t = torch.empty(shape, dtype=dtype)
        if size:
            view = byte_view(t)
            for a in range(0, size, piece):
                _read_exactly(reader, view[a:a + piece], f"tensor {i}")
        if dtype == torch.bool and size and bool((t.view(torch.uint8) > 1).any()):
            raise BadStageState("stage state bool tensor holds bytes other than 0 and 1")
        out.append(t)
    return out


def _resolve(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _resolve(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_resolve(v, tensors) for v in obj)
    return obj


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def state_bytes_bound(module: nn.Module, *, optimizer_copies: int = 3) -> tuple[int, int]:
    """(fewest, most) bytes an encoded state of ``module`` can take: at least its own tensors'
    bytes, at most those plus ``optimizer_copies`` float32 copies of its parameters (AdamW and
    LAMB keep two moments, a bfloat16/float16 module's optimizer its float32 master weights:
    in float32 whatever the module's dtype) plus a full header. No copy is made (only sizes
    are read)."""
    own = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    float32 = sum(p.numel() * 4 for p in module.parameters())
    return own, own + float32 * optimizer_copies + PREFIX.size + MAX_HEADER_BYTES + (1 << 20)
