"""What a corpus is on disk, its documents, and what identifies it (its listing).

:func:`find_corpus` turns ``data.path`` into a :class:`Corpus`:

* empty: the ``*.py`` files of the Python standard library (skipping site-packages);
* a text, JSONL or Parquet file, or a directory tree of them (``swarmd.data.records``);
* a directory saved with Hugging Face ``datasets``' ``save_to_disk``, or, with
  ``data.reader = "datasets"``, local JSON and Parquet files read through ``load_dataset``
  (``swarmd.data.hf``; ``pip install swarmd[datasets]``).

:func:`documents` yields ``(name, record)``: ``name`` is the file's path relative to the root
(what the held-out keys hash, so a corpus moved elsewhere keeps its held-out set).
:func:`listing` is each file's (name, size, modification time in ns): the token cache's key
compares it, which costs one ``stat`` per file and no reading. A file rewritten with the same
size and modification time is not noticed (touch it, or delete the cache file).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from swarmd.data import hf
from swarmd.data.records import Record, data_files, read_records, stdlib_dir, stdlib_files
from swarmd.errors import DataError

__all__ = ["Corpus", "find_corpus", "documents", "listing", "READERS"]

#: allowed values of ``data.reader``
READERS = ("auto", "swarmd", "datasets")
STDLIB = "the Python standard library"


@dataclass(frozen=True, slots=True, kw_only=True)
class Corpus:
    """A corpus: its ``files`` under ``root``, read by ``reader`` ("files": swarmd's readers,
    "saved": a ``save_to_disk`` directory, "load_dataset": ``datasets.load_dataset``)."""

    root: Path
    files: tuple[Path, ...]
    origin: str
    reader: str = "files"
    text_field: str = "text"
    max_bytes: int = 32 << 20

    def name(self, file: Path) -> str:
        """``file``'s name in the held-out keys: its path relative to the root."""
        return file.name if file == self.root else file.relative_to(self.root).as_posix()


def find_corpus(path: str | Path | None, *, text_field: str = "text",
                max_bytes: int = 32 << 20, reader: str = "auto") -> Corpus:
    """The corpus of ``data.path`` (see the module's doc); :class:`DataError` when missing
    or empty."""
    if reader not in READERS:
        raise ValueError(f"data.reader = {reader!r}: expected one of {READERS}")
    common = {"text_field": text_field, "max_bytes": max_bytes}
    if not path:
        return Corpus(root=stdlib_dir(), files=tuple(stdlib_files()), origin=STDLIB, **common)
    root = Path(path)
    if reader != "swarmd" and root.is_dir() and hf.is_saved_dataset(root):
        return Corpus(root=root, files=tuple(data_files(root)), origin=str(root), reader="saved",
                      **common)
    if not root.exists():
        raise DataError(f"{path}: data path not found; set data.path to a text, JSONL or "
                        f'Parquet file or a directory of them, or to "" for Python\'s sources')
    if not (root.is_file() or root.is_dir()):
        raise DataError(f"{path}: not a regular file or a directory; set data.path to a text, "
                        f"JSONL or Parquet file or a directory of them")
    files = tuple(data_files(root))
    if reader == "datasets":
        hf.check_loadable(files)
        return Corpus(root=root, files=files, origin=str(root), reader="load_dataset", **common)
    return Corpus(root=root, files=files, origin=str(root), **common)


def listing(corpus: Corpus) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of every file of ``corpus``, in its order."""
    out = []
    for file in corpus.files:
        try:
            st = os.stat(file)
        except OSError as exc:
            raise DataError(f"{file}: cannot read the data file ({exc.strerror}); restore it "
                            f"or remove it from {corpus.origin}") from None
        out.append((corpus.name(file), st.st_size, st.st_mtime_ns))
    return tuple(out)


def documents(corpus: Corpus) -> Iterator[tuple[str, Record]]:
    """``(name, record)`` of every record of the corpus, file after file (see the module)."""
    if corpus.reader == "saved":
        yield from hf.saved_records(corpus.root, corpus.text_field)  # named by its split
        return
    for file in corpus.files:
        records = (hf.file_records(file, corpus.text_field) if corpus.reader == "load_dataset"
                   else read_records(file, text_field=corpus.text_field))
        name = corpus.name(file)
        for record in records:
            yield name, record
