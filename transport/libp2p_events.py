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

#: the swarm's catch-all record for an inbound connection that failed, whatever the reason
#: (its argument is the exception). Counted by the reason its exception names where no record
#: before it counted that reason (``RAISED_ONLY``), skipped where one did (``LOGGED_BEFORE``),
#: else ``inbound_rejected.error``: garbage whose bytes break the protocol negotiation with an
#: exception libp2p does not wrap (one random 4 KB blob in a few) is logged only here
FAILED_INBOUND = "Error handling incoming connection"
RAISED_ONLY = {
    "Connection denied by resource manager": "inbound_rejected.resources",
    "Maximum connections limit reached": "inbound_rejected.cap",
}
LOGGED_BEFORE = ("failed to upgrade security", "Inbound upgrade timeout", "fail to upgrade mux")


def counter_of(record: logging.LogRecord) -> str | None:
    """The counter a swarm log record stands for, or None."""
    message = record.msg if isinstance(record.msg, str) else ""
    if message.startswith(FAILED_INBOUND):
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not format: still a failed connection
            text = message
        for needle, name in RAISED_ONLY.items():
            if needle in text:
                return name
        if any(needle in text for needle in LOGGED_BEFORE):
            return None
        return "inbound_rejected.error"
    for needle, name in EVENTS.items():
        if needle in message:
            return name
    return None

_lock = threading.Lock()
_counters: "weakref.WeakSet[Counters]" = weakref.WeakSet()
_handler: "_EventHandler | None" = None


class _EventHandler(logging.Handler):
    def __init__(self, passthrough_level: int) -> None:
        super().__init__(logging.DEBUG)
        self.passthrough_level = passthrough_level

    def emit(self, record: logging.LogRecord) -> None:
        name = counter_of(record)
        if name is not None:
            with _lock:
                targets = list(_counters)
            for counters in targets:
                counters.add(name)
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
