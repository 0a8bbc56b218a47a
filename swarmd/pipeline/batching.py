"""A stage peer's compute: the compute thread with the bounded queue in front of it, forward
batching with joined backward (docs/pipeline.md, "Batching"), and the throughput average.

The asyncio loop never runs torch: every ``StageWorker`` call goes through ``Compute.run``,
whose single-thread executor is where backpressure starts (a full queue answers ``busy``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from swarmd.errors import StageBusy
from swarmd.pipeline.worker import StageWorker

#: requests waiting for or in compute; more are refused with ``busy`` (the sender reroutes).
#: It holds a trainer's opening burst of a synchronous step (``InFlight.opening``: 32 at most,
#: sent at once) with the backwards that follow it (at 16, half the burst would be refused)
MAX_QUEUE = 48
#: most microbatches forwarded as one batch
MAX_BATCH = 8
#: how long a batched microbatch's backward waits for the rest of its batch
JOIN_WAIT_S = 2.0
#: weight of each new measurement in the throughput average: slow, because the balancer
#: compares stage totals made of these and must not chase noise
THROUGHPUT_EMA = 0.05


class Compute:
    """The compute thread. ``run(fn, *args, admit=True)`` (new forwards) refuses with
    ``StageBusy`` when ``MAX_QUEUE`` calls wait; backward and optimizer steps always get
    through, since they free memory and cannot be routed elsewhere. The thread's busy time
    is counted (``compute_busy_ms``): how much of a run the stage computed, and how much it
    waited for work."""

    def __init__(self, name: str, counters: Counter[str]) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.counters = counters
        #: calls waiting for or in the compute thread
        self.queued = 0
        self._busy_s = 0.0

    def refuse_if_full(self, waiting: int = 0) -> None:
        if self.queued + waiting >= MAX_QUEUE:
            self.counters["busy"] += 1
            raise StageBusy(f"{MAX_QUEUE} requests already wait for compute here")

    async def run(self, fn: Callable[..., Any], *args: Any, admit: bool = False) -> Any:
        if admit:
            self.refuse_if_full()
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed,
                                                                    fn, args)
        finally:
            self.queued -= 1

    def _timed(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """In the compute thread (its only writer of ``compute_busy_ms``)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._busy_s += time.perf_counter() - t0  # (whole ms in the counter, none lost)
            self.counters["compute_busy_ms"] = int(self._busy_s * 1e3)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class Throughput:
    """Samples per second through the stage's compute (EMA), announced in membership."""

    def __init__(self) -> None:
        self.value = 0.0

    def measured(self, samples: int, seconds: float) -> None:
        rate = samples / max(seconds, 1e-6)
        self.value = rate if self.value == 0 else (
            (1 - THROUGHPUT_EMA) * self.value + THROUGHPUT_EMA * rate)


class Batcher:
    """Forwards of one sequence length that queue up while the compute thread is busy run as
    one batch (at most ``max_batch``, within the worker's ``max_tokens``); their backward is
    joined (a member waits at most ``JOIN_WAIT_S`` for the rest of its batch)."""

    def __init__(self, worker: StageWorker, compute: Compute, counters: Counter[str], *,
                 max_batch: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self.compute = compute
        self.counters = counters
        self.max_batch = max(1, min(max_batch, MAX_BATCH))
        self._clock = clock
        self._pending: list[tuple[str, torch.Tensor, asyncio.Future[Any]]] = []
        self._batcher: asyncio.Task[None] | None = None
        self._joined: dict[str, asyncio.Future[torch.Tensor]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    @property
    def waiting(self) -> int:
        """Forwards waiting to be batched."""
        return len(self._pending)

    def close(self) -> None:
        for task in [*self._tasks, *([self._batcher] if self._batcher else [])]:
            task.cancel()

    # ---- forward ---------------------------------------------------------------------------
    async def forward(self, mb: str, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Forward ``mb``, batched with the others of its sequence length that queue up
        meanwhile; returns its output and its share of the compute time."""
        self.compute.refuse_if_full(len(self._pending))
        future: asyncio.Future[tuple[torch.Tensor, float]] = \
            asyncio.get_running_loop().create_future()
        self._pending.append((mb, x, future))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        return await future

    def _take_batch(self) -> list[tuple[str, torch.Tensor, asyncio.Future[Any]]]:
        length = int(self._pending[0][1].shape[1])
        take, rest, tokens = [], [], 0
        for item in self._pending:
            n = int(item[1].shape[0]) * length
            if int(item[1].shape[1]) == length and tokens + n <= self.worker.max_tokens \
                    and len(take) < self.max_batch:
                take.append(item)
                tokens += n
            else:
                rest.append(item)
        self._pending = rest
        return take

    async def _run_batches(self) -> None:
        while self._pending:
            take = self._take_batch()
            try:
                results = await self.compute.run(self._forward_batch,
                                                 [(m, x) for m, x, _ in take])
            except BaseException as exc:  # the executor is gone (closing): fail them all
                results = [exc] * len(take)
            for (_, _, future), result in zip(take, results):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            if len(take) > 1:
                self.counters["batched_forwards"] += len(take)

    def _forward_batch(self, items: list[tuple[str, torch.Tensor]]) -> list[Any]:
        """In the compute thread: check each, run those that pass as one batch."""
        results: list[Any] = [None] * len(items)
        ok = []
        for i, (mb, x) in enumerate(items):
            try:
                self.worker.check_forward(mb, x)
                ok.append(i)
            except Exception as exc:  # that microbatch's sender gets the typed error
                results[i] = exc
        if ok:
            t0 = time.perf_counter()
            try:
                ys = self.worker.forward_many([items[i] for i in ok], self._clock())
            except Exception as exc:
                for i in ok:
                    results[i] = exc
                return results
            seconds = time.perf_counter() - t0
            rows = sum(int(items[i][1].shape[0]) for i in ok)
            for i, y in zip(ok, ys):
                results[i] = (y, seconds * int(items[i][1].shape[0]) / rows)
        return results

    # ---- backward --------------------------------------------------------------------------
    async def backward(self, mb: str, grad: torch.Tensor,
                       source: tuple[str, int] | None = None) -> torch.Tensor:
        """Backward of ``mb`` (for ``source``, the trainer and its step); a microbatch
        forwarded in a batch waits (at most ``JOIN_WAIT_S``) for the rest of its batch, so
        the batch is back-propagated once."""
        done = await self.compute.run(self.worker.backward_joined, mb, grad, self._clock(),
                                      source)
        if done is None:
            future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
            self._joined[mb] = future
            timer = asyncio.get_running_loop().call_later(
                JOIN_WAIT_S, lambda: self._spawn(self._finish_batch(mb)))
            try:
                return await future
            finally:
                timer.cancel()
                self._joined.pop(mb, None)
        self._deliver(done)
        return done[mb]

    async def _finish_batch(self, mb: str) -> None:
        if self.worker.waiting(mb):
            self.counters["batches_finished_short"] += 1
            self._deliver(await self.compute.run(self.worker.finish, mb))

    def _deliver(self, done: dict[str, torch.Tensor]) -> None:
        for other, g in done.items():
            future = self._joined.get(other)
            if future is not None and not future.done():
                future.set_result(g)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
