"""The trio-thread bridge alone: results, errors and cancellation cross both ways."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

import pytest
import trio
import uvloop

from transport.bridge import TrioThread
from transport.errors import TransportClosed


async def _idle_main(ready: Callable[[], None]) -> None:
    ready()
    await trio.sleep_forever()


def run(coro_fn):
    return uvloop.run(asyncio.wait_for(coro_fn(), 30))


def test_call_returns_result_and_runs_in_the_trio_thread() -> None:
    async def main() -> None:
        bridge = TrioThread()
        await bridge.start(_idle_main)
        try:
            async def where() -> str:
                await trio.sleep(0)
                return threading.current_thread().name

            assert await bridge.call(where) == "trio"
            assert threading.current_thread().name != "trio"
        finally:
            await bridge.stop()

    run(main)


def test_exceptions_cross_with_their_type() -> None:
    async def main() -> None:
        bridge = TrioThread()
        await bridge.start(_idle_main)
        try:
            async def boom() -> None:
                raise KeyError("x")

            with pytest.raises(KeyError):
                await bridge.call(boom)
            assert await bridge.call(trio.sleep, 0) is None  # still usable
        finally:
            await bridge.stop()

    run(main)


def test_cancelling_the_asyncio_caller_cancels_the_trio_task() -> None:
    async def main() -> None:
        bridge = TrioThread()
        await bridge.start(_idle_main)
        cancelled = threading.Event()
        try:
            async def forever() -> None:
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    cancelled.set()
                    raise

            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await bridge.call(forever)
            assert await asyncio.to_thread(cancelled.wait, 10)
        finally:
            await bridge.stop()

    run(main)


def test_calls_after_stop_raise_transport_closed_and_the_thread_ends() -> None:
    async def main() -> None:
        bridge = TrioThread()
        await bridge.start(_idle_main)
        await bridge.stop()
        assert not bridge.running
        with pytest.raises(TransportClosed):
            await bridge.call(trio.sleep, 0)
        assert not any(t.name == "trio" and t.is_alive() for t in threading.enumerate())

    run(main)


def test_a_main_that_fails_before_ready_fails_start() -> None:
    async def bad_main(ready: Callable[[], None]) -> None:
        raise OSError("address in use")

    async def main() -> None:
        bridge = TrioThread()
        with pytest.raises(BaseException) as err:
            await bridge.start(bad_main)
        assert "address in use" in repr(err.value)
        assert not bridge.running

    run(main)


def test_inflight_calls_fail_when_the_host_stops() -> None:
    async def main() -> None:
        bridge = TrioThread()
        await bridge.start(_idle_main)
        pending = asyncio.ensure_future(bridge.call(trio.sleep_forever))
        await asyncio.sleep(0)
        await bridge.stop()
        with pytest.raises(TransportClosed):
            await asyncio.wait_for(pending, 10)

    run(main)
