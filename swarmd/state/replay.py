"""The gradients a stage peer applied lately, to replay them onto an older state. Pure.

A peer that downloaded a mate's state at step ``s`` finds its mates at ``s + k`` by the time
the download lands (a big state over a slow link takes longer than a step). Rather than
download again, it asks a mate for the ``k`` gradients that took the stage from ``s`` to
``s + k`` and applies them itself: the same optimizer math on the same gradients gives the
same weights (``swarmd.state.catchup``).

:class:`ReplayLog` keeps those gradients: one entry per optimizer step, ``(step, vector)``
where ``step`` is the step the gradient was applied at (the step before it) and ``vector``
the flat float32 gradient. It is bounded by count (``max_steps``) and by bytes
(``max_bytes``): the oldest entries are dropped first; a vector bigger than ``max_bytes``
is not kept, and the log is cleared (no replay can cross a step it lacks). Entries are
contiguous by construction: recording a step that does not follow the newest one clears
the log first. The owner clears it when its weights are replaced by a download.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["ReplayLog", "vector_bytes"]


def vector_bytes(vector: torch.Tensor) -> int:
    return vector.numel() * vector.element_size()


@dataclass(frozen=True, slots=True)
class _Entry:
    step: int
    vector: torch.Tensor


class ReplayLog:
    """The last gradients applied, oldest first (module doc). ``max_steps == 0`` keeps none."""

    def __init__(self, *, max_steps: int, max_bytes: int) -> None:
        if max_steps < 0 or max_bytes < 0:
            raise ValueError("ReplayLog needs max_steps >= 0 and max_bytes >= 0")
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self._entries: deque[_Entry] = deque()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_steps > 0 and self.max_bytes > 0

    def keeps(self, nbytes: int) -> bool:
        """Whether a vector of ``nbytes`` would be kept (else the caller need not copy it:
        ``record`` would only clear the log)."""
        return self.enabled and nbytes <= self.max_bytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def oldest(self) -> int | None:
        """The earliest step a state may be at for ``since`` to answer, None when empty."""
        return self._entries[0].step if self._entries else None

    @property
    def newest(self) -> int | None:
        """The step the newest entry took the state to, None when empty."""
        return self._entries[-1].step + 1 if self._entries else None

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def record(self, step: int, vector: torch.Tensor) -> None:
        """The gradient ``vector`` was applied at ``step`` (taking the state to ``step + 1``).
        The caller hands over ``vector``: it must not be written to afterwards."""
        if not self.enabled:
            return
        if self._entries and self._entries[-1].step + 1 != step:
            self.clear()  # a gap (or a step again): what is kept no longer leads here
        size = vector_bytes(vector)
        if size > self.max_bytes:
            self.clear()
            return
        self._entries.append(_Entry(step, vector))
        self._bytes += size
        while len(self._entries) > self.max_steps or self._bytes > self.max_bytes:
            self._bytes -= vector_bytes(self._entries.popleft().vector)

    def since(self, step: int) -> list[torch.Tensor] | None:
        """The vectors that take a state at ``step`` to ``newest`` (empty when it is there),
        or None when the log does not reach back to ``step`` (or ``step`` is past it)."""
        return self.between(step, None)

    def between(self, step: int, count: int | None) -> list[torch.Tensor] | None:
        """Like ``since``, at most ``count`` vectors (those applied at ``step``,
        ``step + 1``, ...); None when the log does not hold the one applied at ``step``."""
        if not self._entries:
            return None
        first, newest = self._entries[0].step, self._entries[-1].step + 1
        if not first <= step <= newest:
            return None
        start = step - first
        stop = len(self._entries) if count is None else min(len(self._entries), start + count)
        return [self._entries[i].vector for i in range(start, stop)]

    def extend(self, step: int, vectors: Sequence[torch.Tensor]) -> None:
        """Record ``vectors`` as applied at ``step``, ``step + 1``, ..."""
        for i, vector in enumerate(vectors):
            self.record(step + i, vector)
