"""Tokens: bytes as they are, or a BPE tokenizer (the tokenizers library's tokenizer.json).

``data.tokenizer = "auto"`` (the default): the ``tokenizer.json`` of the ``model.hf``
directory when it has one, else bytes (:func:`tokenizer_spec`).
``data.tokenizer = "bytes"``: one token per byte (vocabulary 256), end-of-text the NUL byte,
which text files do not hold. A path: a ``tokenizer.json`` (or a directory holding one), whose
end-of-text token is the first of :data:`EOT_NAMES` it knows. :func:`train_bpe` trains one
locally (``swarmd tokenizer train --data PATH --vocab N --out DIR``), with ``<|endoftext|>``
as token 0.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from swarmd.errors import DataError, ModelError

__all__ = ["Tokenizer", "ByteTokenizer", "BPETokenizer", "load_tokenizer", "tokenizer_spec",
           "check_fits", "train_bpe", "EOT_NAMES", "EOT", "AUTO"]

log = logging.getLogger(__name__)

#: the end-of-text token of a trained tokenizer
EOT = "<|endoftext|>"
#: end-of-text tokens looked for in a tokenizer.json, in order
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
#: ``data.tokenizer``'s default: the model directory's tokenizer.json, else bytes
AUTO = "auto"
#: smallest vocabulary `train_bpe` accepts: the 256 byte-level symbols and end-of-text
MIN_VOCAB = 257


class Tokenizer:
    """Text to token ids. ``vocab_size`` ids from 0; ``eot`` ends every document."""

    name: str = ""
    vocab_size: int = 0
    eot: int = 0

    def encode(self, text: str | bytes) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str | bytes]) -> list[Sequence[int]]:
        """``encode`` of each text (a tokenizer may do them together, faster)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """Token ids back to text (``swarmd sample``); bytes that are not UTF-8 are replaced."""
        raise NotImplementedError

    def identity(self) -> str:
        """A digest of what maps text to ids: trainers of one swarm should agree on it."""
        return self.name


class ByteTokenizer(Tokenizer):
    """One token per byte; end-of-text is 0 (NUL)."""

    name, vocab_size, eot = "bytes", 256, 0

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)

    def encode_batch(self, texts: list[str | bytes]) -> list[Sequence[int]]:
        import numpy as np

        return [np.frombuffer(t.encode() if isinstance(t, str) else t, dtype=np.uint8)
                for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class BPETokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` read from a tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise DataError(f"{path}: not a tokenizer.json the tokenizers library reads "
                            f"({exc}); train one with `swarmd tokenizer train`") from None
        self.path = path
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        found = [(n, i) for n in EOT_NAMES if (i := self._tok.token_to_id(n)) is not None]
        if not found:
            raise DataError(f"{path}: no end-of-text token; expected one of "
                            f"{', '.join(EOT_NAMES)} in its vocabulary")
        self.eot = found[0][1]
        self._digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str | bytes]) -> list[Sequence[int]]:
        strings = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t
                   for t in texts]
        return [e.ids for e in self._tok.encode_batch(strings, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def identity(self) -> str:
        return f"bpe:{self._digest}"


def tokenizer_spec(data_tokenizer: str, model_hf: str) -> str:
    """What ``data.tokenizer`` names: ``"auto"`` is the tokenizer.json of the ``model.hf``
    directory when it has one, else ``"bytes"``; anything else is itself."""
    if data_tokenizer != AUTO:
        return data_tokenizer
    if model_hf and (Path(model_hf) / "tokenizer.json").is_file():
        return str(Path(model_hf) / "tokenizer.json")
    return "bytes"


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"``, or the path of a tokenizer.json or of a directory holding one."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f'{path}: no tokenizer here; set data.tokenizer to "bytes" or to a '
                        f"tokenizer.json (train one with `swarmd tokenizer train`)")
    return BPETokenizer(path)


def check_fits(tokenizer: Tokenizer, model_vocab: int, *, model: str = "the model") -> None:
    """:class:`ModelError` when the tokenizer makes ids the model's embedding has no row for."""
    if tokenizer.vocab_size > model_vocab:
        raise ModelError(f"{tokenizer.name}: the tokenizer's vocabulary of {tokenizer.vocab_size} "
                         f"tokens does not fit {model}'s {model_vocab}; use a tokenizer of at "
                         f"most {model_vocab} tokens, or a model whose vocab_size is at least "
                         f"{tokenizer.vocab_size}")


def train_bpe(texts: Iterable[str | bytes], vocab: int, out_dir: Path) -> Path:
    """Train a byte-level BPE tokenizer of ``vocab`` tokens on ``texts`` and write
    ``out_dir/tokenizer.json`` atomically; ``<|endoftext|>`` is token 0."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab < MIN_VOCAB:
        raise DataError(f"--vocab {vocab} is too small: a byte-level BPE tokenizer needs at "
                        f"least {MIN_VOCAB} tokens (256 bytes and end-of-text)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def strings() -> Iterator[str]:
        for text in texts:
            yield text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text

    tok.train_from_iterator(strings(), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "tokenizer.json"
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix="tokenizer.", suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    log.info("tokenizer of %d tokens written to %s", tok.get_vocab_size(), target)
    return target
