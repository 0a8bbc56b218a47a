"""Documents of a corpus on disk: text files and trees, JSONL and Parquet, as records.

* a text file is one document, read in pieces of about :data:`PIECE_BYTES` cut after a newline
  (a file with a NUL among its first :data:`SNIFF_BYTES` bytes is binary and yields nothing);
* a ``.jsonl`` (``.ndjson``) file holds one document per line, the ``data.text_field`` of a
  JSON object;
* a ``.parquet`` file holds one document per row of the ``data.text_field`` column (needs
  pyarrow: ``pip install swarmd[data]``).

A line that is not JSON, a line or file without the text field stops with a
:class:`~swarmd.errors.DataError` naming the file, the line and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from swarmd.errors import DataError

__all__ = ["Record", "data_files", "read_records", "stdlib_dir", "stdlib_files", "PIECE_BYTES",
           "SNIFF_BYTES", "NOT_STDLIB"]

log = logging.getLogger(__name__)

#: a text file is read in pieces of about this many bytes, cut after a newline
PIECE_BYTES = 1 << 20
#: a file with a NUL byte among its first SNIFF_BYTES bytes is taken for binary and skipped
SNIFF_BYTES = 8192
#: directories of the standard library that are not the standard library
NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})
_JSONL = (".jsonl", ".ndjson")
_PARQUET = (".parquet",)


@dataclass(frozen=True, slots=True)
class Record:
    """One piece of text: record ``index`` of its file, part of document ``doc``; ``ends_doc``
    when the document ends with it (then an end-of-text token follows)."""

    index: int
    doc: int
    text: str | bytes
    ends_doc: bool


def data_files(path: Path | str, *, suffix: str = "",
               prune: frozenset[str] = frozenset()) -> list[Path]:
    """The files of ``path``: itself, or the regular files of a tree in sorted order (symlinks
    not followed; directories named in ``prune`` left out; with ``suffix``, only the files
    whose name ends with it)."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"{path}: data path not found; set data.path to a text, JSONL or "
                        f"Parquet file or a directory of them")
    files = [p for p in _walk(root, prune) if p.name.endswith(suffix)]
    if not files:
        raise DataError(f"{path}: no files in this directory; put text, JSONL or Parquet files "
                        f"in it")
    return files


def stdlib_dir() -> Path:
    """Where this Python's standard library sources lie (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The default corpus: the ``*.py`` files of the standard library, in sorted order."""
    return data_files(stdlib_dir(), suffix=".py", prune=NOT_STDLIB)


def _walk(root: Path, prune: frozenset[str] = frozenset()) -> Iterator[Path]:
    """Regular files under ``root``, entries in sorted order (a directory's files where its
    name sorts), symlinks neither followed nor yielded."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise DataError(f"{root}: cannot list the data directory ({exc.strerror})") from None
    for entry in entries:
        if entry.is_symlink():
            continue
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in prune:
                yield from _walk(Path(entry.path), prune)
        elif entry.is_file(follow_symlinks=False):
            yield Path(entry.path)


def read_records(file: Path, *, text_field: str = "text", start: int = 0) -> Iterator[Record]:
    """The records of ``file`` from record ``start`` on (see the module's doc)."""
    if file.suffix.lower() in _JSONL:
        return _jsonl_records(file, text_field, start)
    if file.suffix.lower() in _PARQUET:
        return _parquet_records(file, text_field, start)
    return _text_records(file, start)


def _text_records(file: Path, start: int) -> Iterator[Record]:
    try:
        with open(file, "rb") as f:
            head = f.read(SNIFF_BYTES)
            if b"\0" in head:
                log.debug("skipping binary file %s", file)
                return
            f.seek(0)
            index, carry = 0, b""
            while True:
                block = f.read(PIECE_BYTES)
                if not block:  # the document's last piece (perhaps empty), then end-of-text
                    if index >= start:
                        yield Record(index, 0, carry, ends_doc=True)
                    return
                data = carry + block
                cut = data.rfind(b"\n") + 1
                if not cut:  # no newline yet: read on, up to a few pieces
                    if len(data) < 4 * PIECE_BYTES:
                        carry = data
                        continue
                    cut = len(data)
                piece, carry = data[:cut], data[cut:]
                if index >= start:
                    yield Record(index, 0, piece, ends_doc=False)
                index += 1
    except OSError as exc:
        raise DataError(f"{file}: cannot read the data file ({exc.strerror})") from None


def _jsonl_records(file: Path, text_field: str, start: int) -> Iterator[Record]:
    try:
        with open(file, "rb") as f:
            for index, line in enumerate(f):
                if index < start or not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{file}:{index + 1}: not a JSON line ({exc}); each line of a "
                                    f"JSONL file must be a JSON object") from None
                text = row.get(text_field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    fields = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise DataError(f'{file}:{index + 1}: no text field "{text_field}" (found '
                                    f"{fields}); set data.text_field to the field holding the "
                                    f"text")
                yield Record(index, index, text, ends_doc=True)
    except OSError as exc:
        raise DataError(f"{file}: cannot read the data file ({exc.strerror})") from None


def _parquet_records(file: Path, text_field: str, start: int) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading Parquet needs pyarrow, which is not installed; "
                        f"install it with `pip install swarmd[data]`, or use text or JSONL "
                        f"files") from None
    try:
        parquet = pq.ParquetFile(file)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f'{file}: no column "{text_field}" (columns: {columns}); set '
                        f"data.text_field to the column holding the text")
    index = 0
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        if index + batch.num_rows <= start:
            index += batch.num_rows
            continue
        for text in batch.column(0).to_pylist():
            if index >= start and isinstance(text, str) and text:
                yield Record(index, index, text, ends_doc=True)
            index += 1
