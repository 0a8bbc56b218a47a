"""A state download on disk: verified chunks written at their offsets in a temporary file,
then checked whole and decoded from it piece by piece (``swarmd.state.fetch``).

Memory beside the decoded state stays at one piece, whatever the stage's size. The file lies
in ``dir`` (a daemon's ``<home>/checkpoints/incoming``, else the system's temporary
directory), is named ``.state-*.part`` and is removed when closed; :func:`clear` removes what a
killed process left.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from swarmd.state.encoding import MAX_STATE_BYTES, StageState, decode_from
from swarmd.state.layout import PIECE_BYTES

__all__ = ["Spool", "clear"]

_PREFIX, _SUFFIX = ".state-", ".part"


class _FileReader:
    def __init__(self, fd: int) -> None:
        self.fd, self.at = fd, 0

    def readinto(self, buffer: memoryview) -> int:
        n = os.preadv(self.fd, [buffer], self.at)
        self.at += n
        return n


class Spool:
    """``total`` bytes being downloaded into a temporary file in ``dir``. Blocking I/O: call
    its methods from a worker thread."""

    def __init__(self, total: int, dir: Path | None = None, *,
                 piece: int = PIECE_BYTES) -> None:
        if dir is not None:
            Path(dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd, name = tempfile.mkstemp(dir=dir, prefix=_PREFIX, suffix=_SUFFIX)
        self.path = Path(name)
        self.total = total
        self.piece = piece

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def digest(self) -> str:
        """blake2b-256 of the ``total`` bytes, read back piece by piece."""
        h = hashlib.blake2b(digest_size=32)
        buffer = memoryview(bytearray(min(self.piece, max(1, self.total))))
        at = 0
        while at < self.total:
            n = os.preadv(self.fd, [buffer[:min(len(buffer), self.total - at)]], at)
            if not n:
                break
            h.update(buffer[:n])
            at += n
        return h.hexdigest()

    def decode(self, max_bytes: int = MAX_STATE_BYTES) -> StageState:
        """The state in the file (``BadStageState`` when it is not one)."""
        return decode_from(_FileReader(self.fd), self.total, max_bytes=max_bytes,
                           piece=self.piece)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)


def clear(dir: Path) -> int:
    """Remove the downloads a killed process left in ``dir`` (call it only while no other
    process of this home runs); how many."""
    count = 0
    for path in Path(dir).glob(f"{_PREFIX}*{_SUFFIX}"):
        path.unlink(missing_ok=True)
        count += 1
    return count
