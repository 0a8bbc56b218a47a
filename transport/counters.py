"""Thread-safe monotonic counters shared by the asyncio and trio sides of a host."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """Named counters; dotted names group them (``protocol_errors.truncated``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def total(self, prefix: str) -> int:
        """Sum of every counter named ``prefix`` or ``prefix.*``."""
        with self._lock:
            return sum(v for k, v in self._values.items()
                       if k == prefix or k.startswith(prefix + "."))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._values.items()))
