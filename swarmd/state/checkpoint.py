"""Checkpoints of a stage's state in the home: saved atomically, verified when loaded.

Layout (``dir`` is ``<home>/checkpoints``, see :func:`checkpoint_dir`)::

    stage-<k>.swst                      the newest checkpoint of stage k (only one is kept)
    stage-<k>.swst.corrupt-<utc time>   a corrupt one set aside by :func:`quarantine`
    .stage-<k>.swst.tmp-<pid>-<random>  being written (or left by a crash: never read)

A file is a 48-byte header, then an encoded :class:`~swarmd.state.encoding.StageState`::

    magic b"SWCK", version (u8), 3 zero bytes, payload length (u64 LE), blake2b-256 of payload

Saving writes a temporary file in the same directory from the state's own tensors, piece by
piece (the digest computed on the way, the header written last), flushes and fsyncs it,
renames it over the old checkpoint and fsyncs the directory: a crash at any point leaves either
the old or the new checkpoint, whole. Loading checks the header and the length (truncation),
then reads the payload once, piece by piece, into the state's tensors while hashing it, and
checks the digest (bit flips); a bad file raises :class:`CorruptCheckpoint`. Beside the state,
either takes one piece of memory (``WRITE_CHUNK``), whatever the stage's size.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import secrets
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

from swarmd.errors import SwarmdError
from swarmd.files import fsync_dir, pid_alive
from swarmd.state.encoding import (MAX_STATE_BYTES, BadStageState, StageState, decode_from,
                                   layout, peek)
from swarmd.state.layout import HashingReader

__all__ = ["CorruptCheckpoint", "SaveAborted", "checkpoint_dir", "checkpoint_path",
           "save_checkpoint", "load_checkpoint", "checkpoint_identity", "quarantine",
           "saved_stages"]

MAGIC = b"SWCK"
VERSION = 1
HEADER = struct.Struct("<4sB3xQ32s")
SUFFIX = ".swst"
#: corrupt files set aside per stage; older ones are deleted
KEEP_QUARANTINED = 3
_NAME = re.compile(r"stage-(\d{1,6})\.swst")
#: a save can be abandoned between two writes of this many bytes; also the piece a load reads
WRITE_CHUNK = 4 << 20


class CorruptCheckpoint(SwarmdError):
    """A checkpoint file exists but cannot be used (truncated, bit flip, wrong format)."""

    code = "corrupt_checkpoint"

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        super().__init__(f"checkpoint {path} is corrupt: {what}. It will be set aside and the "
                         f"stage state fetched from peers; or delete the file to do so by hand")


class SaveAborted(SwarmdError):
    """A save was abandoned (its deadline passed); the previous checkpoint is intact."""

    code = "save_aborted"


def checkpoint_dir(home: Path) -> Path:
    """Where a home keeps its checkpoints."""
    return Path(home) / "checkpoints"


def checkpoint_path(dir: Path, stage: int) -> Path:
    if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
        raise ValueError(f"stage must be a non-negative integer, got {stage!r}")
    return Path(dir) / f"stage-{stage}{SUFFIX}"


def save_checkpoint(dir: Path, state: StageState, *, data: bytes | None = None,
                    abort: Callable[[], bool] | None = None,
                    piece: int | None = None) -> Path:
    """Write ``state`` as the checkpoint of its stage, atomically; returns its path.

    The encoding is written from the state's own tensors ``piece`` bytes at a time (its
    digest computed on the way, the header written last), so nothing but the state and one
    piece is held; ``data`` may pass ``encode(state)`` when the caller has it already.
    Blocking I/O: call it from a worker thread in an event loop, one save per stage at a
    time. Raises ``OSError`` when the disk refuses (the previous checkpoint is then intact).
    ``abort()`` is asked before the file is created and between pieces: once it says true
    the temporary file is removed and ``SaveAborted`` raised (the previous checkpoint is
    intact).
    """
    def check() -> None:
        if abort is not None and abort():
            raise SaveAborted(f"saving the checkpoint of stage {state.stage} was abandoned; "
                              f"the previous checkpoint is kept")

    piece = piece or WRITE_CHUNK  # read when called: WRITE_CHUNK is this module's setting
    dir = Path(dir)
    dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = checkpoint_path(dir, state.stage)
    if data is None:
        encoded = layout(state)
        length, pieces = encoded.total, encoded.pieces(piece)
    else:
        view = memoryview(data)
        length, pieces = len(view), (view[a:a + piece] for a in range(0, len(view), piece))
    _remove_stale_temps(dir, final.name)
    check()
    tmp = dir / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(HEADER.pack(MAGIC, VERSION, length, bytes(32)))  # its digest comes last
            h = hashlib.blake2b(digest_size=32)
            for view in pieces:
                check()
                h.update(view)
                out.write(view)
            out.seek(0)
            out.write(HEADER.pack(MAGIC, VERSION, length, h.digest()))
            out.flush()
            check()
            os.fsync(out.fileno())
        check()
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dir)
    return final


def load_checkpoint(dir: Path, stage: int, *, max_bytes: int = MAX_STATE_BYTES,
                    piece: int = WRITE_CHUNK) -> StageState | None:
    """The checkpoint of ``stage`` in ``dir``; None when there is none.

    Read in one pass, ``piece`` bytes at a time, straight into the state's tensors while its
    digest is computed: nothing but the state and one piece is held. Raises
    ``CorruptCheckpoint`` when the file is unreadable or fails any check; the caller should
    :func:`quarantine` it and fetch the state from peers.
    """
    path = checkpoint_path(dir, stage)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise CorruptCheckpoint(path, "it is a directory") from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"cannot read it ({exc.strerror})") from None
    with f:
        try:
            return _load(f, path, stage, max_bytes, piece)
        except OSError as exc:
            raise CorruptCheckpoint(path, f"cannot read it ({exc.strerror})") from None


def _load(f: Any, path: Path, stage: int, max_bytes: int, piece: int) -> StageState:
    size = os.fstat(f.fileno()).st_size
    if size > HEADER.size + max_bytes:
        raise CorruptCheckpoint(path, f"{size} bytes, more than the limit of {max_bytes}")
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise CorruptCheckpoint(path, f"truncated to {len(head)} bytes, shorter than its header")
    magic, version, length, expected = HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptCheckpoint(path, "not a swarmd checkpoint (bad magic)")
    if version != VERSION:
        raise CorruptCheckpoint(path, f"format version {version}, this swarmd reads {VERSION}")
    present = size - HEADER.size
    if present != length:
        what = "truncated" if present < length else "has trailing bytes"
        raise CorruptCheckpoint(path, f"{what}: {present} payload bytes, header says {length}")
    reader = HashingReader(f)
    try:
        state = decode_from(reader, length, max_bytes=max_bytes, piece=piece)
    except BadStageState as exc:
        rest = memoryview(bytearray(min(piece, 1 << 20)))
        while reader.readinto(rest):
            pass  # the rest, hashed: damage on disk is told apart from invalid contents
        if reader.hash.digest() != expected:
            raise CorruptCheckpoint(path, "its checksum does not match (damaged on disk)"
                                    ) from None
        raise CorruptCheckpoint(path, f"its contents are invalid ({exc})") from None
    if reader.count != length or reader.hash.digest() != expected:
        raise CorruptCheckpoint(path, "its checksum does not match (damaged on disk)")
    if state.stage != stage:
        raise CorruptCheckpoint(path, f"it holds stage {state.stage}, not {stage}")
    return state


def checkpoint_identity(dir: Path, stage: int) -> tuple[int, str] | None:
    """(step, model hash) of ``stage``'s checkpoint in ``dir``, from its header alone (None:
    none, or unreadable; :func:`load_checkpoint` checks it whole)."""
    try:
        with open(checkpoint_path(dir, stage), "rb") as f:
            magic, version, length, _ = HEADER.unpack(f.read(HEADER.size))
            if magic != MAGIC or version != VERSION:
                return None
            found, step, model_hash = peek(f, length, max_bytes=length)
    except (OSError, struct.error, BadStageState):
        return None
    return (step, model_hash) if found == stage else None


def quarantine(path: Path, *, now: float | None = None) -> Path:
    """Rename a corrupt checkpoint to ``<name>.corrupt-<UTC time>`` so it is kept but never
    read again; keeps the newest ``KEEP_QUARANTINED`` of its kind. Returns the new path."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.replace(path, target)
    fsync_dir(path.parent)
    old = sorted(path.parent.glob(f"{path.name}.corrupt-*"), key=lambda p: p.name)
    for extra in old[:-KEEP_QUARANTINED]:
        extra.unlink(missing_ok=True)
    return target


def saved_stages(dir: Path) -> list[int]:
    """Stages that have a checkpoint file in ``dir`` (not checked), ascending."""
    try:
        names = os.listdir(dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := _NAME.fullmatch(name)))


def _remove_stale_temps(dir: Path, name: str) -> None:
    """Temporary files of ``name`` left by a process that died while writing."""
    for tmp in dir.glob(f".{name}.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if not (pid.isdigit() and _other_process_alive(int(pid))):
            tmp.unlink(missing_ok=True)


def _other_process_alive(pid: int) -> bool:
    """Our own pid counts as dead: it is a previous run's (saves of a stage are sequential)."""
    return pid != os.getpid() and pid_alive(pid)


def in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` in a daemon thread of its own (not the loop's executor, which the
    process waits for when it exits: an abandoned save must not hold the exit up)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # always retrieved

    def settle(result: Any, exc: BaseException | None) -> None:
        if not future.done():
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:  # handed to the awaiting side
            result, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="checkpoint-save", daemon=True).start()
    return future
