"""The directory an export writes: all of it or nothing.

:func:`staging` checks the target first (it must not exist, or be an empty directory, and its
parent must be writable: :class:`~swarmd.errors.ExportTargetError` otherwise, before anything
is downloaded), then gives a temporary directory next to it
(``.<name>.partial-<pid>-<random>``) to write into. When the block succeeds the files are
fsynced and the directory renamed to the target in one step; when it fails (or the process is
interrupted) the temporary directory is removed, and one left by a process that died is
removed by the next export into the same parent. :func:`keep_newest` removes the oldest of a
trainer's periodic exports.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from swarmd.errors import ExportTargetError
from swarmd.files import fsync_dir, pid_alive

__all__ = ["check_target", "staging", "keep_newest", "fsync_tree"]

_PARTIAL = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>\d+)-[0-9a-f]+")


def check_target(out: Path, *, replace: bool = False) -> None:
    """:class:`ExportTargetError` unless ``out`` can take an export (``replace``: an old
    export there is replaced)."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportTargetError(f"--out {out}: it exists and is not a directory; choose a new "
                                f"directory")
    if out.is_dir() and not replace:
        try:
            busy = any(out.iterdir())
        except OSError as exc:
            raise ExportTargetError(f"--out {out}: cannot read it ({exc.strerror})") from None
        if busy:
            raise ExportTargetError(f"--out {out}: it is not empty; choose a new directory or "
                                    f"remove what is in it (an export never mixes with other "
                                    f"files)")
    parent = out.absolute().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ExportTargetError(f"--out {out}: its parent {parent} {what}; choose a directory "
                                f"under an existing one")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportTargetError(f"--out {out}: cannot write in {parent} (permission denied); "
                                f"choose a directory you can write to")


@contextlib.contextmanager
def staging(out: Path, *, replace: bool = False) -> Iterator[Path]:
    """``with staging(out) as tmp:`` write the export into ``tmp``; it becomes ``out`` when
    the block ends without an error (``replace``: an existing ``out`` is replaced)."""
    out = Path(out).absolute()
    check_target(out, replace=replace)
    _remove_stale(out.parent)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(mode=0o755)
    except OSError as exc:
        raise ExportTargetError(f"--out {out}: cannot create a directory in {out.parent} "
                                f"({exc.strerror})") from None
    try:
        yield tmp
        fsync_tree(tmp)
        _move(tmp, out, replace=replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _move(tmp: Path, out: Path, *, replace: bool) -> None:
    old = None
    if replace and out.exists():
        old = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)  # onto an empty directory too; a non-empty one raises
    except OSError as exc:
        if old is not None:
            os.rename(old, out)
        raise ExportTargetError(f"--out {out}: cannot move the export there ({exc.strerror}); "
                                f"did something write into it meanwhile?") from None
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the directories to disk."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def keep_newest(parent: Path, pattern: re.Pattern[str], keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest directories of ``parent`` whose names match
    ``pattern`` (its group ``n`` orders them); returns those removed."""
    found = sorted((int(m.group("n")), p) for p in Path(parent).iterdir()
                   if p.is_dir() and (m := pattern.fullmatch(p.name)))
    removed = [p for _, p in found[:max(0, len(found) - keep)]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _remove_stale(parent: Path) -> None:
    """Temporary directories of exports whose process is gone."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = _PARTIAL.fullmatch(name)
        if m and not _alive(int(m.group("pid"))):
            shutil.rmtree(parent / name, ignore_errors=True)


def _alive(pid: int) -> bool:
    # ours: another export of this process may be writing it
    return pid == os.getpid() or pid_alive(pid)
