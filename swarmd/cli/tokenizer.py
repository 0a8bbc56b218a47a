"""``swarmd tokenizer train``: a BPE tokenizer trained locally on the training data."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TokenizerTrained", "_tokenizer_arguments", "cmd_tokenizer", "text_tokenizer"]


@dataclass(frozen=True)
class TokenizerTrained:
    path: str
    vocab_size: int
    eot: int
    files: int
    records: int
    bytes: int


def _tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["train"], help="train: train a new tokenizer")
    parser.add_argument("--data", required=True, type=Path, metavar="PATH",
                        help="text, JSONL or Parquet file, or a directory of them")
    parser.add_argument("--vocab", required=True, type=int, metavar="N",
                        help="vocabulary size (at least 257)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="directory to write tokenizer.json into")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="JSONL field / Parquet column holding the text (default: text)")
    parser.add_argument("--max-bytes", type=int, default=256 << 20, metavar="N",
                        help="most bytes of text to train on (default: 256 MiB)")


def cmd_tokenizer(args: argparse.Namespace) -> TokenizerTrained:
    from swarmd.training.stream import data_files, read_records
    from swarmd.training.tokens import load_tokenizer, train_bpe

    files = data_files(args.data)
    seen = {"records": 0, "bytes": 0}

    def texts() -> Iterator[str | bytes]:
        for file in files:
            for record in read_records(file, text_field=args.text_field):
                if seen["bytes"] >= args.max_bytes:
                    return
                seen["records"] += 1
                seen["bytes"] += len(record.text)
                yield record.text

    path = train_bpe(texts(), args.vocab, args.out)
    tokenizer = load_tokenizer(str(path))
    return TokenizerTrained(path=str(path), vocab_size=tokenizer.vocab_size, eot=tokenizer.eot,
                            files=len(files), records=seen["records"], bytes=seen["bytes"])


def text_tokenizer(result: TokenizerTrained) -> str:
    return (f"tokenizer of {result.vocab_size} tokens (end-of-text {result.eot}) trained on "
            f"{result.bytes} bytes in {result.records} record(s) of {result.files} file(s): "
            f"{result.path}")
