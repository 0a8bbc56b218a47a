"""Byte-level training data: a corpus of bytes, split into training and validation.

:func:`load_corpus` reads a text file, a directory tree of text files, or (with no path) the
Python standard library's own sources, so a swarm can train on any machine with nothing to
download. Batches are windows of ``seq_len + 1`` bytes: inputs are the first ``seq_len``,
targets the last ``seq_len`` (the next byte of each position).

The tools' benchmarks and simulators use this in-memory byte corpus; ``swarmd train`` reads
through :mod:`swarmd.data` (a cached token file, held out by document, shuffled, sharded).
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmd.errors import DataError

__all__ = ["Corpus", "load_corpus", "stdlib_dir", "DataError", "VAL_FRACTION", "SNIFF_BYTES"]

log = logging.getLogger(__name__)

#: share of the bytes, taken from the end, held out for validation
VAL_FRACTION = 0.05
#: a file with a NUL byte among its first SNIFF_BYTES bytes is taken for binary and skipped
SNIFF_BYTES = 8192
#: directories of the standard library that are not the standard library
_NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)
class Corpus:
    """All bytes of the corpus; ``data[:val_start]`` trains, ``data[val_start:]`` validates."""

    data: torch.Tensor           # (N,) uint8
    val_start: int
    files: tuple[Path, ...] = ()  # where the bytes came from, in order

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, *, seq_len: int, files: tuple[Path, ...] = (),
                   origin: str = "corpus") -> Corpus:
        """Split ``data``: the last 5% (at least ``seq_len + 1`` bytes) validates.

        Raises :class:`DataError` when either part would be shorter than ``seq_len + 1``."""
        n, need = len(data), 2 * (seq_len + 1)
        if n == 0:
            raise DataError(f"{origin}: no bytes to train on; point data.path at a text file or "
                            f'a directory of text files, or set it to "" for Python\'s sources')
        if n < need:
            raise DataError(
                f"{origin}: {n} bytes is too short for seq_len {seq_len}: it takes at least "
                f"{need} bytes (seq_len + 1 to train on, as many to validate on); point "
                f"data.path at more text or lower model.seq_len")
        val_len = max(math.ceil(n * VAL_FRACTION), seq_len + 1)
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return cls(tensor, n - val_len, tuple(files))

    @property
    def train(self) -> torch.Tensor:
        return self.data[: self.val_start]

    @property
    def val(self) -> torch.Tensor:
        return self.data[self.val_start:]

    def __len__(self) -> int:
        return self.data.numel()

    def _windows(self, split: str, seq_len: int) -> torch.Tensor:
        """Every window of ``seq_len + 1`` consecutive bytes of a split: (count, seq_len + 1)."""
        if split not in ("train", "val"):
            raise ValueError(f'unknown split "{split}": expected "train" or "val"')
        part = self.train if split == "train" else self.val
        if not 1 <= seq_len < part.numel():
            raise ValueError(f"seq_len {seq_len} does not fit the {split} split of "
                             f"{part.numel()} bytes: expected 1 to {part.numel() - 1}")
        return part.unfold(0, seq_len + 1, 1)  # a view, nothing copied

    @staticmethod
    def _pairs(windows: torch.Tensor) -> Batch:
        batch = windows.long()  # (B, T + 1)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # x, y: (B, T)

    def sample_batch(self, split: str, batch_size: int, seq_len: int,
                     generator: torch.Generator) -> Batch:
        """``batch_size`` windows at random positions: x, y int64 (B, T); y[:, t] is the byte
        that follows x[:, t]."""
        windows = self._windows(split, seq_len)
        starts = torch.randint(windows.size(0), (batch_size,), generator=generator)
        return self._pairs(windows[starts])

    def val_batches(self, batch_size: int, seq_len: int, count: int) -> list[Batch]:
        """``count`` fixed validation batches, windows spread evenly over the validation split:
        the same for every step and every process, so validation losses compare."""
        windows = self._windows("val", seq_len)
        starts = torch.linspace(0, windows.size(0) - 1, count * batch_size).long()
        return [self._pairs(windows[chunk]) for chunk in starts.view(count, batch_size)]


def stdlib_dir() -> Path:
    """Where this Python's standard library sources lie."""
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, prune: frozenset[str]) -> Iterator[Path]:
    """Regular files under ``root`` in sorted order, not following or yielding symlinks."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        log.debug("skipping unreadable directory %s: %s", root, exc.strerror)
        return
    for entry in entries:
        if entry.is_symlink():
            continue
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in prune:
                yield from _walk(Path(entry.path), prune)
        elif entry.is_file(follow_symlinks=False):
            yield Path(entry.path)


def _read_text(path: Path, limit: int, *, sniff: bool) -> bytes | None:
    """Up to ``limit`` bytes of ``path``; None when unreadable or (with ``sniff``) binary."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
            if sniff and b"\0" in head:
                log.debug("skipping binary file %s", path)
                return None
            return head[:limit] + (f.read(limit - len(head)) if limit > len(head) else b"")
    except OSError as exc:
        log.debug("skipping unreadable file %s: %s", path, exc.strerror)
        return None


def load_corpus(path: Path | None, *, max_bytes: int = 32 << 20, seq_len: int = 128) -> Corpus:
    """Read the corpus, at most ``max_bytes`` of it.

    ``path`` is a file (read as it is), a directory (its regular files in sorted order, skipping
    symlinks, unreadable files and binary ones: a NUL among the first 8 KiB), or None for the
    ``*.py`` files of the Python standard library (which differ a little between versions).
    ``seq_len`` only sets the shortest acceptable corpus, see :meth:`Corpus.from_bytes`.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes = {max_bytes}: expected a positive integer")
    if path is None:
        root, origin = stdlib_dir(), "the Python standard library"
        files: Iterator[Path] = (p for p in _walk(root, _NOT_STDLIB) if p.suffix == ".py")
    else:
        root, origin = Path(path), str(path)
        if not root.exists():
            raise DataError(f"{path}: data path not found; set data.path to a text file or a "
                            f'directory of text files, or to "" for Python\'s own sources')
        if root.is_dir():
            files = _walk(root, frozenset())
        elif root.is_file():
            text = _read_text(root, max_bytes, sniff=False)
            if text is None:
                raise DataError(f"{path}: cannot read the data file; check its permissions")
            return Corpus.from_bytes(text, seq_len=seq_len, files=(root,), origin=origin)
        else:
            raise DataError(f"{path}: not a regular file or a directory; set data.path to a "
                            "text file or a directory of text files")
    buffer, used, skipped = bytearray(), [], 0
    for file in files:
        text = _read_text(file, max_bytes - len(buffer), sniff=True)
        if text is None:
            skipped += 1
            continue
        buffer += text
        used.append(file)
        if len(buffer) >= max_bytes:
            break
    if not buffer:
        raise DataError(f"{origin}: no text found under {root} ({skipped} binary or unreadable "
                        f"file(s) skipped); point data.path at a text file or a directory of "
                        f"text files")
    log.info("corpus: %d bytes from %d file(s) of %s, %d skipped", len(buffer), len(used),
             origin, skipped)
    return Corpus.from_bytes(buffer, seq_len=seq_len, files=tuple(used), origin=origin)
