"""``swarmd-export.json``: what an export directory holds and where each part came from.

Written last into every export (``swarmd export`` and a trainer's periodic export), read by
``swarmd sample``. One JSON object::

    {"format": 1, "kind": "hf" | "builtin", "swarm": ..., "model_hash": ..., "dtype": ...,
     "step": 12 | null, "tokenizer": "bytes" | "tokenizer.json",
     "parts": [{"part": "stage 0", "step": 12, "source": PEER, "verified": true,
                "bytes": ..., "trainer_step": null}, ...],
     "created": "2026-12-04T10:00:00Z"}

``tokenizer`` is what the swarm trained with: ``bytes`` (one token per byte) or the name of the
tokenizer.json in the directory.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from swarmd.errors import ModelError
from swarmd.export.collect import PartReport

__all__ = ["ExportManifest", "MANIFEST_NAME", "FORMAT", "KINDS"]

MANIFEST_NAME = "swarmd-export.json"
FORMAT = 1
KINDS = ("hf", "builtin")
MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportManifest:
    kind: str
    swarm: str
    model_hash: str
    dtype: str
    step: int | None
    tokenizer: str
    parts: tuple[PartReport, ...]
    created: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.tokenizer != "bytes" and (not self.tokenizer or "/" in self.tokenizer):
            raise ValueError(f"tokenizer must be 'bytes' or a file name, got {self.tokenizer!r}")
        if self.step is not None and (not isinstance(self.step, int) or self.step < 0):
            raise ValueError(f"step must be a non-negative integer or null, got {self.step!r}")

    def to_json(self) -> str:
        data = asdict(self)
        data["parts"] = [asdict(p) for p in self.parts]
        created = self.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return json.dumps({"format": FORMAT, **data, "created": created}, indent=2) + "\n"

    def write(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, directory: Path) -> ExportManifest:
        """The manifest of an export directory; :class:`ModelError` naming the file when it
        is missing or not one."""
        path = Path(directory) / MANIFEST_NAME
        try:
            if path.stat().st_size > MAX_BYTES:
                raise ValueError(f"over {MAX_BYTES} bytes")
            raw: Any = json.loads(path.read_text())
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise ValueError(f"not a format {FORMAT} export manifest")
            parts = tuple(PartReport(**p) for p in raw.get("parts", ()))
            return cls(kind=raw["kind"], swarm=str(raw["swarm"]),
                       model_hash=str(raw["model_hash"]), dtype=str(raw["dtype"]),
                       step=raw.get("step"), tokenizer=raw["tokenizer"], parts=parts,
                       created=str(raw.get("created", "")))
        except FileNotFoundError:
            raise ModelError(f"{directory}: not a swarmd export (no {MANIFEST_NAME}); export a "
                             f"model with `swarmd export --out DIR` first") from None
        except OSError as exc:
            raise ModelError(f"{path}: cannot read it ({exc.strerror})") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"{path}: not a valid export manifest ({exc}); export the model "
                             f"again") from None
