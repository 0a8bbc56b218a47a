"""Streamed training data: text files and trees, JSONL and Parquet, tokenized and packed.

Documents are read one at a time (a corpus larger than memory works), tokenized, each followed
by the tokenizer's end-of-text token, and packed into sequences of ``seq_len + 1`` tokens
(inputs are the first ``seq_len``, targets the last ``seq_len``).

* a text file is one document, read in pieces of about :data:`PIECE_BYTES` cut after a newline;
* a ``.jsonl`` file holds one document per line, the ``data.text_field`` of a JSON object;
* a ``.parquet`` file holds one document per row of the ``data.text_field`` column (needs
  pyarrow: ``pip install swarmd[data]``).

Trainer ``shard`` of ``num_shards`` keeps the documents whose (file index + document index) is
``shard`` modulo ``num_shards``, so trainers draw different documents. :class:`DataPosition` says
where the next sequence starts (epoch, file, record, token within what that record begins); a
restarted trainer given the saved position continues with exactly the next sequence.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from swarmd.errors import DataError

if TYPE_CHECKING:
    from swarmd.training.tokens import Tokenizer

__all__ = ["DataPosition", "Record", "TokenStream", "data_files", "read_records",
           "save_position", "load_position", "PIECE_BYTES"]

log = logging.getLogger(__name__)

#: a text file is read in pieces of about this many bytes, cut after a newline
PIECE_BYTES = 1 << 20
_JSONL = (".jsonl", ".ndjson")
_PARQUET = (".parquet",)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPosition:
    """Where the next sequence starts: ``token`` tokens into the text from record ``record``
    of file ``file`` (in sorted order), in pass ``epoch`` over the corpus."""

    epoch: int = 0
    file: int = 0
    record: int = 0
    token: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "file", "record", "token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(f"data position {name} = {value!r}: expected an integer >= 0")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> DataPosition:
        """A position from its dict; unknown keys dropped, bad values a :class:`DataError`."""
        if not isinstance(raw, dict):
            raise DataError(f"data position {raw!r}: expected an object")
        return cls(**{k: raw[k] for k in ("epoch", "file", "record", "token") if k in raw})


def save_position(path: Path, position: DataPosition) -> None:
    """Write ``position`` to ``path`` atomically (a temporary file renamed over it)."""
    from swarmd.files import write_atomic

    data = json.dumps(position.to_dict()).encode()
    write_atomic(path, lambda f: f.write(data))


def load_position(path: Path) -> DataPosition:
    """The position saved at ``path``; the start when there is none."""
    try:
        return DataPosition.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return DataPosition()
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable data position ({exc}); delete it to start the "
                        f"data over") from None


@dataclass(frozen=True, slots=True)
class Record:
    """One piece of text: record ``index`` of its file, part of document ``doc``; ``ends_doc``
    when the document ends with it (then an end-of-text token follows)."""

    index: int
    doc: int
    text: str | bytes
    ends_doc: bool


def data_files(path: Path | str) -> list[Path]:
    """The files of ``path``: itself, or the regular files of a tree in sorted order (symlinks
    not followed)."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"{path}: data path not found; set data.path to a text, JSONL or "
                        f"Parquet file or a directory of them")
    files = list(_walk(root))
    if not files:
        raise DataError(f"{path}: no files in this directory; put text, JSONL or Parquet files "
                        f"in it")
    return files


def _walk(root: Path) -> Iterator[Path]:
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
            yield from _walk(Path(entry.path))
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
            head = f.read(8192)
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


class TokenStream:
    """Sequences of ``seq_len + 1`` tokens from the documents of ``path`` owned by ``shard``."""

    def __init__(self, path: Path | str, tokenizer: Tokenizer, *, seq_len: int,
                 text_field: str = "text", shard: int = 0, num_shards: int = 1,
                 position: DataPosition = DataPosition()) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range: expected 0 to {num_shards - 1}")
        self.files = data_files(path)
        self.path, self.tokenizer, self.seq_len = Path(path), tokenizer, seq_len
        self.text_field, self.shard, self.num_shards = text_field, shard, num_shards
        #: where the next sequence starts: save it to resume after a restart
        self.position = position

    def _owned(self, file: int, record: Record) -> bool:
        return (file + record.doc) % self.num_shards == self.shard

    def _records(self, start: DataPosition) -> Iterator[tuple[DataPosition, Record]]:
        """(position of each owned record, record), from ``start`` on, pass after pass."""
        epoch, first_file, first_record = start.epoch, start.file, start.record
        while True:
            found = False
            for f in range(first_file, len(self.files)):
                for record in read_records(self.files[f], text_field=self.text_field,
                                           start=first_record if f == first_file else 0):
                    if self._owned(f, record):
                        found = True
                        yield DataPosition(epoch=epoch, file=f, record=record.index), record
                first_record = 0
            if not found and first_file == 0 and start.record == 0:
                raise DataError(f"{self.path}: no text for trainer shard {self.shard} of "
                                f"{self.num_shards} in {len(self.files)} file(s); give the "
                                f"corpus more files or documents than there are trainers")
            epoch, first_file, start = epoch + 1, 0, DataPosition()

    def sequences(self) -> Iterator[torch.Tensor]:
        """Packed sequences (seq_len + 1,) int64; :attr:`position` follows each one."""
        need = self.seq_len + 1
        pending: deque[tuple[DataPosition, list[int]]] = deque()  # records not yet all used
        used, have = 0, 0  # tokens of pending[0] already emitted; tokens pending in all
        skip = self.position.token
        for where, record in self._records(self.position):
            tokens = self.tokenizer.encode(record.text)
            if record.ends_doc:
                tokens.append(self.tokenizer.eot)
            if skip:
                dropped = min(skip, len(tokens))
                tokens, skip = tokens[dropped:], skip - dropped
                where = replace(where, token=where.token + dropped)
                if not tokens:
                    continue
            pending.append((where, tokens))
            have += len(tokens)
            while have >= need:
                out: list[int] = []
                while len(out) < need:
                    anchor, toks = pending[0]
                    take = min(need - len(out), len(toks) - used)
                    out += toks[used:used + take]
                    used += take
                    if used == len(toks):
                        pending.popleft()
                        used = 0
                have -= need
                if pending:
                    anchor, _ = pending[0]
                    self.position = replace(anchor, token=anchor.token + used)
                else:
                    self.position = replace(where, record=where.record + 1, token=0)
                yield torch.tensor(out, dtype=torch.long)

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """x, y int64 (batch_size, seq_len); y[:, t] is the token after x[:, t]."""
        sequences = self.sequences()
        while True:
            batch = torch.stack([next(sequences) for _ in range(batch_size)])
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
