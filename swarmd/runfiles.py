"""Files a running daemon keeps in its home: the lock and the API address.

    <home>/daemon.lock   held (flock) while a daemon runs; holds its pid for messages
    <home>/api           the HTTP URL, written atomically only after the HTTP server is bound,
                         removed on exit; the CLI finds the daemon through it

The lock is an advisory ``flock``: the kernel drops it when the process dies, even by SIGKILL,
so a crashed daemon never blocks the next one (a stale ``api`` file is then overwritten).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from swarmd.errors import HomeError

LOCK_FILE = "daemon.lock"
API_FILE = "api"


class HomeLock:
    """Exclusive ownership of a home by one daemon. ``with HomeLock(home):``"""

    def __init__(self, home: Path) -> None:
        self.path = home / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise HomeError(f"cannot open {self.path}: {exc.strerror}; check the home's "
                            f"permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f" (pid {holder})" if holder else ""
            raise HomeError(f"another swarmd daemon{who} is already running with home "
                            f"{self.path.parent}: stop it with `swarmd stop --home "
                            f"{self.path.parent}`, or give this one its own --home") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HomeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None


def write_api_file(home: Path, url: str) -> Path:
    """Atomically publish the HTTP URL (temp file, fsync, rename)."""
    path = home / API_FILE
    tmp = home / f".{API_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{url}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove_api_file(home: Path, url: str) -> None:
    """Remove ``<home>/api`` if it still names ``url`` (never another daemon's)."""
    path = home / API_FILE
    try:
        if path.read_text().strip() == url:
            path.unlink()
    except FileNotFoundError:
        pass
