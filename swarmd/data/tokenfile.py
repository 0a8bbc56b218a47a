"""The token cache: a corpus tokenized once per corpus and tokenizer, memory-mapped after.

Like nanoGPT's prepare step: every document is tokenized and followed by end-of-text, and
the tokens are written to one file, read back with ``numpy.memmap`` (nothing is loaded into
memory; every trainer on a machine shares the page cache). The file, ``<cache>/<name>.tokens``
(``data.cache_dir``; the name is the corpus directory's and a hash of its full path, reader,
tokenizer name, ``data.text_field`` and ``data.max_bytes``), is:

=========  =========================================================================
offset     content
=========  =========================================================================
0          ``SWARMDTK``, a little-endian uint32 length, then a JSON header (format,
           the :class:`~swarmd.data.fingerprint.Fingerprint`'s digest, dtype, counts,
           the offsets below), padded to :data:`HEADER_BYTES`
tokens_at  the tokens: uint8 for a vocabulary of at most 256, uint16 up to 65,536,
           else uint32
starts_at  where each document starts (int64, one per document)
keys_at    each document's held-out key (uint64, ``swarmd.data.heldout.doc_key``)
files_at   the fingerprint as JSON (for saying what changed)
=========  =========================================================================

It is written to a temporary file, fsynced and renamed over the old one
(``swarmd.files.write_atomic``): a build killed half-way leaves the old file or none. A file
whose fingerprint differs from the corpus's (a file changed, added or removed, the tokenizer
or ``data.text_field`` changed), or that cannot be read, is rebuilt, and
:func:`load_or_build` says so in one line naming what changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from swarmd.data.corpus import Corpus, documents, listing
from swarmd.data.fingerprint import Fingerprint, changes
from swarmd.data.heldout import doc_key
from swarmd.data.records import Record
from swarmd.errors import DataError
from swarmd.files import write_atomic

__all__ = ["TokenFile", "load_or_build", "build", "open_token_file", "fingerprint_of",
           "token_dtype", "cache_path", "MAGIC", "FORMAT", "HEADER_BYTES"]

log = logging.getLogger(__name__)

MAGIC = b"SWARMDTK"
#: bump when the layout changes: older files are rebuilt
FORMAT = 1
HEADER_BYTES = 4096
#: texts tokenized together (one call of the tokenizer): at most this many bytes
CHUNK_BYTES = 1 << 20
CHUNK_RECORDS = 4096


@dataclass(frozen=True, eq=False)
class TokenFile:
    """A token cache, open: ``tokens`` memory-mapped, documents' starts and keys."""

    path: Path
    tokens: np.ndarray
    doc_starts: np.ndarray
    doc_keys: np.ndarray
    header: dict[str, Any]

    @property
    def digest(self) -> str:
        return str(self.header["digest"])


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type holding ids below ``vocab_size``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit 32 bits")


def fingerprint_of(corpus: Corpus, tokenizer: Any) -> Fingerprint:
    """The fingerprint of ``corpus`` tokenized by ``tokenizer`` (one stat per file)."""
    return Fingerprint(files=listing(corpus), tokenizer=tokenizer.identity(), settings=tuple(
        sorted({"format": str(FORMAT), "reader": corpus.reader,
                "data.text_field": corpus.text_field,
                "data.max_bytes": str(corpus.max_bytes)}.items())))


def cache_path(cache_dir: Path, corpus: Corpus, tokenizer: Any) -> Path:
    """Where the token file of ``corpus`` and ``tokenizer`` is kept."""
    ident = (f"{corpus.root.resolve()}\0{corpus.reader}\0{tokenizer.name}\0"
             f"{corpus.text_field}\0{corpus.max_bytes}")
    digest = hashlib.blake2b(ident.encode(), digest_size=6).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", corpus.root.name or "corpus")[:40]
    return cache_dir / f"{stem}-{digest}.tokens"


# ---- reading -----------------------------------------------------------------------------

def read_header(path: Path) -> dict[str, Any]:
    """The header of the token file at ``path``; ValueError when it is not one."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < 12 or head[:8] != MAGIC:
        raise ValueError("not a swarmd token file")
    (length,) = struct.unpack("<I", head[8:12])
    if not 12 + length <= len(head):
        raise ValueError("its header is cut short")
    header = json.loads(head[12:12 + length])
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format') if isinstance(header, dict) else '?'}, "
                         f"not {FORMAT}")
    return header


def open_token_file(path: Path) -> TokenFile:
    """The token file at ``path``, memory-mapped; ValueError when damaged."""
    header = read_header(path)
    size = path.stat().st_size
    tokens, docs = int(header["tokens"]), int(header["docs"])
    dtype = np.dtype(header["dtype"])
    if size < int(header["files_at"]) + int(header["files_len"]):
        raise ValueError(f"{size} bytes, shorter than its header says: cut short")
    return TokenFile(
        path=path, header=header,
        tokens=np.memmap(path, dtype=dtype, mode="r", offset=int(header["tokens_at"]),
                         shape=(tokens,)),
        doc_starts=np.fromfile(path, dtype="<i8", count=docs, offset=int(header["starts_at"])),
        doc_keys=np.fromfile(path, dtype="<u8", count=docs, offset=int(header["keys_at"])))


def stored_fingerprint(path: Path, header: dict[str, Any]) -> Fingerprint:
    with open(path, "rb") as f:
        f.seek(int(header["files_at"]))
        return Fingerprint.from_json(json.loads(f.read(int(header["files_len"]))))


# ---- building ----------------------------------------------------------------------------

def _budget(records: Iterable[tuple[str, Record]], max_bytes: int,
            seen: dict[str, int]) -> Iterator[tuple[str, Record]]:
    """The records until ``max_bytes`` bytes of text were read, the last one cut to fit."""
    for name, record in records:
        data = record.text.encode() if isinstance(record.text, str) else record.text
        left = max_bytes - seen["bytes"]
        if len(data) >= left:
            cut = data[:left]
            text: str | bytes = (cut.decode("utf-8", errors="ignore")
                                 if isinstance(record.text, str) else cut)
            seen["bytes"] = max_bytes
            seen["truncated"] = 1
            yield name, replace(record, text=text, ends_doc=True)
            return
        seen["bytes"] += len(data)
        yield name, record


def _chunks(records: Iterable[tuple[str, Record]]) -> Iterator[list[tuple[str, Record]]]:
    chunk: list[tuple[str, Record]] = []
    size = 0
    for item in records:
        chunk.append(item)
        size += len(item[1].text)
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_RECORDS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encode(tokenizer: Any, texts: list[str | bytes]) -> Sequence[Sequence[int]]:
    batch = getattr(tokenizer, "encode_batch", None)
    return batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]


def build(corpus: Corpus, tokenizer: Any, path: Path, fingerprint: Fingerprint) -> None:
    """Tokenize ``corpus`` into the token file ``path`` (atomically)."""
    dtype = token_dtype(tokenizer.vocab_size)
    eot = np.asarray([tokenizer.eot], dtype)

    def write(f: IO[bytes]) -> None:
        f.write(bytes(HEADER_BYTES))
        starts, keys = array("q"), array("Q")
        seen = {"bytes": 0, "truncated": 0}
        names: set[str] = set()
        n = 0
        in_doc, doc_tokens = False, 0  # a document begun, and its text tokens so far
        for chunk in _chunks(_budget(documents(corpus), corpus.max_bytes, seen)):
            for (name, record), ids in zip(chunk, _encode(tokenizer, [r.text for _, r in chunk])):
                names.add(name)
                if not in_doc:
                    starts.append(n)
                    keys.append(doc_key(name, record.doc))
                    in_doc, doc_tokens = True, 0
                if len(ids):
                    f.write(np.asarray(ids, dtype).tobytes())
                    n += len(ids)
                    doc_tokens += len(ids)
                if record.ends_doc:
                    if doc_tokens:
                        f.write(eot.tobytes())
                        n += 1
                    else:  # an empty document: nothing to train on, not counted
                        starts.pop()
                        keys.pop()
                    in_doc = False
        if in_doc and doc_tokens:  # cut by the budget mid-document
            f.write(eot.tobytes())
            n += 1
        elif in_doc:
            starts.pop()
            keys.pop()
        if n == 0:
            raise DataError(f"{corpus.origin}: no text to train on in {len(corpus.files)} "
                            f"file(s) (binary and empty files are skipped); point data.path "
                            f"at text, JSONL or Parquet files, or set it to \"\" for Python's "
                            f"sources")
        at = f.tell()
        pad = -at % 8
        f.write(bytes(pad))
        starts_at = at + pad
        f.write(np.frombuffer(starts, dtype=np.int64).astype("<i8").tobytes())
        keys_at = f.tell()
        f.write(np.frombuffer(keys, dtype=np.uint64).astype("<u8").tobytes())
        files_at = f.tell()
        files = json.dumps(fingerprint.to_json()).encode()
        f.write(files)
        skipped = len(corpus.files) - len(names) if corpus.reader == "files" else 0
        header = {"format": FORMAT, "digest": fingerprint.digest(), "dtype": dtype.name,
                  "tokens": n, "docs": len(starts), "tokens_at": HEADER_BYTES,
                  "starts_at": starts_at, "keys_at": keys_at, "files_at": files_at,
                  "files_len": len(files), "tokenizer": tokenizer.identity(),
                  "bytes": seen["bytes"], "truncated": bool(seen["truncated"]),
                  "files_skipped": skipped, "origin": corpus.origin}
        raw = json.dumps(header).encode()
        if 12 + len(raw) > HEADER_BYTES:
            raise AssertionError(f"a token file header of {len(raw)} bytes")
        f.seek(0)
        f.write(MAGIC + struct.pack("<I", len(raw)) + raw)

    try:
        write_atomic(path, write)
    except OSError as exc:
        raise DataError(f"{path}: cannot write the token cache ({exc.strerror}); set "
                        f"data.cache_dir to a writable directory with room for it") from None


def load_or_build(corpus: Corpus, tokenizer: Any, cache_dir: Path,
                  say: Callable[[str], None]) -> TokenFile:
    """The token file of ``corpus`` and ``tokenizer`` in ``cache_dir``: reused when its
    fingerprint matches, else (re)built, saying so in one line."""
    path = cache_path(cache_dir, corpus, tokenizer)
    fingerprint = fingerprint_of(corpus, tokenizer)
    reason = None
    if path.exists():
        try:
            header = read_header(path)
            if header.get("digest") == fingerprint.digest():
                return open_token_file(path)
            reason = changes(stored_fingerprint(path, header), fingerprint) or "it changed"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            reason = f"it is unreadable: {exc}"
    if reason is None:
        say(f"data: tokenizing {corpus.origin} into {path} (once per corpus and tokenizer)")
    else:
        say(f"data: the token cache {path} does not match {corpus.origin} ({reason}): "
            f"rebuilding it")
    build(corpus, tokenizer, path, fingerprint)
    built = open_token_file(path)
    h = built.header
    say(f"data: {h['tokens']:,} tokens of {h['docs']:,} documents"
        + (f", {h['files_skipped']} binary or empty file(s) skipped" if h["files_skipped"]
           else "")
        + (f", cut at data.max_bytes = {corpus.max_bytes:,}" if h["truncated"] else ""))
    return built
