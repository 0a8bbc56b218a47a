"""Hugging Face ``datasets`` as a corpus (optional: ``pip install swarmd[datasets]``), offline.

* a directory written by ``Dataset.save_to_disk`` (``state.json`` and ``dataset_info.json``)
  or ``DatasetDict.save_to_disk`` (``dataset_dict.json``: its ``train`` split, else its only
  one) is read with ``load_from_disk``: memory-mapped Arrow, read in batches, never whole;
* with ``data.reader = "datasets"``, local JSON, JSONL and Parquet files are read with
  ``load_dataset(..., streaming=True)``, one file at a time, row by row.

Nothing is fetched from a hub: only local paths are given to ``datasets``. Each row's
``data.text_field`` is a document; a row without it stops with a :class:`DataError` naming the
dataset and the row; an empty text is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from swarmd.data.records import Record
from swarmd.errors import DataError

__all__ = ["is_saved_dataset", "saved_records", "file_records", "check_loadable", "INSTALL"]

INSTALL = "install it with `pip install swarmd[datasets]`"
#: ``load_dataset`` builder of each file suffix it is given
_BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet"}
_BATCH = 1024


def is_saved_dataset(root: Path) -> bool:
    """Whether ``root`` is a directory written by ``save_to_disk``."""
    return ((root / "state.json").is_file() and (root / "dataset_info.json").is_file()) or \
        (root / "dataset_dict.json").is_file()


def _datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what}: reading it needs the Hugging Face datasets library, which is "
                        f"not installed; {INSTALL}") from None
    datasets.disable_progress_bars()
    return datasets


def check_loadable(files: Iterable[Path]) -> None:
    """:class:`DataError` unless every file is one ``load_dataset`` reads here."""
    for file in files:
        if file.suffix.lower() not in _BUILDERS:
            raise DataError(f"{file}: data.reader = \"datasets\" reads JSON, JSONL and Parquet "
                            f"files; remove this file or set data.reader = \"auto\"")


def saved_records(root: Path, text_field: str) -> Iterator[tuple[str, Record]]:
    """``(split, record)`` of every row of the dataset saved at ``root``."""
    datasets = _datasets(str(root))
    try:
        loaded = datasets.load_from_disk(str(root))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, its own errors
        raise DataError(f"{root}: not a dataset load_from_disk reads ({exc})") from None
    split = "train"
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        if "train" not in loaded and len(names) != 1:
            raise DataError(f"{root}: a dataset of splits {names} and none named train; save "
                            f"the split to train on alone")
        split = "train" if "train" in loaded else names[0]
        loaded = loaded[split]
    if text_field not in loaded.column_names:
        raise DataError(f'{root}: no column "{text_field}" (columns: {loaded.column_names}); '
                        f"set data.text_field to the column holding the text")
    index = 0
    for batch in loaded.select_columns([text_field]).iter(batch_size=_BATCH):
        for text in batch[text_field]:
            if isinstance(text, str) and text:
                yield split, Record(index, index, text, ends_doc=True)
            index += 1


def file_records(file: Path, text_field: str) -> Iterator[Record]:
    """The rows of one local JSON/Parquet file through ``load_dataset``, streamed."""
    datasets = _datasets(str(file))
    try:
        rows = datasets.load_dataset(_BUILDERS[file.suffix.lower()], data_files=[str(file)],
                                     split="train", streaming=True)
        for index, row in enumerate(rows):
            if text_field not in row:
                raise DataError(f'{file}: row {index + 1}: no field "{text_field}" (found '
                                f"{sorted(row)}); set data.text_field to the field holding "
                                f"the text")
            text = row[text_field]
            if isinstance(text, str) and text:
                yield Record(index, index, text, ends_doc=True)
    except DataError:
        raise
    except Exception as exc:  # pyarrow and datasets raise their own types
        raise DataError(f"{file}: load_dataset cannot read it ({type(exc).__name__}: {exc})") \
            from None
