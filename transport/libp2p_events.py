"""Count what py-libp2p only reports in its logs: refused and failed inbound connections.

py-libp2p has no hook for an inbound connection that fails its handshake (a garbage client, an
HTTP request on the libp2p port, a socket that never speaks). Its swarm logs them at debug
level. ``install`` attaches one handler to the ``libp2p.network.swarm`` logger (never to the
per-byte yamux or noise loggers) that turns those records into counters and passes every other
record of warning level or above on to the usual handlers.

libp2p does not say which host a record belongs to: with several hosts in one process (tests),
each registered host's counters go up.
"""

from __future__ import annotations

import logging
import threading
import weakref

from transport.counters import Counters

SWARM_LOGGER = "libp2p.network.swarm"

#: substring of a swarm log message -> counter name
EVENTS = {
    "failed to upgrade security": "inbound_rejected.handshake",
    "Inbound upgrade timeout": "inbound_rejected.timeout",
    "reached; rejecting new inbound connection": "inbound_rejected.cap",
    "fail to upgrade mux": "inbound_rejected.muxer",
    "Connection denied by resource manager": "inbound_rejected.resources",
}

_lock = threading.Lock()
_counters: "weakref.WeakSet[Counters]" = weakref.WeakSet()
_handler: "_EventHandler | None" = None


class _EventHandler(logging.Handler):
    def __init__(self, passthrough_level: int) -> None:
        super().__init__(logging.DEBUG)
        self.passthrough_level = passthrough_level

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg if isinstance(record.msg, str) else ""
        for needle, name in EVENTS.items():
            if needle in message:
                with _lock:
                    targets = list(_counters)
                for counters in targets:
                    counters.add(name)
                break
        if record.levelno >= self.passthrough_level:
            parent = logging.getLogger(SWARM_LOGGER).parent
            if parent is not None:
                parent.handle(record)


def install(counters: Counters, passthrough_level: int = logging.WARNING) -> None:
    """Count swarm events into ``counters``; call after ``import libp2p`` (it resets logging)."""
    global _handler
    with _lock:
        _counters.add(counters)
        logger = logging.getLogger(SWARM_LOGGER)
        if _handler is None or _handler not in logger.handlers:
            _handler = _EventHandler(passthrough_level)
            logger.addHandler(_handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # records reach the usual handlers through _EventHandler only
