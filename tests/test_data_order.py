"""The data's pure cores: the seeded window order, shards, the held-out choice, the cache's
fingerprint. No files, no threads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.data import heldout
from swarmd.data.fingerprint import Fingerprint, changes
from swarmd.data.order import (Cursor, Permutation, Shard, WindowOrder, auto_shard, mix_key,
                               parse_shard)
from swarmd.data.windows import Runs, split
from swarmd.errors import DataError


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 3000), key=st.integers(0, (1 << 64) - 1))
def test_a_permutation_is_a_bijection_of_its_range(size: int, key: int) -> None:
    p = Permutation(size, key)
    assert sorted(p(i) for i in range(size)) == list(range(size))


def test_permutations_are_reproducible_and_differ_by_key() -> None:
    a = [Permutation(1000, mix_key(7, 0))(i) for i in range(1000)]
    assert a == [Permutation(1000, mix_key(7, 0))(i) for i in range(1000)]
    b = [Permutation(1000, mix_key(7, 1))(i) for i in range(1000)]
    assert a != b and a != list(range(1000))
    # shuffled, not shifted: neighbours land far apart
    assert np.mean(np.abs(np.diff(a))) > 100
    with pytest.raises(IndexError):
        Permutation(5, 0)(5)


@settings(max_examples=60, deadline=None)
@given(windows=st.integers(1, 500), count=st.integers(1, 7), seed=st.integers(0, 99))
def test_shards_partition_the_windows_and_each_epoch_reads_its_shard_once(
        windows: int, count: int, seed: int) -> None:
    count = min(count, windows)
    seen: list[int] = []
    for index in range(count):
        order = WindowOrder(windows=windows, shard=Shard(index, count), seed=seed)
        got, after = order.take(Cursor(), order.per_epoch)
        assert sorted(got) == list(range(index, windows, count))  # all its own, once
        assert after == Cursor(epoch=1, index=0)
        seen += got
    assert sorted(seen) == list(range(windows))  # disjoint and covering


@settings(max_examples=40, deadline=None)
@given(windows=st.integers(2, 300), first=st.integers(0, 700), n=st.integers(1, 50))
def test_taking_from_a_saved_cursor_continues_exactly(windows: int, first: int, n: int) -> None:
    order = WindowOrder(windows=windows, shard=Shard(0, 1), seed=3)
    whole, _ = order.take(Cursor(), first + n)
    _, cursor = order.take(Cursor(), first) if first else ([], Cursor())
    rest, _ = order.take(Cursor(epoch=cursor.epoch, index=cursor.index), n)
    assert rest == whole[first:]


def test_epochs_differ_and_cross_over() -> None:
    order = WindowOrder(windows=50, shard=Shard(1, 2), seed=0)
    first, c = order.take(Cursor(), 25)
    second, c = order.take(c, 25)
    assert c == Cursor(epoch=2, index=0) and sorted(first) == sorted(second) and first != second


def test_shard_parsing_and_auto_placement() -> None:
    assert parse_shard("auto") is None and parse_shard("1/3") == Shard(1, 3)
    assert str(Shard(2, 5)) == "2/5"
    for bad in ("3/3", "x", "1/0", "-1/2", "1/", "/2"):
        with pytest.raises(ValueError, match="data.shard"):
            parse_shard(bad)
    with pytest.raises(DataError):
        Shard(2, 2)
    assert auto_shard("b", ["c", "a"]) == Shard(1, 3)
    assert auto_shard("a", []) == Shard(0, 1)
    assert auto_shard("a", ["a", "b"]) == Shard(0, 2)  # itself in view too
    with pytest.raises(DataError, match="cannot be shared among 4 trainers"):
        WindowOrder(windows=3, shard=Shard(3, 4), seed=0)
    with pytest.raises(DataError, match="position"):
        Cursor(epoch=-1)


# ---- held out ------------------------------------------------------------------------------

def test_the_array_hashes_are_the_scalar_ones() -> None:
    keys = np.array([heldout.doc_key(f"f{i}.txt", i) for i in range(50)], np.uint64)
    blocks = np.arange(50, dtype=np.int64) % 4
    assert heldout.unit_hashes(keys, blocks).tolist() == [
        heldout.unit_hash(int(k), int(b)) for k, b in zip(keys, blocks)]
    assert heldout.doc_key("a", 1) != heldout.doc_key("a", 2) != heldout.doc_key("b", 1)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=300),
       need=st.integers(0, 5000), seed=st.integers(0, 1000))
def test_held_out_takes_the_rate_then_the_lowest_hashes_until_it_has_enough(
        lengths: list[int], need: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 1 << 63, len(lengths), dtype=np.uint64) * np.uint64(2)
    lens = np.array(lengths, np.int64)
    mask = heldout.held_out(hashes, lens, need=need)
    by_rate = hashes < np.uint64((1 << 64) // heldout.RATE)
    assert (mask | ~by_rate).all()  # every unit the rate picks is held out
    held = int(lens[mask].sum())
    assert held >= min(need, int(lens.sum()))  # enough, when the corpus has it
    if mask.any() and not (mask == by_rate).all():  # topped up: by hash order, no more
        top = hashes[mask].max()
        assert (mask == (hashes <= top)).all()
        assert held - int(lens[hashes == top].sum()) < need


def test_units_cut_long_documents_and_split_keeps_parts_apart() -> None:
    starts = np.array([0, 10, 1000], np.int64)
    keys = np.array([1, 2, 3], np.uint64)
    s, n, h = heldout.units(starts, keys, 1030, 100)
    assert s.tolist() == [0] + list(range(10, 1000, 100)) + [1000]
    assert n.tolist() == [10] + [100] * 9 + [90] + [30]
    assert len(set(h.tolist())) == len(h)
    assert heldout.unit_size(10_000_000, 129) == heldout.UNIT_TOKENS
    assert heldout.unit_size(5000, 129) == 129
    train, val = split(starts, keys, 1030, window=9, need=200)
    assert val.total >= 200 and train.total + val.total == 1030
    positions_train = set(train.locate(np.arange(train.total)).tolist())
    positions_val = set(val.locate(np.arange(val.total)).tolist())
    assert not positions_train & positions_val and len(positions_train | positions_val) == 1030


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=40),
       chosen=st.lists(st.booleans(), min_size=40, max_size=40), length=st.integers(1, 20))
def test_runs_read_their_units_as_one_stream(lengths: list[int], chosen: list[bool],
                                             length: int) -> None:
    lens = np.array(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    mask = np.array(chosen[:len(lengths)])
    tokens = np.arange(int(lens.sum()), dtype=np.uint32)
    runs = Runs.of(starts, lens, mask)
    expected = np.concatenate([tokens[s:s + n] for s, n, m in zip(starts, lens, mask) if m]
                              or [np.zeros(0, np.uint32)])
    assert runs.total == len(expected)
    count = runs.total // length
    if count:
        got = runs.gather(tokens, np.arange(count) * length, length)
        assert got.reshape(-1).tolist() == expected[:count * length].tolist()


# ---- the cache's fingerprint ----------------------------------------------------------------

def test_changes_say_what_differs() -> None:
    base = Fingerprint(files=(("a.txt", 1, 1), ("b.txt", 2, 2)), tokenizer="bytes",
                       settings=(("data.text_field", "text"),))
    assert changes(base, base) == ""
    other = Fingerprint(files=(("a.txt", 1, 5), ("c.txt", 3, 3)), tokenizer="bpe:1",
                        settings=(("data.text_field", "body"),))
    said = changes(base, other)
    assert "the tokenizer changed (bytes -> bpe:1)" in said
    assert "data.text_field changed (text -> body)" in said
    assert "1 file(s) changed: a.txt" in said and "1 file(s) added: c.txt" in said
    assert "1 file(s) removed: b.txt" in said
    assert base.digest() != other.digest() and Fingerprint.from_json(base.to_json()) == base
