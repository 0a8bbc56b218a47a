"""Where and how the daemon and the trainer log: ``[log]`` in the configuration.

``log.format = "text"`` writes lines for people; ``"json"`` one object per line for machines:
``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``peer`` (this node's peer id
once known), ``msg``, every field passed as ``extra={...}`` (``event`` by convention), and
``exc`` with the traceback when there is one. ``log.file`` also writes to that file, rotated by
size (``log.max_bytes``, ``log.backups`` old files kept), for those who run without journald.

In json mode every line the process writes is one JSON object: what reaches ``sys.stdout`` or
``sys.stderr`` outside logging becomes a record of logger ``stdout`` or ``stderr``
(:mod:`swarmd.node.log_streams`), warnings are logged (``py.warnings``), an uncaught exception
is one record with ``exc``, and handlers that libraries set up on the real streams before are
pointed at the wrapped ones. :func:`json_mode` tells the command line to print its results and
errors as records too.

Importing libp2p resets its logger, so :func:`configure` imports it first.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable

from swarmd.errors import ConfigError
from swarmd.node.log_streams import RecordLines

__all__ = ["configure", "set_peer_id", "json_mode", "json_line", "JsonFormatter"]

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


class _Mode:
    """The format :func:`configure` set for this process's own streams."""

    format = "text"


def json_mode() -> bool:
    """True once :func:`configure` made this process's stdout and stderr JSON lines."""
    return _Mode.format == "json"


def configure(level: str, *, format: str = "text", file: str = "",
              max_bytes: int = 10 << 20, backups: int = 5,
              stream: IO[str] | None = None) -> None:
    """Log at ``level`` to ``stream`` (stderr) and, with ``file``, to that rotated file.
    Replaces any handlers configured before. Raises ``ConfigError`` when the file cannot be
    opened, saying what to do. Without ``stream``, json mode takes over the process's stdout
    and stderr (module doc); text mode gives them back."""
    import libp2p  # noqa: F401  (resets its logger when first imported)

    formatter: logging.Formatter = (JsonFormatter() if format == "json"
                                    else logging.Formatter(TEXT_FORMAT))
    handlers: list[logging.Handler] = [logging.StreamHandler(stream or _real(sys.stderr))]
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
    if stream is None:
        _own_streams(as_json=format == "json")


def _real(stream: IO[str]) -> IO[str]:
    return stream.stream if isinstance(stream, RecordLines) else stream


def json_line(logger: str, level: int, msg: str, **fields: Any) -> str:
    """One record as json mode writes it, without logging configured (an error before the
    configuration is read, a line written outside logging)."""
    record = logging.LogRecord(logger, level, "", 0, msg, None, None)
    record.__dict__.update(fields)
    record.peer = _PEER.peer_id
    return JsonFormatter().format(record)


def _stray_line(logger: str, level: int) -> Callable[[str], str]:
    return lambda line: json_line(logger, level, line)


def _own_streams(*, as_json: bool) -> None:
    """In json mode, wrap stdout and stderr, log warnings and uncaught exceptions, and point
    libraries' handlers on the real streams at the wrapped ones; in text mode, undo that."""
    out, err = _real(sys.stdout), _real(sys.stderr)
    if not as_json:
        if json_mode():
            _Mode.format = "text"
            logging.captureWarnings(False)
            sys.stdout, sys.stderr = out, err
            sys.excepthook, threading.excepthook = sys.__excepthook__, threading.__excepthook__
        return
    _Mode.format = "json"
    logging.captureWarnings(True)
    sys.stdout = RecordLines(out, _stray_line("stdout", logging.INFO))
    sys.stderr = RecordLines(err, _stray_line("stderr", logging.WARNING))
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback)
    ours = set(logging.getLogger().handlers)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        for handler in getattr(logger, "handlers", ()):
            if (type(handler) is logging.StreamHandler and handler not in ours
                    and handler.stream in (out, err)):
                handler.setStream(sys.stderr if handler.stream is err else sys.stdout)


def _log_uncaught(exc_type: Any, value: Any, tb: Any) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, value, tb)
        return
    logging.getLogger("swarmd").critical("uncaught exception: %s", value,
                                         exc_info=(exc_type, value, tb))
