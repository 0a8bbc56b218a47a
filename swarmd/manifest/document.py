"""The swarm manifest: what every peer of a swarm shares, as one content-addressed document.

A :class:`Manifest` holds the swarm's name, its model's name and number of stages, the model
(the built-in GPT's settings, a ``model.factory``'s settings, or a Hugging Face model's
``config.json`` content), the tokenizer (bytes, or a ``tokenizer.json`` named by its sha256 and
size), ``[training]``'s optimizer and schedule keys, ``averaging.target_batch_size``,
``wire.codec`` and, when not 0, ``model.boundary_rank``. Its bytes are canonical JSON (sorted
keys, no spaces, ASCII), at most ``MAX_MANIFEST_BYTES``; its :attr:`Manifest.hash` (32 hex
digits of their sha256) is announced by every peer, so peers of another manifest are kept out
of routing and a joiner can check what it was sent. Pure: bytes in, values out.

:func:`decode` checks, in order: size (``oversized``), JSON and structure (``malformed``:
unknown or missing keys, wrong types, nesting, bytes that are not the canonical form of what
they hold), then, when given, the hash it must have (``hash_mismatch``). Every failure is a
:class:`~swarmd.errors.BadManifest` naming its reason; the values themselves are checked as
configuration when a peer adopts them (``swarmd.manifest.local``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmd.errors import BadManifest

__all__ = ["Manifest", "TokenizerRef", "FORMAT", "KINDS", "MAX_MANIFEST_BYTES",
           "MAX_TOKENIZER_BYTES", "COMMON_KEYS", "OPTIONAL_KEYS", "SHAPE_KEYS", "IGNORED_CONFIG_KEYS", "keys_of",
           "model_config", "decode", "manifest_hash", "file_sha256", "canonical"]

FORMAT = "swarmd-manifest/1"
#: largest manifest (a model's config.json is a few kB)
MAX_MANIFEST_BYTES = 64 << 10
#: largest tokenizer.json a manifest may name (Llama 3's is 9 MB)
MAX_TOKENIZER_BYTES = 64 << 20
#: how a manifest describes its model: the built-in GPT, a model.factory, a Hugging Face model
KINDS = ("builtin", "factory", "hf")
HASH_CHARS = 32
MAX_DEPTH = 8

#: the configuration keys every manifest holds, and their types
COMMON_KEYS: Mapping[str, type] = {
    "swarm.name": str, "swarm.model": str, "swarm.stages": int,
    "model.seq_len": int, "model.dtype": str,
    "training.optimizer": str, "training.lr": float, "training.lr_schedule": str,
    "training.warmup_steps": int, "training.decay_steps": int, "training.grad_clip": float,
    "training.grad_clip_scope": str, "training.weight_decay": float,
    "training.batch_size": int, "training.microbatches": int, "training.schedule": str,
    "averaging.target_batch_size": int, "wire.codec": str,
}
#: settings a manifest holds only when they are not at their default (type, default): added
#: after swarms ran, so a swarm that leaves them alone keeps the manifest (and hash) it had
OPTIONAL_KEYS: Mapping[str, tuple[type, Any]] = {"model.boundary_rank": (int, 0)}
#: the [model] keys of the built-in GPT (and of a factory, which is called with them)
SHAPE_KEYS: Mapping[str, type] = {"model.width": int, "model.heads": int,
                                   "model.layers": int, "model.share_layers": int}
_KIND_KEYS: Mapping[str, Mapping[str, type]] = {
    "builtin": SHAPE_KEYS, "factory": {**SHAPE_KEYS, "model.factory": str}, "hf": {}}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_STR = 4096
#: config.json keys that change nothing in the computation (``swarmd.models.hf``'s): left out
#: of a manifest, so two copies of one model from two transformers versions agree
IGNORED_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
    "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict",
    "use_cache", "_attn_implementation_autoset", "task_specific_params",
})


def model_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What a manifest keeps of a config.json: every key that changes the computation."""
    return {k: v for k, v in raw.items()
            if k not in IGNORED_CONFIG_KEYS and not k.startswith("_")}


def keys_of(kind: str) -> dict[str, type]:
    """The settings a manifest of model ``kind`` holds, with their types."""
    return {**COMMON_KEYS, **_KIND_KEYS[kind]}


def canonical(value: Any) -> bytes:
    """The canonical JSON bytes of ``value`` (what is hashed)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def manifest_hash(data: bytes) -> str:
    """The hash of a manifest's bytes: what peers announce."""
    return hashlib.sha256(data).hexdigest()[:HASH_CHARS]


def file_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizerRef:
    """A ``tokenizer.json`` by its content: sha256 (64 hex digits) and size in bytes."""

    sha256: str
    size: int

    def __post_init__(self) -> None:
        if type(self.sha256) is not str or not _HEX64.fullmatch(self.sha256):
            raise ValueError("tokenizer sha256 must be 64 lowercase hex digits")
        if type(self.size) is not int or not 0 < self.size <= MAX_TOKENIZER_BYTES:
            raise ValueError(f"tokenizer size must be 1..{MAX_TOKENIZER_BYTES} bytes")

    def describe(self) -> str:
        return f"tokenizer.json sha256 {self.sha256[:16]} ({self.size} bytes)"


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """One swarm's shared settings. Validated when built (``ValueError`` otherwise)."""

    #: how the model is described: one of :data:`KINDS`
    kind: str
    #: configuration key -> value: exactly :func:`keys_of` ``(kind)``
    settings: Mapping[str, Any]
    #: the Hugging Face model's config.json content (kind "hf" only)
    hf_config: Mapping[str, Any] | None = None
    #: the tokenizer.json, or None: one token per byte
    tokenizer: TokenizerRef | None = None
    _bytes: bytes = field(default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"model kind must be one of {', '.join(KINDS)}")
        if not isinstance(self.settings, Mapping):
            raise ValueError("settings must be a map")
        required = keys_of(self.kind)
        optional = {k: kind for k, (kind, _) in OPTIONAL_KEYS.items() if k in self.settings}
        wanted = {**required, **optional}
        missing, extra = sorted(set(required) - set(self.settings)), \
            sorted(set(self.settings) - set(wanted))
        if missing or extra:
            raise ValueError(f"settings of a {self.kind} manifest: missing {missing[:5]}, "
                             f"unknown {[k[:60] for k in extra[:5]]}")
        for key in optional:
            if self.settings[key] == OPTIONAL_KEYS[key][1]:
                raise ValueError(f"{key} at its default is left out of a manifest")
        for key, kind in wanted.items():
            value = self.settings[key]
            ok = (type(value) is kind or kind is float and type(value) is int) \
                and not (kind is float and not math.isfinite(value)) \
                and not (kind is str and len(value) > _MAX_STR)
            if not ok:
                raise ValueError(f"{key} must be {kind.__name__}, not {type(value).__name__}")
        if (self.hf_config is None) != (self.kind != "hf"):
            raise ValueError("hf_config is given exactly for a manifest of kind hf")
        if self.hf_config is not None:
            if not isinstance(self.hf_config, Mapping) or not self.hf_config:
                raise ValueError("hf_config must be a non-empty JSON object")
            _check_json(self.hf_config, 0)
            if model_config(self.hf_config) != dict(self.hf_config):
                raise ValueError("hf_config holds keys that change nothing (transformers_version"
                                 ", architectures, ...): left out of a manifest")
        if self.tokenizer is not None and not isinstance(self.tokenizer, TokenizerRef):
            raise ValueError("tokenizer must be a TokenizerRef or None")
        object.__setattr__(self, "settings", {
            k: float(v) if wanted[k] is float else v for k, v in self.settings.items()})
        object.__setattr__(self, "_bytes", canonical(self._plain()))
        if len(self._bytes) > MAX_MANIFEST_BYTES:
            raise ValueError(f"a manifest of {len(self._bytes)} bytes is over the limit of "
                             f"{MAX_MANIFEST_BYTES}")

    def _plain(self) -> dict[str, Any]:
        return {"format": FORMAT, "kind": self.kind, "settings": dict(self.settings),
                "hf_config": None if self.hf_config is None else dict(self.hf_config),
                "tokenizer": None if self.tokenizer is None else
                {"sha256": self.tokenizer.sha256, "size": self.tokenizer.size}}

    def to_bytes(self) -> bytes:
        """The canonical JSON bytes (what travels and what is hashed)."""
        return self._bytes

    @property
    def hash(self) -> str:
        return manifest_hash(self._bytes)

    @property
    def swarm(self) -> str:
        return str(self.settings["swarm.name"])

    def model_text(self) -> str:
        """The model in a few words, for status, doctor and logs."""
        s = self.settings
        if self.kind == "hf":
            c = self.hf_config or {}
            return (f"{s['swarm.model']}: Hugging Face {c.get('model_type', '?')}, "
                    f"{c.get('num_hidden_layers', c.get('n_layer', '?'))} layers of width "
                    f"{c.get('hidden_size', c.get('n_embd', '?'))}, {s['model.dtype']}")
        what = "built-in GPT" if self.kind == "builtin" else s["model.factory"]
        return (f"{s['swarm.model']}: {what}, {s['model.layers']} layers of width "
                f"{s['model.width']}, {s['model.dtype']}")

    def flat(self) -> dict[str, Any]:
        """Everything a peer must share, one entry per comparable setting: the settings, the
        model's kind, each config.json key (``config.json <key>``), the tokenizer."""
        out: dict[str, Any] = {"model": _kind_text(self.kind, self.settings)}
        out.update(self.settings)
        for key, value in (self.hf_config or {}).items():
            out[f"config.json {key}"] = value
        out["tokenizer"] = self.tokenizer.describe() if self.tokenizer else "bytes"
        return out


def _kind_text(kind: str, settings: Mapping[str, Any]) -> str:
    if kind == "factory":
        return f"model.factory {settings.get('model.factory')}"
    return {"builtin": "the built-in GPT", "hf": "a Hugging Face model (model.hf)"}[kind]


def _check_json(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"hf_config is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, Mapping):
        for k, v in value.items():
            if type(k) is not str:
                raise ValueError("hf_config keys must be strings")
            _check_json(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_json(v, depth + 1)
    elif type(value) is float and not math.isfinite(value):
        raise ValueError("hf_config holds a number that is not finite")
    elif value is not None and type(value) not in (str, int, float, bool):
        raise ValueError(f"hf_config holds a {type(value).__name__}")


def decode(data: bytes, *, expect_hash: str | None = None,
           max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """The manifest in ``data``; :class:`BadManifest` (reason oversized, malformed or
    hash_mismatch) otherwise. ``expect_hash``: the hash the sender announced."""
    if type(data) is not bytes:
        raise BadManifest("malformed", "a manifest is bytes")
    if len(data) > max_bytes:
        raise BadManifest("oversized", f"{len(data)} bytes, over the limit of {max_bytes}")
    if expect_hash is not None and manifest_hash(data) != expect_hash:
        raise BadManifest("hash_mismatch", f"its hash is {manifest_hash(data)}, the sender "
                                           f"announced {str(expect_hash)[:HASH_CHARS]}")
    try:
        raw = json.loads(data.decode("ascii"), parse_constant=_no_constant)
        if type(raw) is not dict or raw.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        if set(raw) != {"format", "kind", "settings", "hf_config", "tokenizer"}:
            raise ValueError("unknown or missing top-level keys")
        tok = raw["tokenizer"]
        if tok is not None and (type(tok) is not dict or set(tok) != {"sha256", "size"}):
            raise ValueError("tokenizer must be null or {sha256, size}")
        manifest = Manifest(kind=raw["kind"], settings=raw["settings"],
                            hf_config=raw["hf_config"],
                            tokenizer=None if tok is None else TokenizerRef(**tok))
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        raise BadManifest("malformed", str(exc)[:200]) from None
    if manifest.to_bytes() != data:
        raise BadManifest("malformed", "not in canonical form (sorted keys, no spaces, "
                                       "floats as floats)")
    return manifest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
