"""Keep freed memory for reuse: large message buffers without page-fault storms.

A process that moves tensors allocates and frees buffers of many MiB per message. glibc hands
such sizes to ``mmap`` and gives them back on ``free``, so every message touches fresh pages; on
these machines first-touching a page costs 1.5-10 us, so a fresh 16 MiB buffer costs 6-40 ms,
more than int8-coding it. Raising glibc's mmap and trim thresholds makes freed buffers come back
from the heap instead. Process-wide and irreversible: called by a program's entry point (the
daemon, a benchmark), never on import.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
DEFAULT_THRESHOLD = 1 << 30


def keep_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds to ``threshold`` bytes. False where not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, threshold))
