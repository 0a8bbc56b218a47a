"""The data pipeline a trainer reads (swarmd.data): the token cache built once and rebuilt when
its corpus or tokenizer changed, held-out documents never trained on, disjoint shards, the
position saved and resumed, batches made ahead; bad input stopped with one line."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from data_helpers import NumberTokenizer, ids, number_corpus, open_numbers, windows
from swarmd.data.pipeline import DataSettings, default_cache_dir, open_data
from swarmd.data.prefetch import Prefetcher, measure_rate
from swarmd.data.tokenfile import cache_path, read_header
from swarmd.data.corpus import find_corpus
from swarmd.errors import DataError
from swarmd.training.tokens import ByteTokenizer


# ---- the token cache -----------------------------------------------------------------------

def test_the_token_cache_is_built_once_then_reused(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c"), tmp_path / "cache"
    said: list[str] = []
    first = open_numbers(root, cache, said)
    assert len(said) == 2 and said[0].startswith("data: tokenizing ") and "once per corpus" in said[0]
    assert said[1].startswith("data: ") and " tokens of 400 documents" in said[1]
    [path] = cache.glob("*.tokens")
    header = read_header(path)
    assert header["dtype"] == "uint32" and header["docs"] == 400
    # every document, in file order, each followed by end-of-text
    tokens = np.memmap(path, dtype=np.uint32, mode="r", offset=header["tokens_at"],
                       shape=(header["tokens"],))
    assert int((tokens == 0).sum()) == 400 and sorted(tokens[tokens > 0].tolist()) == list(
        range(1, header["tokens"] - 400 + 1))
    stamp = path.stat().st_mtime_ns
    said.clear()
    again = open_numbers(root, cache, said)
    assert said == [] and path.stat().st_mtime_ns == stamp  # reused, nothing said
    assert [w for b in first.val for w in windows(b)] == [w for b in again.val for w in windows(b)]
    first.close(), again.close()
    assert not list(cache.glob(".*.tmp"))  # written atomically: no temporary left


def test_a_cache_of_another_corpus_or_tokenizer_is_rebuilt_saying_why(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c"), tmp_path / "cache"
    open_numbers(root, cache).close()
    part = root / "part1.jsonl"
    part.write_text(part.read_text() + json.dumps({"text": "999999"}) + "\n")
    said: list[str] = []
    open_numbers(root, cache, said).close()
    assert said[0].startswith("data: the token cache ") and "does not match" in said[0]
    assert "1 file(s) changed: part1.jsonl" in said[0] and said[0].endswith("rebuilding it")
    (root / "new.jsonl").write_text(json.dumps({"text": "888888"}) + "\n")
    said.clear()
    open_numbers(root, cache, said).close()
    assert "1 file(s) added: new.jsonl" in said[0]
    said.clear()  # the same tokenizer name, another identity (its tokenizer.json changed)
    settings = DataSettings(path=str(root), cache_dir=str(cache), batch=2, seq_len=8,
                            val_batches=4)
    open_data(settings, NumberTokenizer("numbers-v2"), say=said.append).close()
    assert "the tokenizer changed (numbers -> numbers-v2)" in said[0]
    [path] = cache.glob("*.tokens")
    with open(path, "r+b") as f:  # damaged: cut short
        f.truncate(path.stat().st_size // 2)
    said.clear()
    open_data(settings, NumberTokenizer("numbers-v2"), say=said.append).close()
    assert "it is unreadable" in said[0] and "rebuilding" in said[0]
    path.write_bytes(b"garbage")
    said.clear()
    data = open_data(settings, NumberTokenizer("numbers-v2"), say=said.append)
    assert "not a swarmd token file" in said[0]
    assert data.next()[0].shape == (2, 8)
    data.close()


def test_byte_corpora_are_cached_as_uint8_and_the_cache_dir_defaults_under_xdg(tmp_path) -> None:
    (tmp_path / "t.txt").write_text("hello world\n" * 2000)
    settings = DataSettings(path=str(tmp_path / "t.txt"), cache_dir=str(tmp_path / "cache"),
                            batch=2, seq_len=16, val_batches=2)
    data = open_data(settings, ByteTokenizer())
    assert data.windows.tokens.dtype == np.uint8  # type: ignore[attr-defined]
    x, y = data.next()
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    data.close()
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/swarmd/tokens")
    assert str(default_cache_dir({})).endswith(".cache/swarmd/tokens")


# ---- held out, shuffled, sharded -----------------------------------------------------------

def _val_ids(data) -> set[int]:  # type: ignore[no-untyped-def]
    """Every token of the held-out part (not only the validation batches' windows)."""
    w = data.windows
    return {t for t in w.tokens[w.val.locate(np.arange(w.val.total))].tolist() if t}


def test_two_trainers_over_1000_steps_never_train_on_the_same_window(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c", docs=200), tmp_path / "cache"
    trainers = [open_numbers(root, cache, shard=f"{i}/2") for i in range(2)]
    per_step = 4  # microbatches of 2 windows each
    seen = [[w for _ in range(1000 * per_step) for w in windows(t.next())] for t in trainers]
    epochs = [t.epoch for t in trainers]
    assert min(epochs) >= 2  # several passes over each shard
    a, b = (set(s) for s in seen)
    assert not a & b  # never the same window, in any epoch
    assert not {t for w in a for t in w if t} & {t for w in b for t in w if t}  # nor a token
    held = _val_ids(trainers[0])
    assert held and not held & {t for s in seen for w in s for t in w}  # never held out
    total = trainers[0].windows.train_windows
    assert len(a) + len(b) == total  # together they read every training window
    for t in trainers:
        t.close()


def test_held_out_documents_are_spread_over_the_corpus_and_never_trained_on(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c", docs=2000, words=20), tmp_path / "cache"
    data = open_numbers(root, cache, val_batches=8, batch=4)
    held = _val_ids(data)
    assert len(held) >= 8 * 4 * 9 - 100  # at least the validation batches' tokens
    assert {t for b in data.val for t in ids(b)} <= held
    # whole units: from several files, not the head of the stream
    firsts = sorted(held)
    assert firsts[0] > 100 and firsts[-1] - firsts[0] > 10_000
    trained: set[int] = set()
    for _ in range(3 * data.windows.train_windows // 4 + 1):  # three epochs
        trained |= ids(data.next())
    assert data.epoch >= 3 and not trained & held
    every = {t for t in data.windows.tokens.tolist() if t}
    assert trained | held <= every
    assert len(every - trained - held) < 9  # all else is trained on, but the last partial window
    data.close()


def test_the_order_is_shuffled_and_reproducible_from_the_seed(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c"), tmp_path / "cache"
    runs = []
    for seed in (0, 0, 1):
        data = open_numbers(root, cache, seed=seed)
        runs.append([w for _ in range(50) for w in windows(data.next())])
        data.close()
    assert runs[0] == runs[1] and runs[0] != runs[2]
    starts = [w[0] for w in runs[0] if w[0]]
    assert starts != sorted(starts)  # not in corpus order
    assert max(starts) - min(starts) > 5000  # from across the corpus, not its head


def test_auto_shard_is_the_place_among_the_trainers_in_view(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c"), tmp_path / "cache"
    data = open_numbers(root, cache)
    assert str(data.shard) == "0/1"
    assert str(data.place("peer-b", ["peer-c", "peer-a"])) == "1/3"
    assert "shard 1/3 reads" in data.describe()
    assert str(data.place("peer-b", [])) == "1/3"  # decided once
    fixed = open_numbers(root, cache, shard="1/2")
    assert str(fixed.place("peer-a", ["peer-b", "peer-c"])) == "1/2"  # data.shard wins
    data.close(), fixed.close()


# ---- the position: saved, restored --------------------------------------------------------

def test_a_restored_position_continues_with_exactly_the_next_batch(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c", docs=100), tmp_path / "cache"
    ongoing = open_numbers(root, cache, shard="1/3")
    for _ in range(237):
        ongoing.next()
    saved = json.loads(json.dumps(ongoing.state()))  # plain values
    assert saved["kind"] == "windows" and saved["shard"] == "1/3" and saved["epoch"] >= 1
    expected = [windows(ongoing.next()) for _ in range(20)]
    said: list[str] = []
    restarted = open_numbers(root, cache, said, shard="1/3")
    restarted.restore(saved)
    assert [windows(restarted.next()) for _ in range(20)] == expected and said == []
    auto = open_numbers(root, cache)  # data.shard = "auto" keeps the saved shard
    auto.restore(saved)
    assert str(auto.place("me", ["x", "y", "z"])) == "1/3"
    assert [windows(auto.next()) for _ in range(20)] == expected
    for d in (ongoing, restarted, auto):
        d.close()


def test_a_position_that_no_longer_fits_is_said_and_the_data_starts_over(tmp_path) -> None:
    root, cache = number_corpus(tmp_path / "c"), tmp_path / "cache"
    data = open_numbers(root, cache)
    for _ in range(30):
        data.next()
    saved = data.state()
    fresh = [windows(open_numbers(root, cache).next())]
    said: list[str] = []
    for change, expect in [({"seed": 5}, "training.seed, model.seq_len"),
                           ({"shard": "1/2"}, "data.shard is 1/2, the trainer state was saved "
                                              "reading shard 0/1")]:
        said.clear()
        other = open_numbers(root, cache, said, **change)
        other.restore(saved)
        assert len(said) == 1 and expect in said[0]
        other.close()
    said.clear()
    old = open_numbers(root, cache, said)
    old.restore({"kind": "stream", "position": {"file": 1}})
    assert "another kind ('stream'" in said[0] and [windows(old.next())] == fresh
    (root / "part0.jsonl").write_text(json.dumps({"text": "5 6 7"}) + "\n" +
                                      (root / "part0.jsonl").read_text())
    said.clear()
    changed = open_numbers(root, cache, said)
    changed.restore(saved)
    assert any(f"{root} changed since the trainer state was saved" in s and
               "restore the corpus as it was" in s for s in said)
    assert changed.state()["epoch"] == 0 and changed.state()["index"] == 0
    with pytest.raises(DataError, match="unreadable"):
        changed.restore({**changed.state(), "epoch": "x"})
    for d in (data, old, changed):
        d.close()


# ---- batches made ahead --------------------------------------------------------------------

def test_the_prefetcher_returns_the_producers_batches_in_order_off_the_callers_thread() -> None:
    threads: set[str] = set()

    def produce(cursor: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        threads.add(threading.current_thread().name)
        t = torch.full((1, 2), cursor)
        return (t, t), cursor + 1

    with Prefetcher(produce, 5, depth=3) as p:
        got = [int(p.next()[0][0, 0]) for _ in range(10)]
        assert got == list(range(5, 15)) and p.cursor == 15
        assert threads == {"swarmd-data"}
        # where a trainer that drew 3 batches of a step it has not taken resumes from
        assert p.cursor_back(0) == 15 and p.cursor_back(3) == 12 and p.cursor_back(10) == 5
        with pytest.raises(ValueError):
            p.cursor_back(11)
        p.seek(100)
        assert int(p.next()[0][0, 0]) == 100 and p.cursor == 101
        assert p.cursor_back(1) == 100
        with pytest.raises(ValueError):
            p.cursor_back(2)  # nothing before the seek
    rate = measure_rate(produce, 0, 20)
    assert rate.batches == 20 and rate.tokens == 40 and rate.batches_per_s > 0


def test_an_error_of_the_producer_is_raised_by_next() -> None:
    def produce(cursor: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        if cursor == 2:
            raise DataError("gone.txt: cannot read the data file")
        t = torch.zeros(1, 1)
        return (t, t), cursor + 1

    p = Prefetcher(produce, 0)
    p.next(), p.next()
    with pytest.raises(DataError, match="gone.txt"):
        p.next()
    p.close()


def test_measure_rate_leaves_the_position_alone(tmp_path) -> None:
    data = open_numbers(number_corpus(tmp_path / "c"), tmp_path / "cache")
    data.next()
    before = data.state()
    rate = data.measure_rate(50)
    assert rate.batches == 50 and rate.tokens == 50 * 2 * 8 and data.state() == before
    assert rate.to_json()["tokens_per_s"] > 0
    data.close()


# ---- bad input -----------------------------------------------------------------------------

def test_an_empty_corpus_stops_naming_it(tmp_path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "empty.txt").write_text("")
    (tmp_path / "c" / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match=r"c: no text to train on in 2 file\(s\)"):
        open_numbers(tmp_path / "c", tmp_path / "cache")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="d: no files in this directory"):
        open_numbers(tmp_path / "d", tmp_path / "cache")
    with pytest.raises(DataError, match="data path not found"):
        open_numbers(tmp_path / "absent", tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*")) or not list(
        (tmp_path / "cache").glob("*.tokens"))


def test_a_corpus_smaller_than_the_held_out_set_and_a_batch_stops(tmp_path) -> None:
    root = number_corpus(tmp_path / "c", docs=10, words=10)  # 190 tokens, end-of-text too
    with pytest.raises(DataError) as info:
        open_numbers(root, tmp_path / "cache", val_batches=10, batch=2)  # 180 + 18
    message = str(info.value)
    assert str(root) in message and "190 tokens are too few: the held-out set takes 180" in message
    assert "lower training.val_batches" in message
    data = open_numbers(root, tmp_path / "cache", val_batches=9, batch=2)  # 162 + 18 fit
    assert data.windows.train_windows >= 2
    data.close()


def test_bad_jsonl_and_parquet_stop_naming_the_file_and_leave_no_cache(tmp_path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "d.jsonl").write_text('{"text": "1 2"}\nnot json\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not a JSON line"):
        open_numbers(root, tmp_path / "cache")
    (root / "d.jsonl").write_text('{"text": "1 2"}\n{"body": "3"}\n')
    with pytest.raises(DataError, match=r'd.jsonl:2: no text field "text"'):
        open_numbers(root, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.tokens"))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (root / "d.jsonl").unlink()
    pq.write_table(pa.table({"content": ["1 2"]}), root / "p.parquet")
    with pytest.raises(DataError, match=r'p.parquet: no column "text"'):
        open_numbers(root, tmp_path / "cache")


def test_the_default_corpus_is_the_standard_library(tmp_path) -> None:
    corpus = find_corpus("")
    assert corpus.origin == "the Python standard library"
    assert corpus.files and all(f.suffix == ".py" and "site-packages" not in f.parts
                                for f in corpus.files)
    path = cache_path(tmp_path, corpus, ByteTokenizer())
    assert path.parent == tmp_path and path.suffix == ".tokens"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_cache_dir_says_what_to_do(tmp_path) -> None:
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o500)
    with pytest.raises(DataError, match="set data.cache_dir to a writable directory"):
        open_numbers(number_corpus(tmp_path / "c"), cache)


def test_a_saved_dataset_without_the_datasets_library_says_how_to_install_it(
        tmp_path, monkeypatch) -> None:
    import sys

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    (saved / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DataError, match=r"saved: reading it needs the Hugging Face datasets "
                                        r"library, which is not installed; install it with "
                                        r"`pip install swarmd\[datasets\]`"):
        open_numbers(saved, tmp_path / "cache")
