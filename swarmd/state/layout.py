"""An encoded stage state without the copy: where each of its bytes lies.

A :class:`Layout` is the encoding's prefix and header (bytes) followed by the tensors of the
state (contiguous CPU tensors, referenced, never copied). Checkpoints are written, digests and
chunk checksums computed and transfer chunks served from it piece by piece, so the memory an
encoded state takes beside the state itself is one piece (``swarmd.state.encoding.layout``
builds one). Reading the other way, :class:`Reader` is what decoding reads from: a file, or
bytes in memory (:class:`BytesReader`), filled into the tensors' own memory.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator
from typing import Protocol

import torch

__all__ = ["Layout", "Reader", "BytesReader", "HashingReader", "PIECE_BYTES"]

#: the default piece: the most bytes copied or held at once beside the state
PIECE_BYTES = 4 << 20


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class Layout:
    """``head`` then the bytes of each of ``tensors`` (contiguous, on the CPU)."""

    __slots__ = ("head", "tensors", "_segments", "_starts", "total")

    def __init__(self, head: bytes, tensors: list[torch.Tensor]) -> None:
        self.head = head
        self.tensors = tuple(tensors)
        segments = [memoryview(head)]
        segments += [byte_view(t) for t in self.tensors if t.numel()]
        self._segments = segments
        starts, offset = [], 0
        for seg in segments:
            starts.append(offset)
            offset += len(seg)
        self._starts = starts
        self.total = offset

    def ranges(self, start: int, end: int) -> Iterator[memoryview]:
        """Views covering bytes ``start`` to ``end`` in order (no copy)."""
        if not 0 <= start <= end <= self.total:
            raise ValueError(f"range {start}..{end} outside 0..{self.total}")
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while start < end and i < len(self._segments):
            seg, base = self._segments[i], self._starts[i]
            a, b = start - base, min(len(seg), end - base)
            if a < b:
                yield seg[a:b]
                start = base + b
            i += 1

    def read(self, start: int, end: int) -> bytearray:
        """A copy of bytes ``start`` to ``end``."""
        out = bytearray(end - start)
        at = 0
        for view in self.ranges(start, end):
            out[at:at + len(view)] = view
            at += len(view)
        return out

    def pieces(self, piece: int = PIECE_BYTES) -> Iterator[memoryview]:
        """Every byte, in views of at most ``piece`` bytes (no copy)."""
        for seg in self._segments:
            for a in range(0, len(seg), piece):
                yield seg[a:a + piece]

    def digest(self, piece: int = PIECE_BYTES) -> str:
        """blake2b-256 of every byte (``swarmd.state.encoding.digest`` of the encoding)."""
        h = hashlib.blake2b(digest_size=32)
        for view in self.pieces(piece):
            h.update(view)
        return h.hexdigest()


class Reader(Protocol):
    """What decoding reads from: ``readinto`` as files have it."""

    def readinto(self, buffer: memoryview) -> int: ...


class BytesReader:
    """A :class:`Reader` over bytes in memory (no copy)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._at = 0

    def readinto(self, buffer: memoryview) -> int:
        n = min(len(buffer), len(self._view) - self._at)
        buffer[:n] = self._view[self._at:self._at + n]
        self._at += n
        return n


class HashingReader:
    """A :class:`Reader` that hashes (blake2b-256) what it reads and counts it."""

    def __init__(self, source: Reader) -> None:
        self.source = source
        self.hash = hashlib.blake2b(digest_size=32)
        self.count = 0

    def readinto(self, buffer: memoryview) -> int:
        n = self.source.readinto(buffer)
        if n:
            self.hash.update(buffer[:n])
            self.count += n
        return n
