"""Where a trainer's batches come from, and how it resumes them after a restart.

* :class:`CorpusBatches`: no ``data.path`` and the byte tokenizer: windows at random places of a
  byte corpus (the Python standard library's sources), from a seeded generator; fixed
  validation batches from the corpus's held-out end. Resuming restores the generator's state.
* :class:`StreamBatches`: a ``data.path`` (text, JSONL or Parquet) or a tokenizer.json: packed
  token sequences streamed in order (``swarmd.training.stream.TokenStream``). The first
  ``val_batches`` batches are held out for validation and training starts after them;
  resuming restores the :class:`~swarmd.training.stream.DataPosition`. After a full pass the
  stream starts over, held-out part included.

``state()`` is what a trainer checkpoint keeps (``swarmd.training.trainer_state``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from swarmd.errors import DataError
from swarmd.training.stream import DataPosition, TokenStream

__all__ = ["CorpusBatches", "StreamBatches", "make_batches"]

Batch = tuple[torch.Tensor, torch.Tensor]


class CorpusBatches:
    """Random windows of a byte corpus (``swarmd.training.data.Corpus``)."""

    kind = "corpus"

    def __init__(self, corpus: Any, *, batch: int, seq_len: int, seed: int,
                 val_batches: int) -> None:
        self.corpus, self.batch, self.seq_len = corpus, batch, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.val = corpus.val_batches(batch, seq_len, val_batches)

    def next(self) -> Batch:
        return self.corpus.sample_batch("train", self.batch, self.seq_len, self.generator)

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "generator": self.generator.get_state()}

    def restore(self, state: dict[str, Any]) -> None:
        _same_kind(state, self.kind)
        generator = state.get("generator")
        if not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8:
            raise DataError("the trainer state's batch generator is unreadable")
        self.generator.set_state(generator)


class StreamBatches:
    """Packed sequences of a :class:`~swarmd.training.stream.TokenStream`, in order."""

    kind = "stream"

    def __init__(self, path: Path | str, tokenizer: Any, *, batch: int, seq_len: int,
                 text_field: str, val_batches: int) -> None:
        self._make = lambda position: TokenStream(path, tokenizer, seq_len=seq_len,
                                                  text_field=text_field, position=position)
        self.batch = batch
        held_out = self._make(DataPosition())
        sequences = held_out.batches(batch)
        self.val = [next(sequences) for _ in range(val_batches)]
        #: where training starts: after the held-out batches
        self.start = held_out.position
        self.stream = self._make(self.start)
        self._batches = self.stream.batches(batch)

    @property
    def position(self) -> DataPosition:
        return self.stream.position

    def next(self) -> Batch:
        return next(self._batches)

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": self.stream.position.to_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        _same_kind(state, self.kind)
        self.stream = self._make(DataPosition.from_dict(state.get("position")))
        self._batches = self.stream.batches(self.batch)


def _same_kind(state: dict[str, Any], kind: str) -> None:
    if state.get("kind") != kind:
        raise DataError(f"the trainer state holds a {state.get('kind')!r} data position, this "
                        f"run reads {kind!r} data (data.path or data.tokenizer changed); move "
                        f"<home>/trainer away to start over")


def make_batches(config: Any, tokenizer: Any, *, data_path: Path | None, batch: int,
                 seq_len: int, val_batches: int) -> CorpusBatches | StreamBatches:
    """The batches of ``config`` (``data_path`` overrides ``data.path``; see the module's
    doc for which kind)."""
    from swarmd.training.data import load_corpus, stdlib_dir

    path = data_path if data_path is not None else (Path(config.data.path) if config.data.path
                                                    else None)
    if path is None and tokenizer.name == "bytes":
        corpus = load_corpus(None, max_bytes=config.data.max_bytes, seq_len=seq_len)
        return CorpusBatches(corpus, batch=batch, seq_len=seq_len, seed=config.training.seed,
                             val_batches=val_batches)
    return StreamBatches(path if path is not None else stdlib_dir(), tokenizer, batch=batch,
                         seq_len=seq_len, text_field=config.data.text_field,
                         val_batches=val_batches)
