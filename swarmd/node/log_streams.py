"""In json log mode, what reaches ``sys.stdout`` or ``sys.stderr`` outside logging.

A library's ``print``, a progress bar, a hand-written warning: each line written to a
:class:`RecordLines` stream leaves it as one JSON log record (``to_record(line)``), unless the
line already is a JSON object (``swarmd join --json``'s start line, a command's ``--json``
result), which passes through unchanged. Carriage returns end a line too (progress bars
redraw with them); blank lines are dropped. ``isatty()`` is False, so progress bars that draw
only on a terminal stay off.

Writes through the file descriptor (a child process given ``sys.stderr``, C code) bypass it.
"""

from __future__ import annotations

import io
import json
import re
import threading
from typing import IO, Callable

__all__ = ["RecordLines", "is_json_object"]

_LINE_END = re.compile(r"\r\n|\r|\n")


def is_json_object(line: str) -> bool:
    """True for a line that is one JSON object already."""
    text = line.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class RecordLines(io.TextIOBase):
    """A text stream over ``stream`` that writes each line as ``to_record(line)``."""

    def __init__(self, stream: IO[str], to_record: Callable[[str], str]) -> None:
        super().__init__()
        #: the stream the records go to (the process's real stdout or stderr)
        self.stream = stream
        self._to_record = to_record
        self._partial = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.stream, "errors", None)

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = _LINE_END.split(self._partial + text)
            out = [line if is_json_object(line) else self._to_record(line)
                   for line in lines if line.strip()]
            if out:
                self.stream.write("\n".join(out) + "\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        """Flushes the stream below; a line not yet ended stays until it is (or ``close``)."""
        with self._lock:
            self.stream.flush()

    def close(self) -> None:
        """Writes a line not yet ended; leaves the stream below open (it is not ours)."""
        with self._lock:
            rest, self._partial = self._partial, ""
            if rest.strip():
                self.stream.write((rest if is_json_object(rest) else self._to_record(rest))
                                  + "\n")
                self.stream.flush()
        super().close()
