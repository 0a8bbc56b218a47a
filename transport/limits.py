"""Receiver-side size limits, checked before any buffer is allocated."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    #: largest msgpack header of one frame
    max_header_bytes: int = 64 * 1024
    #: largest payload (bytes on the wire) of one message
    max_message_bytes: int = 256 * MiB
    #: largest decoded tensor (numel * element size), guards codecs that expand (int8, zstd)
    max_tensor_bytes: int = 1024 * MiB
    #: most tensors in one message
    max_tensors: int = 64
    #: most dimensions of one tensor
    max_dims: int = 8
    #: size of the pieces a payload is streamed in
    chunk_bytes: int = 1 * MiB

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_message_bytes", "max_tensor_bytes",
                     "max_tensors", "max_dims", "chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")
