"""Which training window comes next, and which windows a trainer owns. Pure: the seed is passed in.

The training part of a corpus is cut into ``W`` windows of ``seq_len + 1`` tokens, numbered
``0 .. W-1`` (``swarmd.data.windows``). A trainer of shard ``i/n`` owns the windows
``i, i + n, i + 2n, ...`` (:class:`Shard`): every window belongs to exactly one shard, so
trainers of distinct shards never train on the same window, in any epoch. Each epoch a trainer
reads its windows in a fresh order: :class:`Permutation`, a keyed bijection of ``0 .. N-1``
(a Feistel network over the next even power of two, walking cycles back into range), keyed by
``(seed, epoch, shard)``. It needs no table, so a corpus of 10^9 windows costs nothing to
shuffle, and it is the same on every machine and numpy version: ``(epoch, index)``
(:class:`Cursor`) is all a trainer saves to continue with exactly the next window.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from swarmd.errors import DataError

__all__ = ["Permutation", "Shard", "Cursor", "WindowOrder", "parse_shard", "auto_shard",
           "mix_key"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
#: Feistel rounds: 6 mix the halves well for an ordering (not for cryptography)
ROUNDS = 6


def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit integer hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def mix_key(*parts: int) -> int:
    """One 64-bit key from integers (a seed, an epoch, a shard...)."""
    key = 0
    for part in parts:
        key = _mix((key ^ (part & _MASK)) + _GOLDEN & _MASK)
    return key


@dataclass(frozen=True, slots=True)
class Permutation:
    """A bijection of ``0 .. size-1`` chosen by ``key``: ``p(i)`` for any ``i`` in O(1)."""

    size: int
    key: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a permutation of {self.size} elements: expected at least 1")

    @property
    def _half(self) -> int:
        bits = max(2, (self.size - 1).bit_length())
        return (bits + 1) // 2

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} out of 0 .. {self.size - 1}")
        if self.size == 1:
            return 0
        half = self._half
        mask = (1 << half) - 1
        x = i
        while True:  # cycle walking: at most a few rounds, the domain is < 4 x size
            left, right = x >> half, x & mask
            for r in range(ROUNDS):
                left, right = right, left ^ (_mix(self.key ^ (r + 1) * _GOLDEN & _MASK ^ right)
                                             & mask)
            x = (left << half) | right
            if x < self.size:
                return x


@dataclass(frozen=True, slots=True)
class Shard:
    """Trainer ``index`` of ``count``: owns windows ``w`` with ``w % count == index``."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int)
                and self.count >= 1 and 0 <= self.index < self.count):
            raise DataError(f"data shard {self.index}/{self.count}: expected i/n with "
                            f"0 <= i < n")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def size(self, windows: int) -> int:
        """How many of ``windows`` windows this shard owns."""
        return max(0, (windows - self.index + self.count - 1) // self.count)

    def window(self, k: int) -> int:
        """The shard's ``k``-th window."""
        return self.index + self.count * k


def parse_shard(text: str) -> Shard | None:
    """``"auto"`` (None: decided at start, :func:`auto_shard`) or ``"i/n"``; ValueError else."""
    if text == "auto":
        return None
    index, sep, count = text.partition("/")
    if not (sep and index.strip().isdigit() and count.strip().isdigit()):
        raise ValueError(f'data.shard = "{text}": expected "auto" or "i/n" such as "0/2"')
    try:
        return Shard(int(index), int(count))
    except DataError:
        raise ValueError(f'data.shard = "{text}": expected i/n with 0 <= i < n') from None


def auto_shard(me: str, others: Iterable[str]) -> Shard:
    """A trainer's shard from the trainers in view at its start: its place among their peer
    ids (its own included), sorted; ``n`` is how many there are. Trainers that see each other
    at start get distinct shards of one ``n``; one that started alone owns every window."""
    ids = sorted({me, *others})
    return Shard(ids.index(me), len(ids))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cursor:
    """The next window a trainer reads: number ``index`` of epoch ``epoch``'s order."""

    epoch: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "index"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(f"data position {name} = {value!r}: expected an integer >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowOrder:
    """The order ``shard`` reads ``windows`` windows in, epoch after epoch, from ``seed``."""

    windows: int
    shard: Shard
    seed: int

    def __post_init__(self) -> None:
        if self.shard.size(self.windows) < 1:
            raise DataError(f"{self.windows} training window(s) cannot be shared among "
                            f"{self.shard.count} trainers: give the corpus more text, or "
                            f"use fewer shards (data.shard)")

    @property
    def per_epoch(self) -> int:
        """Windows this shard reads per epoch."""
        return self.shard.size(self.windows)

    def permutation(self, epoch: int) -> Permutation:
        return Permutation(self.per_epoch, mix_key(self.seed, epoch, self.shard.index,
                                                   self.shard.count))

    def take(self, cursor: Cursor, n: int) -> tuple[list[int], Cursor]:
        """The next ``n`` windows from ``cursor`` and the cursor after them."""
        out: list[int] = []
        epoch, index = cursor.epoch, cursor.index
        if index >= self.per_epoch:
            raise DataError(f"data position {index} of epoch {epoch} is past the "
                            f"{self.per_epoch} windows of shard {self.shard}")
        perm = self.permutation(epoch)
        while len(out) < n:
            out.append(self.shard.window(perm(index)))
            index += 1
            if index == self.per_epoch:
                epoch, index = epoch + 1, 0
                perm = self.permutation(epoch)
        return out, Cursor(epoch=epoch, index=index)
