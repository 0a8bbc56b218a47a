"""Hugging Face datasets as a corpus (the optional `swarmd[datasets]` extra), offline: a
save_to_disk directory, local JSON/Parquet files through load_dataset; a missing column stops
with one line. Skipped where the datasets library is not installed."""

from __future__ import annotations

import json

import pytest

from data_helpers import ids, open_numbers
from swarmd.errors import DataError

datasets = pytest.importorskip(
    "datasets", reason="Hugging Face datasets is not installed (pip install swarmd[datasets])")


def _rows(n: int) -> list[str]:
    return [" ".join(str(1 + 30 * i + j) for j in range(30)) for i in range(n)]


def test_a_saved_dataset_is_a_corpus(tmp_path) -> None:
    texts = _rows(300)
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": texts, "n": list(range(300))}),
        "test": datasets.Dataset.from_dict({"text": ["1 2"], "n": [0]}),
    }).save_to_disk(str(tmp_path / "saved"))
    said: list[str] = []
    data = open_numbers(tmp_path / "saved", tmp_path / "cache", said)
    assert "300 documents" in said[-1]
    seen = set().union(*(ids(data.next()) for _ in range(200)))
    assert seen and max(seen) <= 9000
    data.close()
    said.clear()
    open_numbers(tmp_path / "saved", tmp_path / "cache", said).close()
    assert said == []  # cached like any corpus
    with pytest.raises(DataError, match=r'saved: no column "body" \(columns: \[.text., .n.\]\)'):
        open_numbers(tmp_path / "saved", tmp_path / "cache", text_field="body")


def test_local_json_and_parquet_files_through_load_dataset(tmp_path) -> None:
    texts = _rows(200)
    root = tmp_path / "files"
    root.mkdir()
    (root / "a.json").write_text(json.dumps([{"text": t} for t in texts[:100]]))  # a JSON array
    datasets.Dataset.from_dict({"text": texts[100:]}).to_parquet(str(root / "b.parquet"))
    data = open_numbers(root, tmp_path / "cache", reader="datasets")
    tokens = {int(t) for t in data.windows.tokens.tolist() if t}  # type: ignore[attr-defined]
    assert tokens == set(range(1, 6001))  # every row of both files
    data.close()
    (root / "c.txt").write_text("1 2 3")
    with pytest.raises(DataError, match='c.txt: data.reader = "datasets" reads JSON'):
        open_numbers(root, tmp_path / "cache", reader="datasets")
    (root / "c.txt").unlink()
    (root / "d.jsonl").write_text(json.dumps({"body": "1"}) + "\n")
    with pytest.raises(DataError, match=r'd.jsonl: row 1: no field "text"'):
        open_numbers(root, tmp_path / "cache", reader="datasets")
