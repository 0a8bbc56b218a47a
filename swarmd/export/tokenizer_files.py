"""Which tokenizer an export ships: the one the swarm trained with (``data.tokenizer``).

``bytes`` (one token per byte) has no file: the manifest says ``bytes`` and ``swarmd sample``
encodes text as bytes. A ``tokenizer.json`` (``swarmd tokenizer train``'s, or a Hugging Face
model's) is copied as ``tokenizer.json``, with the other tokenizer files lying beside it
(``tokenizer_config.json``, ``special_tokens_map.json``, ...) so that ``AutoTokenizer`` loads
the directory. The model directory's own tokenizer files are shipped only when they are what
the swarm trained with: a swarm that trained on bytes does not map text to ids as they do.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TokenizerFiles", "tokenizer_files", "COMPANIONS"]

#: files that belong with a tokenizer.json in a Hugging Face model directory
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "chat_template.jinja")


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    #: what the manifest says: "bytes" or "tokenizer.json"
    spec: str
    #: (source file, name in the export)
    copies: tuple[tuple[Path, str], ...] = ()

    def copy_into(self, directory: Path) -> list[str]:
        for source, name in self.copies:
            shutil.copyfile(source, Path(directory) / name)
        return [name for _, name in self.copies]


def tokenizer_files(spec: str) -> TokenizerFiles:
    """The files of ``data.tokenizer = spec`` (checked by the swarm's own config load)."""
    if spec == "bytes":
        return TokenizerFiles("bytes")
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    copies = [(path, "tokenizer.json")]
    copies += [(path.parent / name, name) for name in COMPANIONS
               if (path.parent / name).is_file()]
    return TokenizerFiles("tokenizer.json", tuple(copies))
