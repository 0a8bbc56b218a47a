"""Run a trio world in a dedicated thread and call into it from asyncio.

py-libp2p runs on trio only; the daemon runs on asyncio (uvloop). A ``TrioThread`` owns one
``trio.run`` in its own thread. ``call(fn, *args)`` runs ``await fn(*args)`` as a trio task
and returns its result to the awaiting asyncio coroutine; cancelling that coroutine cancels the
trio task. ``to_asyncio(fn, *args)`` schedules a plain callable on the asyncio loop.

Rules that keep it fast and correct (measured, see shared notes): cross once per whole
message, never per chunk; libp2p objects live and are touched only on the trio side.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, TypeVar

import trio

from transport.errors import TransportClosed

T = TypeVar("T")


class _Call:
    """One crossing: the trio cancel scope and whether asyncio asked to cancel."""

    __slots__ = ("scope", "cancel_requested")

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.cancel_requested = False

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()


class TrioThread:
    """Owns a trio event loop in a thread. ``main(ready)`` is the trio entry point: it must
    call ``ready()`` once its world is set up (e.g. after binding), then run until cancelled.
    """

    def __init__(self, name: str = "trio") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._thread: threading.Thread | None = None
        self._stop: trio.Event | None = None
        self._started: asyncio.Future[None] | None = None
        self._finished: asyncio.Future[None] | None = None
        self.failure: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._token is not None and self._finished is not None and not self._finished.done()

    async def start(self, main: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        """Start the thread and wait until ``main`` has called ``ready()``."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._finished = self._loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, args=(main,), name=self._name,
                                        daemon=True)
        self._thread.start()
        try:
            await asyncio.shield(self._started)
        except asyncio.CancelledError:
            await self.stop()
            raise

    def _thread_main(self, main: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        error: BaseException | None = None
        try:
            trio.run(self._trio_main, main)
        except BaseException as exc:  # reported to asyncio, never lost in a dead thread
            error = exc
        self._to_loop(self._on_finished, error)

    async def _trio_main(self, main: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery

            def ready() -> None:
                self._to_loop(_resolve, self._started, None)

            async def run_main() -> None:
                await main(ready)
                self._stop.set()  # main returned on its own: shut down

            nursery.start_soon(run_main)
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _on_finished(self, error: BaseException | None) -> None:
        self.failure = error
        self._token = None
        if self._started is not None and not self._started.done():
            if error is None:
                error = TransportClosed("the libp2p thread exited before it was ready")
            self._started.set_exception(error)
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def to_asyncio(self, fn: Callable[..., Any], *args: Any) -> None:
        """From the trio thread: run ``fn(*args)`` soon on the asyncio loop."""
        self._to_loop(fn, *args)

    def run_sync_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """From the asyncio side: run ``fn(*args)`` soon in the trio thread."""
        token = self._token
        if token is None:
            raise TransportClosed("the libp2p host is not running")
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise TransportClosed("the libp2p host has stopped") from None

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in trio; cancellation of the caller cancels it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        call = _Call()

        async def runner() -> None:
            try:
                with trio.CancelScope() as scope:
                    call.scope = scope
                    if call.cancel_requested:
                        scope.cancel()
                    result = await fn(*args)
                    self._to_loop(_resolve, future, result)
                    return
                self._to_loop(_cancel, future)
            except Exception as exc:
                self._to_loop(_fail, future, exc)
            except BaseException:
                self._to_loop(_fail, future, TransportClosed("the libp2p host is shutting down"))
                raise

        def spawn() -> None:
            if self._nursery is None:
                self._to_loop(_fail, future, TransportClosed("the libp2p host is not running"))
            else:
                self._nursery.start_soon(runner)

        self.run_sync_soon(spawn)
        try:
            return await future
        except asyncio.CancelledError:
            try:
                self.run_sync_soon(call.cancel)
            except TransportClosed:
                pass
            raise

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel the trio world and wait for the thread to end."""
        if self._stop is not None and self._token is not None:
            try:
                self.run_sync_soon(self._stop.set)
            except TransportClosed:
                pass
        if self._finished is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._finished), timeout)
            except asyncio.TimeoutError:
                pass
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 1.0)


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _cancel(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.cancel()
