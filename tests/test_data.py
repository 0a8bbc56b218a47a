"""swarmd.training.data: reading corpora, batches, validation batches, errors; the [data] and [training]
configuration keys."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from swarmd.config import ConfigError, load_config
from swarmd.training.data import SNIFF_BYTES, Corpus, DataError, load_corpus, stdlib_dir
from swarmd.errors import SwarmdError

torch.set_num_threads(1)
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))


def test_text_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXT)
    corpus = load_corpus(path, seq_len=16)
    assert corpus.data.dtype == torch.uint8 and bytes(corpus.data.tolist()) == TEXT.encode()
    assert corpus.files == (path,)
    n = len(TEXT)
    assert corpus.val.numel() == -(-n * 5 // 100) and corpus.train.numel() + corpus.val.numel() == n
    assert bytes(corpus.val.tolist()) == TEXT.encode()[-corpus.val.numel():]
    assert len(load_corpus(path, max_bytes=100, seq_len=16)) == 100


def test_directory_sorted_skipping_binary_symlinks_and_unreadable(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("second " * 20)
    (tmp_path / "a.txt").write_text("first " * 20)
    (tmp_path / "c.txt").write_text("third " * 20)
    (tmp_path / "blob.bin").write_bytes(b"\x89PNG" + b"x" * 100 + b"\0" + b"y" * 100)
    (tmp_path / "late_nul.txt").write_bytes(b"z" * SNIFF_BYTES + b"\0")  # NUL past the sniff: text
    os.symlink(tmp_path / "a.txt", tmp_path / "link.txt")
    os.symlink(tmp_path / "b", tmp_path / "linkdir")
    locked = tmp_path / "d_locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    corpus = load_corpus(tmp_path, seq_len=8)
    names = [p.relative_to(tmp_path).as_posix() for p in corpus.files]
    can_read_anyway = os.access(locked, os.R_OK)  # root reads everything
    assert names == ["a.txt", "b/2.txt", "c.txt"] + (["d_locked.txt"] if can_read_anyway else []) \
        + ["late_nul.txt"]
    data = bytes(corpus.data.tolist())
    assert data.startswith(b"first " * 20 + b"second " * 20 + b"third " * 20)
    assert b"PNG" not in data


def test_max_bytes_stops_reading(tmp_path):
    for name in "abc":
        (tmp_path / f"{name}.txt").write_text(name * 100)
    corpus = load_corpus(tmp_path, max_bytes=150, seq_len=8)
    assert bytes(corpus.data.tolist()) == b"a" * 100 + b"b" * 50
    assert [p.name for p in corpus.files] == ["a.txt", "b.txt"]


def test_default_corpus_is_the_standard_library():
    corpus = load_corpus(None, max_bytes=1 << 20)
    assert len(corpus) == 1 << 20
    assert corpus.files and all(p.suffix == ".py" for p in corpus.files)
    assert all(stdlib_dir() in p.parents and "site-packages" not in p.parts for p in corpus.files)
    assert corpus.files == tuple(sorted(corpus.files, key=lambda p: p.parts))
    assert b"import" in bytes(corpus.data[:200_000].tolist())


# ------------------------------------------------------------------------------------ batches

def corpus_of(n: int = 5000, seq_len: int = 16) -> Corpus:
    return Corpus.from_bytes(bytes(i % 251 for i in range(n)), seq_len=seq_len)


def test_sample_batch_shapes_dtypes_and_shift():
    corpus = corpus_of()
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        x, y = corpus.sample_batch(split, 8, 16, g)
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(y[:, -1], (x[:, -1] + 1) % 251)  # the byte after, in this corpus
    # the same generator state gives the same batch; batches come from their split only
    a = corpus.sample_batch("train", 4, 16, torch.Generator().manual_seed(3))
    b = corpus.sample_batch("train", 4, 16, torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    split = Corpus.from_bytes(b"t" * 950 + b"v" * 50, seq_len=16)  # val: the last 5%
    assert split.val.numel() == 50
    assert torch.all(split.sample_batch("train", 64, 16, g)[1] == ord("t"))
    assert torch.all(split.sample_batch("val", 64, 16, g)[0] == ord("v"))
    with pytest.raises(ValueError, match='unknown split "test"'):
        corpus.sample_batch("test", 1, 16, g)
    with pytest.raises(ValueError, match="seq_len 5000 does not fit"):
        corpus.sample_batch("train", 1, 5000, g)


def test_val_batches_are_fixed():
    corpus = corpus_of(20_000)
    first = corpus.val_batches(4, 16, 3)
    torch.manual_seed(1)
    again = corpus.val_batches(4, 16, 3)
    assert len(first) == 3
    for (x, y), (x2, y2) in zip(first, again):
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x[:, 1:], y[:, :-1])
    starts = [int(x[0, 0]) for x, _ in first]
    assert len(set(starts)) == 3  # spread over the split, not the same window


def test_validation_split_is_at_least_one_window():
    corpus = Corpus.from_bytes(b"x" * 40, seq_len=16)
    assert corpus.val.numel() == 17 and corpus.train.numel() == 23
    assert len(Corpus.from_bytes(b"x" * 34, seq_len=16)) == 34  # the shortest allowed


# ------------------------------------------------------------------------------------- errors

def test_missing_path(tmp_path):
    with pytest.raises(DataError) as info:
        load_corpus(tmp_path / "nope")
    message = str(info.value)
    assert str(tmp_path / "nope") in message and "not found" in message and "data.path" in message
    assert isinstance(info.value, SwarmdError) and info.value.code == "data"


def test_empty_file_and_directory(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="no bytes to train on"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match=r"no text found under .*1 binary or unreadable"):
        load_corpus(tmp_path / "d")


def test_too_short(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 33)
    with pytest.raises(DataError) as info:
        load_corpus(path, seq_len=16)
    message = str(info.value)
    assert "33 bytes is too short for seq_len 16" in message and "at least 34 bytes" in message
    assert "model.seq_len" in message
    with pytest.raises(DataError, match="too short"):
        load_corpus(path.parent, max_bytes=20, seq_len=16)


def test_not_a_file_or_directory(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file or a directory"):
        load_corpus(fifo)


# ------------------------------------------------------------------------------ configuration

def test_data_and_training_keys(tmp_path):
    config = load_config(None, {}, {})
    assert config.data.path == "" and config.data.max_bytes == 32 << 20
    assert (config.training.batch_size, config.training.lr, config.training.seed) == (8, 3e-3, 0)
    path = tmp_path / "c.toml"
    path.write_text('[data]\npath = "corpus/"\nmax_bytes = 1000\n'
                    "[training]\nbatch_size = 4\nlr = 1\nseed = 42\n")
    config = load_config(path, {"SWARMD_TRAINING_LR": "0.5"}, {})
    assert config.data.path == "corpus/" and config.data.max_bytes == 1000
    assert (config.training.batch_size, config.training.lr, config.training.seed) == (4, 0.5, 42)
    with pytest.raises(ConfigError, match=r"data\.max_bytes = 0 is invalid"):
        load_config(None, {}, {"data.max_bytes": 0})
    with pytest.raises(ConfigError, match=r"training\.seed = \"-1\" is invalid"):
        load_config(None, {"SWARMD_TRAINING_SEED": "-1"}, {})
