"""The last resort of a stop: a process still running at its stop budget's ``hard_until`` is
ended from a thread of its own (so that a blocked event loop or a thread the interpreter waits
for at exit cannot hold it up), with exit status 0: every file a daemon writes is written
atomically, so nothing it leaves is half-written. Armed by ``swarmd join`` only (never in a
process that hosts a daemon for a test)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("swarmd.node.watchdog")

#: after ``before_exit`` (which abandons a save in progress), how long its writer gets to remove
#: its temporary file
SETTLE_S = 0.3
#: how long the last log line and the handlers' flush are waited for before the exit
LOG_WAIT_S = 1.0


class Watchdog:
    """``arm(deadline)`` (monotonic seconds): exit the process then unless it is gone; a later
    ``arm`` replaces the deadline. ``before_exit()`` runs first (abandon a save)."""

    def __init__(self, before_exit: Callable[[], None] = lambda: None,
                 exit: Callable[[int], None] = os._exit) -> None:
        self._before_exit = before_exit
        self._exit = exit
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def arm(self, deadline: float) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
            self._timer.daemon = True
            self._timer.name = "stop-watchdog"
            self._timer.start()

    def disarm(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _fire(self) -> None:
        # logging takes each handler's lock, which a thread stuck writing may hold for ever:
        # the message and the flush run in a thread of their own, waited for LOG_WAIT_S at most
        said = threading.Thread(target=_say, name="stop-watchdog-log", daemon=True)
        said.start()
        try:
            self._before_exit()
            time.sleep(SETTLE_S)
        finally:
            said.join(LOG_WAIT_S)
            self._exit(0)


def _say() -> None:
    """The watchdog's last line, flushed to every handler of the root logger."""
    log.error("the stop overran node.shutdown_grace_s: exiting now")
    for handler in logging.getLogger().handlers:  # what was logged reaches its file
        try:
            handler.flush()
        except Exception:  # a closed stream must not matter now
            pass
