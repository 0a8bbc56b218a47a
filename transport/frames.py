"""Length-prefixed frames: the byte layout of one message on a stream. Pure: no I/O.

One frame::

    prefix   8 bytes  b"SW", version (u8), reserved (u8), header length (u32, big endian)
    header   msgpack map {"k": kind, "m": meta, "t": [tensor meta, ...], "n": payload bytes}
    payload  exactly "n" bytes: the encoded tensors, one after another

The reader learns every size before it allocates: the prefix bounds the header, the header
bounds the payload, and each tensor's declared size is checked against its codec metadata and
the configured ``Limits``. A stream that ends inside a frame is a truncation, never a clean end.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack

from transport import codecs
from transport.errors import LimitExceeded, LocalUsageError, MalformedFrame, PeerProtocolError
from transport.limits import Limits

MAGIC = b"SW"
VERSION = 1
PREFIX = struct.Struct(">2sBxI")
PREFIX_BYTES = PREFIX.size
MAX_KIND_CHARS = 64
#: the kind of an error reply; its meta is {"code": str, "message": str}
ERROR_KIND = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One message: a kind, small msgpack-able metadata and zero or more tensors."""

    kind: str
    meta: Mapping[str, Any] = field(default_factory=dict)
    tensors: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not 0 < len(self.kind) <= MAX_KIND_CHARS:
            raise LocalUsageError(f"message kind must be a 1..{MAX_KIND_CHARS} char string, got {self.kind!r}")
        if not isinstance(self.meta, Mapping):
            raise LocalUsageError(f"message meta must be a mapping, got {type(self.meta).__name__}")
        if not isinstance(self.tensors, tuple):
            object.__setattr__(self, "tensors", tuple(self.tensors))


def error_message(code: str, text: str) -> Message:
    return Message(kind=ERROR_KIND, meta={"code": str(code)[:64], "message": str(text)[:1000]})


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A validated header: every size in it is within limits and consistent."""

    kind: str
    meta: dict[str, Any]
    tensor_metas: tuple[dict[str, Any], ...]
    payload_bytes: int
    #: the msgpack header's own size
    header_bytes: int = 0

    @property
    def frame_bytes(self) -> int:
        """The whole frame on the wire: prefix, header and payload."""
        return PREFIX_BYTES + self.header_bytes + self.payload_bytes


@dataclass(frozen=True, slots=True)
class OutgoingFrame:
    """A frame ready to write: the prefix+header bytes, then the payload parts in order."""

    head: bytes
    parts: tuple[memoryview, ...]
    payload_bytes: int

    @property
    def total_bytes(self) -> int:
        return len(self.head) + self.payload_bytes


def encode_message(message: Message, spec: codecs.CodecSpec) -> OutgoingFrame:
    """Encode ``message`` with ``spec`` for its tensors (``spec.for_kind(message.kind)``: a
    rounding of its own for some kinds). CPU-bound for large tensors."""
    spec = spec.for_kind(message.kind) if message.tensors else spec
    encoded = [codecs.encode(t, spec) for t in message.tensors]
    parts = tuple(p for e in encoded for p in e.parts)
    payload_bytes = sum(e.nbytes for e in encoded)
    header = {"k": message.kind, "m": dict(message.meta), "t": [e.meta() for e in encoded],
              "n": payload_bytes}
    try:
        body = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalUsageError(f"message meta is not msgpack-serialisable: {exc}") from exc
    return OutgoingFrame(head=PREFIX.pack(MAGIC, VERSION, len(body)) + body, parts=parts,
                         payload_bytes=payload_bytes)


def parse_prefix(prefix: bytes, limits: Limits) -> int:
    """Return the header length announced by an 8-byte prefix, or raise a peer error."""
    if len(prefix) != PREFIX_BYTES:
        raise MalformedFrame(f"frame prefix must be {PREFIX_BYTES} bytes, got {len(prefix)}")
    magic, version, header_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise MalformedFrame(f"not a swarmd frame (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise MalformedFrame(f"frame version {version} is not spoken here (expected {VERSION})")
    if header_len == 0:
        raise MalformedFrame("empty frame header")
    if header_len > limits.max_header_bytes:
        raise LimitExceeded(f"frame header of {header_len} bytes is over the limit of "
                            f"{limits.max_header_bytes}")
    return header_len


def parse_header(body: bytes, limits: Limits) -> FrameHeader:
    """Decode and validate a header; the payload size it returns is safe to allocate."""
    try:
        header = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for garbage; all are the peer's fault
        raise MalformedFrame(f"frame header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedFrame(f"frame header must be a map, got {type(header).__name__}")
    kind, meta, metas, n = header.get("k"), header.get("m", {}), header.get("t", []), header.get("n")
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND_CHARS:
        raise MalformedFrame(f"frame kind must be a 1..{MAX_KIND_CHARS} char string, got {kind!r}")
    if not isinstance(meta, dict):
        raise MalformedFrame("frame meta must be a map")
    if not isinstance(metas, list):
        raise MalformedFrame("frame tensor list must be an array")
    if len(metas) > limits.max_tensors:
        raise LimitExceeded(f"{len(metas)} tensors in one message, limit {limits.max_tensors}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise MalformedFrame(f"frame payload size must be a non-negative integer, got {n!r}")
    if n > limits.max_message_bytes:
        raise LimitExceeded(f"message payload of {n} bytes is over the limit of "
                            f"{limits.max_message_bytes}")
    declared = 0
    for i, tmeta in enumerate(metas):
        if not isinstance(tmeta, dict):
            raise MalformedFrame(f"tensor {i} metadata must be a map")
        try:
            size = codecs.expected_payload_bytes(tmeta, limits)
        except PeerProtocolError:
            raise
        except Exception as exc:  # defensive: a codec must only raise typed errors
            raise MalformedFrame(f"tensor {i} metadata is invalid: {exc}") from None
        if tmeta.get("nbytes") != size:
            raise MalformedFrame(f"tensor {i} declares {tmeta.get('nbytes')!r} payload bytes, "
                                 f"its metadata implies {size}")
        declared += size
    if declared != n:
        raise MalformedFrame(f"tensors declare {declared} payload bytes, frame says {n}")
    return FrameHeader(kind=kind, meta=meta, tensor_metas=tuple(metas), payload_bytes=n,
                       header_bytes=len(body))


def split_payload(header: FrameHeader, payload: memoryview) -> list[memoryview]:
    """Cut a received payload into the per-tensor slices the header declares."""
    if len(payload) != header.payload_bytes:
        raise MalformedFrame(f"payload is {len(payload)} bytes, header says {header.payload_bytes}")
    out, offset = [], 0
    for tmeta in header.tensor_metas:
        size = tmeta["nbytes"]
        out.append(payload[offset:offset + size])
        offset += size
    return out


def decode_message(header: FrameHeader, payload: memoryview, limits: Limits) -> Message:
    """Decode the tensors of a received frame. Tensors may alias ``payload`` (codec none)."""
    slices = split_payload(header, payload)
    tensors = tuple(codecs.decode(m, s, limits) for m, s in zip(header.tensor_metas, slices))
    return Message(kind=header.kind, meta=header.meta, tensors=tensors)
