"""The streamed fallback (``data.mode = "stream"``): for corpora too large to tokenize up front.

Nothing is cached: documents are read and tokenized as training goes
(``swarmd.data.stream.TokenStream``), and shuffled twice:

* each epoch reads the files in a new seeded order (a :class:`~swarmd.data.order.Permutation`
  keyed by ``(training.seed, epoch)``);
* the packed windows are read in blocks of ``data.shuffle_buffer`` windows, and each block in a
  seeded order of its own (keyed by the seed, the block's number and the shard): a bounded
  shuffle buffer.

Held out by whole document: one document in :data:`~swarmd.data.heldout.RATE` by the same
key as the cached mode's (its block 0), never more (the stream cannot see the whole corpus to
pick more); the validation batches are the first held-out windows of a pass in file order.
Shards are by document, a second hash of its key (``heldout.shard_of_doc``): trainers of
distinct shards never read the same document. The position a trainer saves is where its block
began in the stream (epoch, file, record, token), the block's number and the index in it: a
restarted trainer reads that block again and continues with exactly the next window.
Only text, JSONL and Parquet files (swarmd's readers) stream this way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarmd.data.corpus import Corpus
from swarmd.data.heldout import doc_key, is_held_out, shard_of_doc, unit_hash
from swarmd.data.order import Permutation, Shard, mix_key
from swarmd.data.pipeline import DataSettings, TrainData
from swarmd.data.records import Record
from swarmd.data.stream import DataPosition, TokenStream
from swarmd.data.tokenfile import fingerprint_of
from swarmd.data.windows import Batch, pairs
from swarmd.errors import DataError

__all__ = ["StreamedData", "BlockCursor"]

_FILES_SALT = 0x5F11E5


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCursor:
    """Block ``block`` began at ``start`` in the stream; ``index`` windows of it were read."""

    start: dict[str, int]
    block: int = 0
    index: int = 0


class _Blocks:
    """One reader of the stream's blocks (a thread's own: it keeps its place between them)."""

    def __init__(self, make: Callable[[dict[str, int]], Any], size: int) -> None:
        self._make, self.size = make, size
        self._live: tuple[dict[str, int], Any, Iterator[Any]] | None = None
        self._last: tuple[dict[str, int], np.ndarray, dict[str, int]] | None = None

    def read(self, start: dict[str, int]) -> tuple[np.ndarray, dict[str, int]]:
        """The windows of the block beginning at ``start`` and where the next one begins."""
        if self._last is not None and self._last[0] == start:
            return self._last[1], self._last[2]
        if self._live is None or self._live[0] != start:
            stream = self._make(start)
            self._live = (start, stream, stream.sequences())
        _, stream, sequences = self._live
        rows = np.stack([next(sequences).numpy() for _ in range(self.size)])
        after = stream.position.to_dict()
        self._live = (after, stream, sequences)
        self._last = (start, rows, after)
        return rows, after


class StreamedData(TrainData):
    """See the module's doc."""

    kind = "stream-blocks"

    def __init__(self, settings: DataSettings, corpus: Corpus, tokenizer: Any,
                 say: Callable[[str], None]) -> None:
        if corpus.reader != "files":
            raise DataError(f"{corpus.origin}: data.mode = \"stream\" reads text, JSONL and "
                            f"Parquet files; a datasets corpus is read through the token cache: "
                            f'set data.mode = "cached"')
        self.settings, self.corpus_files, self.tokenizer = settings, corpus, tokenizer
        self._names = [corpus.name(f) for f in corpus.files]
        self._orders: dict[int, list[int]] = {}
        digest = fingerprint_of(corpus, tokenizer).digest()
        val = self._val_batches(settings)
        super().__init__(settings, say, origin=corpus.origin, corpus=digest, val=val)

    # ---- which documents ------------------------------------------------------------------
    def _key(self, file: int, record: Record) -> int:
        return doc_key(self._names[file], record.doc)

    def _held(self, file: int, record: Record) -> bool:
        return is_held_out(unit_hash(self._key(file, record), 0))

    def _file_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            perm = Permutation(len(self._names), mix_key(self.settings.seed, epoch, _FILES_SALT))
            self._orders = {epoch: [perm(i) for i in range(len(self._names))]}
        return self._orders[epoch]

    def _stream(self, position: dict[str, int], keep: Callable[[int, Record], bool],
                ordered: bool, shard: Shard = Shard()) -> Any:
        c = self.corpus_files
        return TokenStream(c.root, self.tokenizer, seq_len=self.settings.seq_len,
                           text_field=c.text_field, files=c.files, keep=keep,
                           shard=shard.index, num_shards=shard.count,
                           file_order=self._file_order if ordered else None,
                           position=DataPosition.from_dict(position))

    def _val_batches(self, settings: DataSettings) -> list[Batch]:
        want = settings.val_batches * settings.batch
        stream = self._stream({}, self._held, ordered=False)
        rows: list[np.ndarray] = []
        try:
            for sequence in stream.sequences():
                if stream.position.epoch > 0 and len(rows) < want:
                    break
                rows.append(sequence.numpy())
                if len(rows) == want:
                    break
        except DataError:  # no held-out document at all
            pass
        if len(rows) < want:
            raise DataError(
                f"{self.corpus_files.origin}: in data.mode = \"stream\", one document in 200 "
                f"is held out, and those hold {len(rows)} of the {want} windows the "
                f"validation batches need (training.val_batches x training.batch_size); use "
                f'data.mode = "cached" (it holds out more when needed), a corpus of more '
                f"documents, or lower training.val_batches")
        array = np.stack(rows)
        b = settings.batch
        return [pairs(array[i * b:(i + 1) * b]) for i in range(settings.val_batches)]

    # ---- TrainData ------------------------------------------------------------------------
    def _producer(self, shard: Shard) -> Callable[[BlockCursor], tuple[Batch, BlockCursor]]:
        def keep(file: int, record: Record) -> bool:
            key = self._key(file, record)
            return not is_held_out(unit_hash(key, 0)) and \
                shard_of_doc(key, shard.count) == shard.index

        blocks = _Blocks(lambda start: self._stream(start, keep, ordered=True, shard=shard),
                         self.settings.shuffle_buffer)
        batch, seed = self.settings.batch, self.settings.seed

        def produce(cursor: BlockCursor) -> tuple[Batch, BlockCursor]:
            rows = []
            while len(rows) < batch:
                windows, after = blocks.read(cursor.start)
                perm = Permutation(len(windows), mix_key(seed, cursor.block, shard.index,
                                                         shard.count))
                rows.append(windows[perm(cursor.index)])
                cursor = (BlockCursor(start=cursor.start, block=cursor.block,
                                      index=cursor.index + 1)
                          if cursor.index + 1 < len(windows)
                          else BlockCursor(start=after, block=cursor.block + 1))
            return pairs(np.stack(rows)), cursor

        return produce

    def _start(self) -> BlockCursor:
        return BlockCursor(start={})

    def _order_id(self) -> str:
        s = self.settings
        ident = f"{self.corpus}/{s.seed}/{s.window}/{s.shuffle_buffer}"
        return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()

    def _cursor_json(self, cursor: BlockCursor) -> dict[str, Any]:
        return {"epoch": int(cursor.start.get("epoch", 0)), "position": dict(cursor.start),
                "block": cursor.block, "index": cursor.index}

    def _cursor_of(self, raw: dict[str, Any]) -> BlockCursor:
        start = DataPosition.from_dict(raw["position"]).to_dict()
        block, index = raw["block"], raw["index"]
        if not (isinstance(block, int) and isinstance(index, int) and block >= 0
                and 0 <= index < self.settings.shuffle_buffer):
            raise ValueError(f"block {block!r}, index {index!r}")
        return BlockCursor(start=start, block=block, index=index)

    def _epoch_start(self, cursor: BlockCursor) -> BlockCursor:
        return BlockCursor(start={"epoch": int(cursor.start.get("epoch", 0))},
                           block=cursor.block + 1)

    @property
    def epoch(self) -> int:
        return int(self.prefetch.cursor.start.get("epoch", 0))

    def describe(self) -> str:
        s = self.settings
        return (f"data: {self.origin}, streamed (data.mode = stream): held out one document "
                f"in 200, {len(self.val)} validation batches; shard {self.shard} by document, "
                f"files in a seeded order per epoch, windows shuffled in blocks of "
                f"{s.shuffle_buffer}; at epoch {self.epoch}")
