"""Which parts of a corpus are held out for validation. Pure: no I/O.

Every document has a 64-bit key: a hash of its name (its path relative to the corpus root, or
a dataset's name) and its number in that file (:func:`doc_key`, salted with :data:`SALT`), the
same on every machine whatever order the files are read in. The unit held out is a block of a
document: its tokens cut every :func:`unit_size` tokens (``min(16384, max(seq_len + 1,
tokens / 200))``: most documents are one unit; a single large text file is many, so even a
one-file corpus has a held-out set spread over it). A unit's hash mixes its document's key
with its block number (:func:`unit_hashes`). A unit is held out when its hash falls in the
lowest ``1 / RATE`` of the range (one unit in :data:`RATE`); when those hold fewer tokens than
the validation batches need, more units are taken in the order of their hashes until they do
(:func:`held_out`). The keys do not depend on ``training.seed``: runs of different seeds are
measured on the same held-out set. Held-out units are never part of the training windows.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["UNIT_TOKENS", "RATE", "SALT", "doc_key", "unit_size", "units", "unit_hash",
           "unit_hashes", "held_out", "is_held_out", "shard_of_doc"]

#: a document is held out (or not) in blocks of at most this many tokens
UNIT_TOKENS = 1 << 14
#: one unit in RATE is held out (more when the validation batches need more tokens)
RATE = 200
#: what the document keys are salted with (change it to draw another held-out set)
SALT = b"swarmd-held-out-1"
_TOP = 1 << 64
_MASK = _TOP - 1
_GOLDEN = 0x9E3779B97F4A7C15
_SHARD = 0xD1B54A32D192ED03


def doc_key(name: str, doc: int) -> int:
    """The 64-bit key of document ``doc`` of the file (or dataset) ``name``."""
    h = hashlib.blake2b(f"{name}\0{doc}".encode(), digest_size=8, key=SALT)
    return int.from_bytes(h.digest(), "little")


def _mix(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """:func:`_mix` over a uint64 array (numpy's uint64 products wrap, as the mask does)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def unit_hash(key: int, block: int) -> int:
    """The hash of block ``block`` of the document of ``key``."""
    return _mix(key ^ (block * _GOLDEN & _MASK))


def unit_hashes(keys: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """:func:`unit_hash` over arrays (uint64 keys, int64 blocks)."""
    with np.errstate(over="ignore"):
        salted = blocks.astype(np.uint64) * np.uint64(_GOLDEN)
    return _mix_array(keys.astype(np.uint64) ^ salted)


def shard_of_doc(key: int, count: int) -> int:
    """Which of ``count`` shards a document belongs to (the streamed fallback's shards), by a
    hash independent of the held-out one."""
    return _mix(key ^ _SHARD) % count


def is_held_out(hash_: int, rate: int = RATE) -> bool:
    """Whether a unit of this hash is held out by the rate alone."""
    return hash_ < _TOP // rate


def unit_size(tokens: int, window: int) -> int:
    """Tokens per held-out unit for a corpus of ``tokens`` tokens read in windows of
    ``window``: ``min(UNIT_TOKENS, max(window, tokens // RATE))``."""
    return min(UNIT_TOKENS, max(window, tokens // RATE))


def units(doc_starts: np.ndarray, doc_keys: np.ndarray, tokens: int, size: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The units of documents starting at ``doc_starts`` (int64, ascending, the last one
    ending at ``tokens``): (start, length, hash) of each, in corpus order."""
    lengths = np.diff(np.append(doc_starts, tokens)).astype(np.int64)
    blocks = (lengths + size - 1) // size  # a document of n tokens: ceil(n / size) units
    doc = np.repeat(np.arange(len(doc_starts)), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    block = np.arange(len(doc), dtype=np.int64) - first
    starts = doc_starts[doc] + block * size
    unit_lengths = np.minimum(size, lengths[doc] - block * size)
    return starts, unit_lengths, unit_hashes(doc_keys[doc], block)


def held_out(hashes: np.ndarray, lengths: np.ndarray, *, need: int,
             rate: int = RATE) -> np.ndarray:
    """Which units are held out (a bool mask): those whose hash is in the lowest ``1/rate``
    of the range, and then, while they hold fewer than ``need`` tokens, the units of the
    next lowest hashes. ``hashes`` uint64, ``lengths`` (tokens of each unit) int64."""
    if hashes.shape != lengths.shape:
        raise ValueError(f"{hashes.shape} hashes for {lengths.shape} lengths")
    mask = hashes < np.uint64(_TOP // rate)
    if int(lengths[mask].sum()) >= need or not len(hashes):
        return mask
    order = np.argsort(hashes, kind="stable")
    taken = np.cumsum(lengths[order])
    count = min(len(order), int(np.searchsorted(taken, need, side="left")) + 1)
    mask[order[:count]] = True
    return mask
