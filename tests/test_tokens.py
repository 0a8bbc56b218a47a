"""Tokenizers: bytes, a BPE tokenizer trained by `swarmd tokenizer train`, and the checks that
stop a tokenizer that does not fit the model."""

from __future__ import annotations

import json

import pytest

from swarmd.cli import main
from swarmd.errors import DataError, ModelError
from swarmd.training.tokens import (EOT, ByteTokenizer, check_fits, load_tokenizer,
                                    train_bpe)

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def test_bytes_tokenizer() -> None:
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.eot) == (256, 0)
    assert tok.encode("hé") == [104, 0xC3, 0xA9] == tok.encode("hé".encode())


def test_train_bpe_learns_merges_and_round_trips(tmp_path) -> None:
    path = train_bpe([TEXT, "another document about foxes"], 300, tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))  # the directory works too
    assert tok.vocab_size == 300 and tok.eot == 0 and tok.name == str(path)
    ids = tok.encode("the quick brown fox")
    assert len(ids) < len("the quick brown fox")  # merges learned
    assert max(ids) < 300 and tok.eot not in ids
    assert tok._tok.decode(ids) == "the quick brown fox"
    assert tok.identity().startswith("bpe:")
    assert not list(tmp_path.joinpath("tok").glob("*.tmp"))  # written atomically


def test_tokenizer_train_command(tmp_path, capsys) -> None:
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"body": TEXT + str(i)}) + "\n" for i in range(20)))
    code = main(["tokenizer", "train", "--data", str(data), "--vocab", "280", "--out",
                 str(tmp_path / "out"), "--text-field", "body", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["vocab_size"] == 280 and result["records"] == 20 and result["eot"] == 0
    assert load_tokenizer(result["path"]).encode(EOT) == [0]
    code = main(["tokenizer", "train", "--data", str(data), "--vocab", "100", "--out",
                 str(tmp_path / "o2")])
    assert code == 2 and "--vocab 100 is too small" in capsys.readouterr().err


def test_tokenizer_whose_vocabulary_does_not_fit_the_model_is_refused(tmp_path) -> None:
    tok = load_tokenizer(str(train_bpe([TEXT, "another document about foxes"], 300, tmp_path)))
    assert tok.vocab_size == 300
    check_fits(tok, 300)
    with pytest.raises(ModelError, match=r"tokenizer.json: the tokenizer's vocabulary of 300 "
                                         r"tokens does not fit the model's 256; use a tokenizer "
                                         r"of at most 256 tokens"):
        check_fits(tok, 256)


def test_bad_tokenizer_files(tmp_path) -> None:
    with pytest.raises(DataError, match="no tokenizer here"):
        load_tokenizer(str(tmp_path / "absent.json"))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="tokenizer.json: not a tokenizer.json"):
        load_tokenizer(str(tmp_path))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match=r"t.json: no end-of-text token; expected one of "
                                        r"<\|endoftext\|>"):
        load_tokenizer(str(tmp_path / "t.json"))


def test_auto_is_the_model_directorys_tokenizer_json_else_bytes(tmp_path) -> None:
    from swarmd.training.tokens import tokenizer_spec

    assert tokenizer_spec("auto", "") == "bytes"
    assert tokenizer_spec("auto", str(tmp_path)) == "bytes"  # no tokenizer.json there
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_spec("auto", str(tmp_path)) == str(tmp_path / "tokenizer.json")
    assert tokenizer_spec("bytes", str(tmp_path)) == "bytes"
    assert tokenizer_spec("/x/tokenizer.json", str(tmp_path)) == "/x/tokenizer.json"


def test_encode_batch_is_encode_of_each(tmp_path) -> None:
    texts: list[str | bytes] = ["héllo", b"bytes too", ""]
    for tok in (load_tokenizer("bytes"), load_tokenizer(str(train_bpe([TEXT], 300, tmp_path)))):
        assert [list(map(int, ids)) for ids in tok.encode_batch(texts)] == [
            tok.encode(t) for t in texts]
