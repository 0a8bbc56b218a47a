"""Windows of a token array: the training part and the held-out part, each read as one stream.

The token array (``swarmd.data.tokenfile``) holds every document, each ended by end-of-text.
:func:`split` cuts it, by held-out units (``swarmd.data.heldout``), into two :class:`Runs`:
the training part (every unit not held out) and the held-out part, each a sequence of
contiguous runs of the array read as if they were one. Window ``w`` of a part is its tokens
``w * (seq_len + 1)`` to ``(w + 1) * (seq_len + 1)``: windows never overlap, and a window of
the training part never holds a held-out token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swarmd.data.heldout import held_out, unit_size, units

__all__ = ["Runs", "TokenWindows", "split", "pairs", "Batch"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)
class Runs:
    """Runs of a token array read as one stream: run ``r`` is ``starts[r]`` onwards in the
    array, and ``offsets[r]`` to ``offsets[r + 1]`` in the stream."""

    starts: np.ndarray   # (R,) int64
    offsets: np.ndarray  # (R + 1,) int64, offsets[0] == 0

    @classmethod
    def of(cls, unit_starts: np.ndarray, unit_lengths: np.ndarray, mask: np.ndarray) -> Runs:
        """The units chosen by ``mask``, adjacent ones merged (units tile the array)."""
        chosen = np.flatnonzero(mask)
        if not len(chosen):
            return cls(np.zeros(0, np.int64), np.zeros(1, np.int64))
        begins = np.ones(len(chosen), bool)
        begins[1:] = np.diff(chosen) != 1
        run = np.cumsum(begins) - 1
        lengths = np.zeros(int(run[-1]) + 1, np.int64)
        np.add.at(lengths, run, unit_lengths[chosen].astype(np.int64))
        return cls(unit_starts[chosen][begins].astype(np.int64),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    def locate(self, positions: np.ndarray) -> np.ndarray:
        """Where stream positions lie in the array."""
        run = np.searchsorted(self.offsets, positions, side="right") - 1
        return self.starts[run] + (positions - self.offsets[run])

    def gather(self, tokens: np.ndarray, begins: np.ndarray, length: int) -> np.ndarray:
        """The ``length`` tokens from each stream position of ``begins``: (B, length) int64."""
        out = np.empty((len(begins), length), np.int64)
        run = np.searchsorted(self.offsets, begins, side="right") - 1
        for row, (begin, r) in enumerate(zip(begins.tolist(), run.tolist())):
            if begin + length <= self.offsets[r + 1]:  # within one run: one slice
                at = int(self.starts[r] + begin - self.offsets[r])
                out[row] = tokens[at:at + length]
            else:  # across runs
                out[row] = tokens[self.locate(np.arange(begin, begin + length))]
        return out


def split(doc_starts: np.ndarray, doc_keys: np.ndarray, tokens: int, *, window: int,
          need: int) -> tuple[Runs, Runs]:
    """(training part, held-out part) of a token array of ``tokens`` tokens whose documents
    start at ``doc_starts`` with keys ``doc_keys``; the held-out part holds at least ``need``
    tokens when the corpus has them."""
    size = unit_size(tokens, window)
    starts, lengths, hashes = units(doc_starts, doc_keys, tokens, size)
    mask = held_out(hashes, lengths, need=need)
    return Runs.of(starts, lengths, ~mask), Runs.of(starts, lengths, mask)


@dataclass(frozen=True, eq=False)
class TokenWindows:
    """Windows of ``length`` (seq_len + 1) tokens of the training and held-out parts."""

    tokens: np.ndarray  # (N,) uint8/uint16/uint32, memory-mapped
    train: Runs
    val: Runs
    length: int

    @property
    def train_windows(self) -> int:
        return self.train.total // self.length

    @property
    def val_windows(self) -> int:
        return self.val.total // self.length

    def train_tokens(self, windows: list[int]) -> np.ndarray:
        """The tokens of training windows ``windows``: (B, length) int64."""
        return self.train.gather(self.tokens, np.asarray(windows, np.int64) * self.length,
                                 self.length)

    def batch(self, windows: list[int]) -> Batch:
        """x, y int64 (B, seq_len) of training windows; y[:, t] is the token after x[:, t]."""
        return pairs(self.train_tokens(windows))

    def val_batches(self, count: int, batch: int) -> list[Batch]:
        """``count`` fixed batches of held-out windows spread evenly over the held-out part:
        the same for every evaluation, trainer and process."""
        have, want = self.val_windows, count * batch
        if have < want:
            raise ValueError(f"{have} held-out windows for {want}")
        chosen = np.round(np.linspace(0, have - 1, want)).astype(np.int64)
        rows = self.val.gather(self.tokens, chosen * self.length, self.length)
        return [pairs(rows[i * batch:(i + 1) * batch]) for i in range(count)]


def pairs(rows: np.ndarray) -> Batch:
    """Inputs and targets of (B, seq_len + 1) windows."""
    t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()
