"""Helpers of the data tests: a tokenizer whose every token names its place in the corpus."""

from __future__ import annotations

import json
from pathlib import Path

from swarmd.data.pipeline import DataSettings, TrainData, open_data


class NumberTokenizer:
    """Each whitespace-separated number is its own token id; end-of-text is 0. A corpus of
    distinct numbers makes every token (but end-of-text) say where it came from."""

    name = "numbers"
    vocab_size = 1 << 24
    eot = 0

    def __init__(self, identity: str = "numbers") -> None:
        self._identity = identity

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode()
        return [int(w) for w in text.split()]

    def identity(self) -> str:
        return self._identity


def number_corpus(root: Path, *, docs: int = 400, words: int = 60, files: int = 4) -> Path:
    """``docs`` JSONL documents in ``files`` files, of ``words`` distinct numbers each (1 up);
    document sizes vary (a third of them three times longer)."""
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    for f in range(files):
        lines = []
        for d in range(f, docs, files):
            count = words * (3 if d % 3 == 0 else 1)
            lines.append(json.dumps({"text": " ".join(str(n + i) for i in range(count))}))
            n += count
        (root / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def open_numbers(root: Path, cache: Path, say: list[str] | None = None,
                 **settings: object) -> TrainData:
    defaults: dict[str, object] = {"batch": 2, "seq_len": 8, "val_batches": 4}
    s = DataSettings(path=str(root), cache_dir=str(cache), **{**defaults, **settings})  # type: ignore[arg-type]
    return open_data(s, NumberTokenizer(), say=(say.append if say is not None else
                                                lambda _: None))


def ids(batch: tuple[object, object]) -> set[int]:
    """The token ids of a batch's windows (inputs and the last target), end-of-text left out."""
    x, y = batch
    rows = x.tolist()  # type: ignore[attr-defined]
    last = y[:, -1].tolist()  # type: ignore[index]
    return {t for row, z in zip(rows, last) for t in (*row, z) if t}


def windows(batch: tuple[object, object]) -> list[tuple[int, ...]]:
    x, y = batch
    return [(*row, z) for row, z in zip(x.tolist(), y[:, -1].tolist())]  # type: ignore[attr-defined,index]
