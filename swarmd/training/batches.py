"""Where a trainer's batches come from: :mod:`swarmd.data`, configured from ``[data]`` and
``[training]`` (docs/data.md).

Every corpus goes one way: the default byte corpus (the Python standard library's sources),
a ``data.path`` of text, JSONL or Parquet files or a Hugging Face dataset, with the byte
tokenizer or a tokenizer.json. It is tokenized once into a cached token file, split into a
held-out set (whole documents from across the corpus) and training windows, and this trainer's
shard of the windows is read in a seeded random order, epoch after epoch, made ahead on a
thread of its own. ``state()`` is what a trainer checkpoint keeps
(``swarmd.state.trainer_state``); ``restore()`` continues with exactly the next batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from swarmd.data.pipeline import DataSettings, TrainData, open_data
from swarmd.data.prefetch import Rate

__all__ = ["make_batches", "measure_rate", "TrainData", "Rate"]


def make_batches(config: Any, tokenizer: Any, *, data_path: Path | None, batch: int,
                 seq_len: int, val_batches: int,
                 say: Callable[[str], None] | None = None) -> TrainData:
    """The batches of ``config`` (``data_path`` overrides ``data.path``). Reads, and may
    tokenize, the corpus: call it off the event loop. ``say`` gets the data's one-line
    notices (a token cache built or rebuilt, a position that cannot be resumed)."""
    settings = DataSettings.from_config(config, data_path=data_path, batch=batch,
                                        seq_len=seq_len, val_batches=val_batches)
    return open_data(settings, tokenizer, say=say) if say is not None else \
        open_data(settings, tokenizer)


def measure_rate(batches: TrainData, n: int) -> Rate:
    """How fast ``batches`` prepares batches (batches/s, tokens/s), measured in this process
    over ``n`` batches; the trainer's position does not move."""
    return batches.measure_rate(n)
