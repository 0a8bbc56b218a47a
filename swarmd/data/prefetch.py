"""Batches made ahead, on a thread of their own, so the event loop never reads or tokenizes.

A :class:`Prefetcher` runs ``produce(cursor) -> (batch, next cursor)`` on one background
thread and keeps up to ``depth`` batches ready in a bounded queue. ``next()`` (called on the
asyncio loop by the trainer) only takes a batch from the queue; it waits only when the thread
has fallen behind, which is counted (``waits``, ``waited_s``). :attr:`Prefetcher.cursor` is
the position of the next batch ``next()`` returns, not how far the thread got: that is what a
trainer saves, so a restarted one continues with exactly the next batch (``cursor_back(n)``:
the position ``n`` batches ago, for a trainer that drew the next step's first batches before
it saved the step before). An error of the
thread (a file that vanished) is raised by the ``next()`` that would have returned its batch.

:func:`measure_rate` times the producer alone, in this process: how fast the pipeline can
prepare batches, to compare with how fast the swarm consumes them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Prefetcher", "Rate", "measure_rate", "DEPTH"]

C = TypeVar("C")
#: batches kept ready
DEPTH = 8
#: positions before the last draws that ``cursor_back`` can give
HISTORY = 256
_POLL_S = 0.1


class Prefetcher(Generic[C]):
    """``produce`` run ahead on a thread from ``cursor``; see the module's doc."""

    def __init__(self, produce: Callable[[C], tuple[Any, C]], cursor: C, *,
                 depth: int = DEPTH, name: str = "swarmd-data") -> None:
        self._produce, self.cursor, self.depth, self.name = produce, cursor, depth, name
        #: the cursor before each of the last ``HISTORY`` draws (newest last)
        self._before: deque[C] = deque(maxlen=HISTORY)
        self._queue: queue.Queue[tuple[Any, C] | BaseException] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: times next() found no batch ready, and how long it waited in all
        self.waits, self.waited_s, self.made = 0, 0.0, 0

    def start(self) -> None:
        """Start making batches from :attr:`cursor` (done by the first ``next()`` if not)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(self.cursor,), name=self.name,
                                        daemon=True)  # daemon: a forgotten close never hangs exit
        self._thread.start()

    def _run(self, cursor: C) -> None:
        while not self._stop.is_set():
            try:
                batch, cursor = self._produce(cursor)
                item: tuple[Any, C] | BaseException = (batch, cursor)
            except BaseException as exc:  # handed to the consumer, which raises it
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next(self) -> Any:
        """The next batch (waiting only when the thread is behind)."""
        self.start()
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            began = time.monotonic()
            item = self._queue.get()
            self.waits += 1
            self.waited_s += time.monotonic() - began
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._before.append(self.cursor)
        batch, self.cursor = item
        self.made += 1
        return batch

    def cursor_back(self, n: int) -> C:
        """The position ``n`` draws ago (``cursor`` for 0); ``ValueError`` past what is kept
        (``HISTORY``, and nothing before a ``seek``)."""
        if n == 0:
            return self.cursor
        if not 0 < n <= len(self._before):
            raise ValueError(f"the data position {n} batches ago is not kept")
        return self._before[-n]

    def seek(self, cursor: C) -> None:
        """Go on from ``cursor`` instead (batches made ahead are dropped)."""
        self.close()
        self.cursor = cursor
        self._before.clear()

    def close(self) -> None:
        """Stop the thread and drop what it made ahead; ``next()`` starts it again."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        while thread.is_alive():
            try:  # make room so a put in progress returns, then the thread sees the stop
                self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        self._queue = queue.Queue(self.depth)

    def __enter__(self) -> Prefetcher[C]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Rate:
    batches: int
    tokens: int
    seconds: float

    @property
    def batches_per_s(self) -> float:
        return self.batches / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def to_json(self) -> dict[str, float]:
        return {"batches": self.batches, "tokens": self.tokens, "seconds": self.seconds,
                "batches_per_s": self.batches_per_s, "tokens_per_s": self.tokens_per_s}


def measure_rate(produce: Callable[[C], tuple[Any, C]], cursor: C, n: int) -> Rate:
    """Time ``n`` batches made by ``produce`` from ``cursor`` (nothing else changes)."""
    if n < 1:
        raise ValueError(f"n = {n}: expected at least one batch")
    tokens = 0
    began = time.perf_counter()
    for _ in range(n):
        (x, _y), cursor = produce(cursor)
        tokens += x.numel()
    return Rate(batches=n, tokens=tokens, seconds=time.perf_counter() - began)
