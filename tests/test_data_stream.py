"""Streamed data: text trees, JSONL and Parquet documents, packed with end-of-text, sharded
between trainers, resumable from a saved position; bad files stop with a message naming them."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.errors import DataError
from swarmd.data import records as stream  # PIECE_BYTES lives with the readers
from swarmd.training.stream import (DataPosition, TokenStream, load_position, read_records,
                                    save_position)
from swarmd.training.tokens import ByteTokenizer

DOCS = [f"document {i}: " + "abc xyz\n" * (i % 7 + 1) for i in range(30)]


def make_corpus(root):  # type: ignore[no-untyped-def]
    """Three kinds of files: a text tree, a JSONL file, a Parquet file (when pyarrow is here)."""
    (root / "a").mkdir(parents=True)
    for i in range(4):
        (root / "a" / f"t{i}.txt").write_text(DOCS[i])
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d, "n": 1}) + "\n"
                                          for d in DOCS[4:20]))
    docs = DOCS[:20]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return docs
    pq.write_table(pa.table({"text": DOCS[20:], "id": list(range(10))}), root / "c.parquet",
                   row_group_size=3)
    return DOCS


def joined(docs: list[str]) -> list[int]:
    return [t for d in docs for t in list(d.encode()) + [0]]


def take(s: TokenStream, n: int) -> list[torch.Tensor]:
    return list(itertools.islice(s.sequences(), n))


def test_documents_are_packed_with_end_of_text_in_file_order(tmp_path) -> None:
    docs = make_corpus(tmp_path)
    s = TokenStream(tmp_path, ByteTokenizer(), seq_len=15)
    total = len(joined(docs)) // 16
    seqs = take(s, total)
    assert all(q.shape == (16,) and q.dtype == torch.long for q in seqs)
    assert torch.cat(seqs).tolist() == joined(docs)[: total * 16]
    x, y = next(TokenStream(tmp_path, ByteTokenizer(), seq_len=15).batches(4))
    assert x.shape == y.shape == (4, 15) and torch.equal(x[:, 1:], y[:, :-1])


def test_the_stream_goes_round_again_with_the_next_epoch(tmp_path) -> None:
    (tmp_path / "one.txt").write_text("hello world\n")
    s = TokenStream(tmp_path, ByteTokenizer(), seq_len=6)
    seqs = take(s, 5)
    assert torch.cat(seqs).tolist() == (joined(["hello world\n"]) * 3)[:35]
    assert s.position.epoch == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.integers(1, 40), first=st.integers(0, 30), shards=st.integers(1, 3),
       piece=st.sampled_from([7, 64, 1 << 20]))
def test_a_restarted_stream_continues_with_exactly_the_next_sequence(
        tmp_path_factory, monkeypatch, seq_len, first, shards, piece) -> None:
    root, saves = tmp_path_factory.mktemp("corpus"), tmp_path_factory.mktemp("saves")
    make_corpus(root)
    monkeypatch.setattr(stream, "PIECE_BYTES", piece)  # text files in many pieces
    for shard in range(shards):
        ongoing = TokenStream(root, ByteTokenizer(), seq_len=seq_len, shard=shard,
                              num_shards=shards)
        gen = ongoing.sequences()
        for _ in range(first):
            next(gen)
        saved = saves / f"pos{shard}.json"
        save_position(saved, ongoing.position)
        expected = [next(gen) for _ in range(5)]
        restarted = TokenStream(root, ByteTokenizer(), seq_len=seq_len, shard=shard,
                                num_shards=shards, position=load_position(saved))
        got = take(restarted, 5)
        assert [q.tolist() for q in got] == [q.tolist() for q in expected]


def test_trainers_draw_different_documents_covering_the_corpus(tmp_path) -> None:
    docs = make_corpus(tmp_path)
    seen = []
    for shard in range(3):
        s = TokenStream(tmp_path, ByteTokenizer(), seq_len=7, shard=shard, num_shards=3)
        text = bytes(torch.cat(take(s, 60)).tolist())
        seen.append({d for d in docs if d.encode() in text})
    assert all(seen) and not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])
    assert set().union(*seen) == set(docs)


def test_text_files_are_read_in_bounded_pieces(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(stream, "PIECE_BYTES", 100)
    big = "".join(f"line {i}\n" for i in range(2000))
    (tmp_path / "big.txt").write_text(big)
    records = list(read_records(tmp_path / "big.txt"))
    assert len(records) > 100 and max(len(r.text) for r in records) <= 200
    assert b"".join(r.text for r in records) == big.encode()  # type: ignore[misc]
    assert [r.ends_doc for r in records] == [False] * (len(records) - 1) + [True]


def test_position_round_trips_and_bad_positions_are_data_errors(tmp_path) -> None:
    pos = DataPosition(epoch=1, file=2, record=3, token=4)
    assert DataPosition.from_dict(pos.to_dict() | {"future_key": 1}) == pos
    assert load_position(tmp_path / "none.json") == DataPosition()
    with pytest.raises(DataError, match="token = -1"):
        DataPosition.from_dict({"token": -1})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DataError, match="bad.json: unreadable data position"):
        load_position(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- bad input

def test_jsonl_line_without_the_text_field_names_file_line_and_field(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    with pytest.raises(DataError, match=r'd.jsonl:2: no text field "text" \(found \[\'body\'\]\); '
                                        r"set data.text_field"):
        take(TokenStream(path, ByteTokenizer(), seq_len=4), 3)
    path.write_text("not json\n")
    with pytest.raises(DataError, match="d.jsonl:1: not a JSON line"):
        take(TokenStream(path, ByteTokenizer(), seq_len=4), 1)


def test_parquet_file_without_the_column_names_file_and_columns(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet: no column \"text\" \(columns: "
                                        r"\['content'\]\); set data.text_field"):
        take(TokenStream(tmp_path, ByteTokenizer(), seq_len=4), 1)
    (tmp_path / "d.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="d.parquet: not a readable Parquet file"):
        take(TokenStream(tmp_path, ByteTokenizer(), seq_len=4), 1)


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    (tmp_path / "d.parquet").write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails
    with pytest.raises(DataError, match=r"d.parquet: reading Parquet needs pyarrow, which is not "
                                        r"installed; install it with `pip install swarmd\[data\]`"):
        take(TokenStream(tmp_path, ByteTokenizer(), seq_len=4), 1)


def test_a_shard_without_documents_is_refused(tmp_path) -> None:
    (tmp_path / "only.txt").write_text("one document\n")
    with pytest.raises(DataError, match="no text for trainer shard 1 of 2 in 1 file"):
        take(TokenStream(tmp_path, ByteTokenizer(), seq_len=4, shard=1, num_shards=2), 1)
    with pytest.raises(DataError, match="data path not found"):
        TokenStream(tmp_path / "absent", ByteTokenizer(), seq_len=4)


# ------------------------------------------------- the streamed fallback (data.mode = stream)

def _streamed(root, **settings):  # type: ignore[no-untyped-def]
    from data_helpers import open_numbers

    defaults = {"mode": "stream", "shuffle_buffer": 7, "val_batches": 2, "batch": 2,
                "seq_len": 8}
    return open_numbers(root, root.parent / "cache", **{**defaults, **settings})


@pytest.fixture(scope="module")
def numbers(tmp_path_factory):  # type: ignore[no-untyped-def]
    from data_helpers import number_corpus

    return number_corpus(tmp_path_factory.mktemp("numbers") / "c", docs=1500, words=8)


def test_streamed_data_holds_out_documents_and_shards_by_document(numbers) -> None:
    from data_helpers import ids

    trainers = [_streamed(numbers, shard=f"{i}/2") for i in range(2)]
    held = {t for b in trainers[0].val for t in ids(b)}
    assert held and held == {t for b in trainers[1].val for t in ids(b)}
    seen = [set().union(*(ids(t.next()) for _ in range(700))) for t in trainers]
    assert min(t.epoch for t in trainers) >= 1  # past a whole pass
    assert not seen[0] & seen[1]  # different documents
    assert not (seen[0] | seen[1]) & held  # never a held-out one
    assert not list((numbers.parent / "cache").glob("*.tokens"))  # nothing cached
    for t in trainers:
        t.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.integers(0, 40))
def test_streamed_data_resumes_with_exactly_the_next_batch(numbers, first: int) -> None:
    from data_helpers import windows

    ongoing = _streamed(numbers, seed=3)
    for _ in range(first):
        ongoing.next()
    saved = json.loads(json.dumps(ongoing.state()))
    assert saved["kind"] == "stream-blocks"
    expected = [windows(ongoing.next()) for _ in range(6)]
    restarted = _streamed(numbers, seed=3)
    restarted.restore(saved)
    assert [windows(restarted.next()) for _ in range(6)] == expected
    ongoing.close(), restarted.close()


def test_streamed_data_is_shuffled_and_too_few_held_out_documents_stop(numbers, tmp_path) -> None:
    from data_helpers import number_corpus, windows

    data = _streamed(numbers)
    starts = [w[0] for _ in range(30) for w in windows(data.next()) if w[0]]
    assert starts != sorted(starts)
    data.close()
    small = number_corpus(tmp_path / "small", docs=50, words=8)
    with pytest.raises(DataError, match=r'one document in 200 is held out, and those hold \d+ '
                                        r'of the 100 windows.*data.mode = "cached"'):
        _streamed(small, val_batches=50)
