"""What a token cache was built from, and what changed since. Pure: the listing is passed in.

A :class:`Fingerprint` is the corpus's listing (each file's name, size and modification time,
``swarmd.data.corpus.listing``), the tokenizer's identity (``Tokenizer.identity()``: "bytes"
or a digest of its tokenizer.json) and the settings that change what is read (reader,
``data.text_field``, ``data.max_bytes``, the file format). Its :meth:`~Fingerprint.digest`
names a token file's content; :func:`changes` says in words what differs between two.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Fingerprint", "changes"]

#: file names listed in a change message at most
SHOWN = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    files: tuple[tuple[str, int, int], ...]
    tokenizer: str
    settings: tuple[tuple[str, str], ...]

    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(self.to_json(), sort_keys=True).encode(),
                               digest_size=16).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"files": [list(f) for f in self.files], "tokenizer": self.tokenizer,
                "settings": dict(self.settings)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Fingerprint:
        return cls(files=tuple((str(n), int(s), int(m)) for n, s, m in raw["files"]),
                   tokenizer=str(raw["tokenizer"]),
                   settings=tuple(sorted((str(k), str(v)) for k, v in raw["settings"].items())))


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def changes(old: Fingerprint, new: Fingerprint) -> str:
    """What differs from ``old`` to ``new``, in words ("" when nothing does)."""
    said = []
    if old.tokenizer != new.tokenizer:
        said.append(f"the tokenizer changed ({old.tokenizer} -> {new.tokenizer})")
    before, after = dict(old.settings), dict(new.settings)
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            said.append(f"{key} changed ({before.get(key)} -> {after.get(key)})")
    was = {name: (size, mtime) for name, size, mtime in old.files}
    now = {name: (size, mtime) for name, size, mtime in new.files}
    changed = [n for n in now if n in was and was[n] != now[n]]
    added = [n for n in now if n not in was]
    removed = [n for n in was if n not in now]
    for what, names in (("changed", changed), ("added", added), ("removed", removed)):
        if names:
            said.append(f"{len(names)} file(s) {what}: {_names(names)}")
    if not said and old != new:
        said.append("the files' order changed")
    return "; ".join(said)
