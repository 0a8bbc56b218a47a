"""Where and how the daemon and the trainer log: ``[log]`` in the configuration.

``log.format = "text"`` writes lines for people; ``"json"`` one object per line for machines:
``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``peer`` (this node's peer id
once known), ``msg``, every field passed as ``extra={...}`` (``event`` by convention), and
``exc`` with the traceback when there is one. ``log.file`` also writes to that file, rotated by
size (``log.max_bytes``, ``log.backups`` old files kept), for those who run without journald.

Importing libp2p resets its logger, so :func:`configure` imports it first.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path
from typing import IO, Any

from swarmd.errors import ConfigError

__all__ = ["configure", "set_peer_id", "JsonFormatter"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message",
                                                                              "asctime", "peer"}


class _PeerFilter(logging.Filter):
    """Stamps every record with this node's peer id (``""`` until it is known)."""

    peer_id = ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.peer = self.peer_id
        return True


_PEER = _PeerFilter()


def set_peer_id(peer_id: str) -> None:
    """From now on every log record carries ``peer_id``."""
    _PEER.peer_id = peer_id


class JsonFormatter(logging.Formatter):
    """One JSON object per record; never raises on odd ``extra`` values (they become text)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "peer": getattr(record, "peer", ""),
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str, *, format: str = "text", file: str = "",
              max_bytes: int = 10 << 20, backups: int = 5,
              stream: IO[str] | None = None) -> None:
    """Log at ``level`` to ``stream`` (stderr) and, with ``file``, to that rotated file.
    Replaces any handlers configured before. Raises ``ConfigError`` when the file cannot be
    opened, saying what to do."""
    import libp2p  # noqa: F401  (resets its logger when first imported)

    formatter: logging.Formatter = (JsonFormatter() if format == "json"
                                    else logging.Formatter(TEXT_FORMAT))
    handlers: list[logging.Handler] = [logging.StreamHandler(stream or sys.stderr)]
    if file:
        path = Path(file).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handlers.append(logging.handlers.RotatingFileHandler(
                path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"log.file = {file!r}: cannot open it for writing "
                              f"({exc.strerror or exc}); choose a writable path, or set "
                              f"log.file = \"\" to log to stderr only") from None
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(_PEER)
        root.addHandler(handler)
    root.setLevel(level.upper())
