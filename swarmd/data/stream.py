"""Streamed training data: text files and trees, JSONL and Parquet, tokenized and packed.

Documents are read one at a time (a corpus larger than memory works), tokenized, each followed
by the tokenizer's end-of-text token, and packed into sequences of ``seq_len + 1`` tokens
(inputs are the first ``seq_len``, targets the last ``seq_len``). What a file holds (text,
JSONL, Parquet) is read by :mod:`swarmd.data.records`. ``swarmd train`` reads through
:mod:`swarmd.data` (a shuffled token cache); this in-order stream is what its streamed
fallback (``data.mode = "stream"``) shuffles.

Trainer ``shard`` of ``num_shards`` keeps the documents whose (file index + document index) is
``shard`` modulo ``num_shards``, so trainers draw different documents. :class:`DataPosition` says
where the next sequence starts (epoch, file, record, token within what that record begins); a
restarted trainer given the saved position continues with exactly the next sequence.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from swarmd.data.records import Record, data_files, read_records
from swarmd.errors import DataError

__all__ = ["DataPosition", "Record", "TokenStream", "data_files", "read_records",
           "save_position", "load_position"]

log = logging.getLogger(__name__)


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


class TokenStream:
    """Sequences of ``seq_len + 1`` tokens from the documents of ``path`` owned by ``shard``.

    ``files`` replaces the listing of ``path`` (the default corpus: the standard library's
    ``*.py`` files). ``keep(file, record)`` replaces the shard's rule for which records are
    read (``file`` indexes ``files``); ``file_order(epoch)`` gives the order the files are read
    in that epoch (a permutation of their indices; ``DataPosition.file`` counts along it)."""

    def __init__(self, path: Path | str, tokenizer: Any, *, seq_len: int,
                 text_field: str = "text", shard: int = 0, num_shards: int = 1,
                 position: DataPosition = DataPosition(),
                 files: Sequence[Path] | None = None,
                 keep: Callable[[int, Record], bool] | None = None,
                 file_order: Callable[[int], Sequence[int]] | None = None) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range: expected 0 to {num_shards - 1}")
        self.files = list(files) if files is not None else data_files(path)
        self.path, self.tokenizer, self.seq_len = Path(path), tokenizer, seq_len
        self.text_field, self.shard, self.num_shards = text_field, shard, num_shards
        self._keep, self._order = keep, file_order
        #: where the next sequence starts: save it to resume after a restart
        self.position = position

    def _owned(self, file: int, record: Record) -> bool:
        if self._keep is not None:
            return self._keep(file, record)
        return (file + record.doc) % self.num_shards == self.shard

    def _records(self, start: DataPosition) -> Iterator[tuple[DataPosition, Record]]:
        """(position of each owned record, record), from ``start`` on, pass after pass."""
        epoch, first_file, first_record = start.epoch, start.file, start.record
        while True:
            found = False
            order = (list(self._order(epoch)) if self._order is not None
                     else range(len(self.files)))
            for at in range(first_file, len(self.files)):
                f = order[at]
                for record in read_records(self.files[f], text_field=self.text_field,
                                           start=first_record if at == first_file else 0):
                    if self._owned(f, record):
                        found = True
                        yield DataPosition(epoch=epoch, file=at, record=record.index), record
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
