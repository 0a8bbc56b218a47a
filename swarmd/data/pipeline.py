"""A trainer's data: held-out batches, shuffled training batches made ahead, its position.

:func:`open_data` builds what ``swarmd train`` reads (see docs/data.md):

* ``data.mode = "cached"`` (the default): the corpus is tokenized once into a token file
  (``swarmd.data.tokenfile``), split into held-out and training parts by document
  (``swarmd.data.heldout``, ``swarmd.data.windows``), and the trainer's shard of the training
  windows is read in a seeded order per epoch (``swarmd.data.order``): :class:`CachedData`;
* ``data.mode = "stream"``: for corpora too large to tokenize up front,
  ``swarmd.data.streamed.StreamedData``.

Both are a :class:`TrainData`: ``val`` (the fixed validation batches), ``next()`` (the next
training batch, made ahead on a thread: never reads or tokenizes on the caller's thread),
``place(me, others)`` (the shard of ``data.shard = "auto"``, from the trainers in view),
``state()`` and ``restore()`` (the position a trainer saves in its state, exact on resume),
``describe()`` (one line for the progress) and ``measure_rate(n)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from swarmd.data.corpus import find_corpus
from swarmd.data.order import Cursor, Shard, WindowOrder, auto_shard, parse_shard
from swarmd.data.prefetch import Prefetcher, Rate, measure_rate
from swarmd.data.tokenfile import TokenFile, load_or_build
from swarmd.data.windows import Batch, TokenWindows, split
from swarmd.errors import DataError

__all__ = ["DataSettings", "TrainData", "CachedData", "open_data", "default_cache_dir", "MODES"]

log = logging.getLogger(__name__)

#: allowed values of ``data.mode``
MODES = ("cached", "stream")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSettings:
    """What the data pipeline needs of the configuration."""

    path: str = ""
    text_field: str = "text"
    max_bytes: int = 32 << 20
    reader: str = "auto"
    mode: str = "cached"
    cache_dir: str = ""
    shard: str = "auto"
    shuffle_buffer: int = 4096
    seed: int = 0
    batch: int = 8
    seq_len: int = 128
    val_batches: int = 32

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"data.mode = {self.mode!r}: expected one of {MODES}")

    @classmethod
    def from_config(cls, config: Any, *, data_path: Path | None, batch: int, seq_len: int,
                    val_batches: int) -> DataSettings:
        d = config.data
        return cls(path=str(data_path) if data_path is not None else d.path,
                   text_field=d.text_field, max_bytes=d.max_bytes, reader=d.reader, mode=d.mode,
                   cache_dir=d.cache_dir, shard=d.shard, shuffle_buffer=d.shuffle_buffer,
                   seed=config.training.seed, batch=batch, seq_len=seq_len,
                   val_batches=val_batches)

    @property
    def window(self) -> int:
        """Tokens of one window: inputs and the target after the last one."""
        return self.seq_len + 1

    @property
    def val_tokens(self) -> int:
        """Tokens the validation batches need."""
        return self.val_batches * self.batch * self.window


def default_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/swarmd/tokens``, else ``~/.cache/swarmd/tokens``."""
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarmd" / "tokens"


class TrainData:
    """What :func:`open_data` returns; subclasses make the batches (see the module's doc)."""

    #: the ``kind`` of the position this data saves
    kind: ClassVar[str] = ""

    def __init__(self, settings: DataSettings, say: Callable[[str], None], *, origin: str,
                 corpus: str, val: list[Batch]) -> None:
        self.settings, self.say, self.origin, self.corpus = settings, say, origin, corpus
        self.val = val
        self._fixed = parse_shard(settings.shard)
        self.shard = self._fixed or Shard(0, 1)
        self._placed = self._fixed is not None
        self.prefetch: Prefetcher[Any] = Prefetcher(self._producer(self.shard),
                                                    self._start())

    # ---- what a kind of data provides -----------------------------------------------------
    def _producer(self, shard: Shard) -> Callable[[Any], tuple[Batch, Any]]:
        raise NotImplementedError

    def _start(self) -> Any:
        """The cursor of the first batch."""
        raise NotImplementedError

    def _order_id(self) -> str:
        """What numbers the windows: a position saved under another is meaningless here."""
        raise NotImplementedError

    def _cursor_json(self, cursor: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _cursor_of(self, raw: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _epoch_start(self, cursor: Any) -> Any:
        """The cursor of the beginning of ``cursor``'s epoch."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        raise NotImplementedError

    # ---- common ---------------------------------------------------------------------------
    def next(self) -> Batch:
        """The next training batch: x, y int64 (batch, seq_len)."""
        return self.prefetch.next()

    def start(self) -> None:
        """Start making batches ahead (the first ``next()`` does it otherwise)."""
        self.prefetch.start()

    def close(self) -> None:
        self.prefetch.close()

    def __enter__(self) -> TrainData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _use(self, shard: Shard, cursor: Any) -> None:
        self.shard = shard
        self.prefetch.close()
        self.prefetch = Prefetcher(self._producer(shard), cursor)

    def place(self, me: str, others: Iterable[str]) -> Shard:
        """This trainer's shard: ``data.shard`` when it names one, the shard its state was
        saved with when it resumed, else its place among the trainers in view (``others``,
        their peer ids) now. Batches are made ahead from then on."""
        if not self._placed:
            self._placed = True
            self._use(auto_shard(me, others), self._start())
        self.start()
        return self.shard

    def measure_rate(self, n: int) -> Rate:
        """How fast this data makes batches, timed in this process (the trainer's position
        does not move)."""
        return measure_rate(self._producer(self.shard), self.prefetch.cursor, n)

    def state(self, back: int = 0) -> dict[str, Any]:
        """The position of the next batch ``next()`` returns, for the trainer's state; with
        ``back``, of the one ``back`` draws ago (a trainer's batches drawn for a step it has
        not taken: ``Trainer.drawn_ahead``)."""
        return {"kind": self.kind, "corpus": self.corpus, "order": self._order_id(),
                "shard": str(self.shard),
                **self._cursor_json(self.prefetch.cursor_back(back))}

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from a saved :meth:`state`: exactly where it stopped when the corpus, the
        seed, the window size and the shard are those it was saved with; otherwise say what
        changed, in one line, and start the data over (the held-out set is this corpus's:
        nothing held out is trained on either way)."""
        kind = state.get("kind")
        if kind != self.kind:
            self.say(f"data: the trainer state holds a data position of another kind ({kind!r}: "
                     f"an older swarmd or another data.mode); the data starts over from the "
                     f"beginning")
            return
        if state.get("corpus") != self.corpus:
            self.say(f"data: {self.origin} changed since the trainer state was saved (or the "
                     f"tokenizer did); the data starts over from the beginning. To continue "
                     f"where it stopped, restore the corpus as it was")
            return
        if state.get("order") != self._order_id():
            self.say("data: training.seed, model.seq_len or the held-out set "
                     "(training.val_batches, training.batch_size) changed since the trainer "
                     "state was saved, which reorders the windows; the data starts over from "
                     "the beginning")
            return
        try:
            saved = parse_shard(str(state.get("shard")))
            cursor = self._cursor_of(state)
        except (ValueError, KeyError, TypeError, DataError) as exc:
            raise DataError(f"the trainer state's data position is unreadable ({exc}); move "
                            f"<home>/trainer away to start over") from None
        if saved is None:
            raise DataError("the trainer state's data position names no shard; move "
                            "<home>/trainer away to start over")
        if self._fixed is not None and saved != self._fixed:
            self.say(f"data: data.shard is {self._fixed}, the trainer state was saved reading "
                     f"shard {saved}: shard {self._fixed} starts at the beginning of epoch "
                     f"{self._cursor_json(cursor).get('epoch', 0)}")
            self._use(self._fixed, self._epoch_start(cursor))
            return
        self._placed = True
        self._use(saved, cursor)


class CachedData(TrainData):
    """The token cache's windows: a seeded order per epoch over this trainer's shard."""

    kind = "windows"

    def __init__(self, settings: DataSettings, tokens: TokenFile, say: Callable[[str], None],
                 *, origin: str) -> None:
        total, need, window = len(tokens.tokens), settings.val_tokens, settings.window
        one_batch = settings.batch * window
        if total < need + one_batch:
            raise DataError(
                f"{origin}: {total:,} tokens are too few: the held-out set takes {need:,} "
                f"(training.val_batches {settings.val_batches} x training.batch_size "
                f"{settings.batch} x (model.seq_len + 1) {window}) and one batch to train on "
                f"{one_batch:,} more; give the corpus more text, or lower "
                f"training.val_batches or model.seq_len")
        train, val = split(tokens.doc_starts, tokens.doc_keys, total, window=window, need=need)
        self.windows = TokenWindows(tokens.tokens, train, val, window)
        if self.windows.train_windows < settings.batch:
            raise DataError(
                f"{origin}: after holding out {val.total:,} of its {total:,} tokens (whole "
                f"documents), {self.windows.train_windows} training window(s) of {window} "
                f"tokens are left, fewer than one batch of {settings.batch}; give the corpus "
                f"more text, or lower training.val_batches")
        self.tokens = tokens
        super().__init__(settings, say, origin=origin, corpus=tokens.digest,
                         val=self.windows.val_batches(settings.val_batches, settings.batch))

    def _order(self, shard: Shard) -> WindowOrder:
        return WindowOrder(windows=self.windows.train_windows, shard=shard,
                           seed=self.settings.seed)

    def _producer(self, shard: Shard) -> Callable[[Cursor], tuple[Batch, Cursor]]:
        order, windows, batch = self._order(shard), self.windows, self.settings.batch

        def produce(cursor: Cursor) -> tuple[Batch, Cursor]:
            ids, after = order.take(cursor, batch)
            return windows.batch(ids), after

        return produce

    def _start(self) -> Cursor:
        return Cursor()

    def _order_id(self) -> str:
        w = self.windows
        ident = (f"{self.corpus}/{self.settings.seed}/{w.length}/{w.train.total}/"
                 f"{w.val.total}/{w.train_windows}")
        return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()

    def _cursor_json(self, cursor: Cursor) -> dict[str, Any]:
        return {"epoch": cursor.epoch, "index": cursor.index}

    def _cursor_of(self, raw: dict[str, Any]) -> Cursor:
        return Cursor(epoch=raw["epoch"], index=raw["index"])

    def _epoch_start(self, cursor: Cursor) -> Cursor:
        return Cursor(epoch=cursor.epoch)

    @property
    def epoch(self) -> int:
        return int(self.prefetch.cursor.epoch)

    def describe(self) -> str:
        w, cursor = self.windows, self.prefetch.cursor
        per = self.shard.size(w.train_windows)
        return (f"data: {self.origin}, {len(w.tokens):,} tokens ({self.tokens.path}); held out "
                f"{w.val.total:,} tokens by document, {len(self.val)} validation batches; shard "
                f"{self.shard} reads {per:,} of {w.train_windows:,} training windows of "
                f"{w.length} tokens per epoch in a seeded order, at epoch {cursor.epoch} "
                f"window {cursor.index:,}")


def open_data(settings: DataSettings, tokenizer: Any, *,
              say: Callable[[str], None] = log.info) -> TrainData:
    """A trainer's data (see the module's doc). Reads the corpus, and in cached mode
    tokenizes it when its token file is missing or stale: call it off the event loop."""
    corpus = find_corpus(settings.path, text_field=settings.text_field,
                         max_bytes=settings.max_bytes, reader=settings.reader)
    if settings.mode == "stream":
        from swarmd.data.streamed import StreamedData

        return StreamedData(settings, corpus, tokenizer, say)
    cache = Path(settings.cache_dir).expanduser() if settings.cache_dir else default_cache_dir()
    tokens = load_or_build(corpus, tokenizer, cache, say)
    return CachedData(settings, tokens, say, origin=corpus.origin)
