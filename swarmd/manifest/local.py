"""A peer's manifest and its home: built from the configuration, kept, adopted.

Layout in the home::

    <home>/manifest.json              the swarm's manifest this peer last ran (canonical JSON)
    <home>/swarm-model/config.json    an adopted Hugging Face model's config.json (model.hf)
    <home>/swarm-model/tokenizer.json an adopted tokenizer (data.tokenizer)

Each file is written atomically (``swarmd.files.write_atomic``). Adopting a manifest gives a new
:class:`~swarmd.config.Config` whose settings are the swarm's and whose ``model.hf`` /
``data.tokenizer`` point at those files; it is checked to have exactly the swarm's manifest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from swarmd.config import Config
from swarmd.errors import BadManifest, ConfigError, InternalError, ModelError
from swarmd.files import write_atomic
from swarmd.manifest.document import (MAX_TOKENIZER_BYTES, SHAPE_KEYS, Manifest, TokenizerRef,
                                      decode, file_sha256, keys_of, model_config,
                                      OPTIONAL_KEYS)

__all__ = ["MANIFEST_FILE", "MODEL_DIR", "manifest_of", "swarm_manifest", "own_keys", "validate",
           "adopt",
           "keep", "kept", "kept_tokenizer"]

log = logging.getLogger("swarmd.manifest")

MANIFEST_FILE = "manifest.json"
MODEL_DIR = "swarm-model"


def _kind(config: Config) -> str:
    return "factory" if config.model.factory else "hf" if config.model.hf else "builtin"


def _tokenizer_path(config: Config) -> Path | None:
    from swarmd.training.tokens import tokenizer_spec

    spec = tokenizer_spec(config.data.tokenizer, config.model.hf)
    if spec == "bytes":
        return None
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def manifest_of(config: Config) -> tuple[Manifest, bytes | None]:
    """This configuration's manifest and its tokenizer.json's bytes (None: bytes). Reads
    config.json and the tokenizer: call it off the event loop. ``ModelError`` when a file
    named by the configuration cannot be read."""
    kind = _kind(config)
    settings = {key: config.get(key) for key in keys_of(kind)}
    settings.update({key: config.get(key) for key, (_, default) in OPTIONAL_KEYS.items()
                     if config.get(key) != default})
    hf_config = None
    if kind == "hf":
        path = Path(config.model.hf) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path}: cannot read the model config ({exc}); model.hf must be "
                             f"a directory holding a config.json") from None
        if not isinstance(raw, dict):
            raise ModelError(f"{path}: not a JSON object")
        hf_config = model_config(raw)
    tokenizer, data = None, None
    path = _tokenizer_path(config)
    if path is not None:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ModelError(f"{path}: cannot read the tokenizer ({exc.strerror})") from None
        if len(data) > MAX_TOKENIZER_BYTES:
            raise ModelError(f"{path}: {len(data)} bytes, over the {MAX_TOKENIZER_BYTES} a "
                             f"swarm manifest may name")
        tokenizer = TokenizerRef(sha256=file_sha256(data), size=len(data))
    try:
        return Manifest(kind=kind, settings=settings, hf_config=hf_config,
                        tokenizer=tokenizer), data
    except ValueError as exc:
        raise ModelError(f"this peer's model cannot be described in a swarm manifest: "
                         f"{exc}") from None


@functools.lru_cache(maxsize=8)
def swarm_manifest(config: Config) -> Manifest:
    """This configuration's swarm manifest (every setting the peers of a swarm share; its
    ``hash`` is announced), read once per configuration (frozen, so equal configs share it):
    config.json and the tokenizer are read at the first call (``ModelError`` when they cannot
    be read)."""
    return manifest_of(config)[0]


def own_keys(config: Config, manifest: Manifest) -> frozenset[str]:
    """The settings of ``manifest`` (keys of :meth:`Manifest.flat`) this peer's operator set:
    a value other than its default; the model when it is not the built-in GPT at its default
    shape; the tokenizer when ``data.tokenizer`` names one or the model directory has one."""
    default = Config()
    own = {key for key in manifest.settings if config.get(key) != default.get(key)}
    if manifest.kind != "builtin" or own & set(SHAPE_KEYS):
        own.add("model")
    if config.data.tokenizer != default.data.tokenizer or manifest.tokenizer is not None:
        own.add("tokenizer")
    return frozenset(own)


def _with(config: Config, values: Mapping[str, Any]) -> Config:
    """``config`` with some keys set (each section rebuilt: its values validated again)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(config, **{
        section: dataclasses.replace(getattr(config, section), **changes)
        for section, changes in sections.items()})


def validate(manifest: Manifest) -> None:
    """:class:`BadManifest` (``malformed``) when the manifest's settings are not a valid
    configuration (the sender's fault: its values are checked as any config.toml's)."""
    try:
        _with(Config(), manifest.settings)
    except ConfigError as exc:
        raise BadManifest("malformed", f"its settings are not a valid configuration: "
                                       f"{exc}") from None


def adopt(config: Config, swarm: Manifest, tokenizer: bytes | None, home: Path,
          adopted: tuple[str, ...]) -> Config:
    """``config`` with the swarm's settings, its model and tokenizer written into the home
    where they were ``adopted`` (``swarmd.manifest.settle``); the result's manifest is the
    swarm's (else ``InternalError``)."""
    values: dict[str, Any] = dict(swarm.settings)
    model_dir = Path(home) / MODEL_DIR
    if "model" in adopted or any(k.startswith("config.json ") for k in adopted):
        if swarm.kind == "hf":
            text = json.dumps(swarm.hf_config, indent=2, sort_keys=True) + "\n"
            write_atomic(model_dir / "config.json", lambda f: f.write(text.encode()),
                         mode=0o644)
            values.update({"model.hf": str(model_dir), "model.factory": ""})
        else:
            values["model.hf"] = ""
    if "tokenizer" in adopted:
        path = model_dir / "tokenizer.json"
        if swarm.tokenizer is None:
            path.unlink(missing_ok=True)
            values["data.tokenizer"] = "bytes"
        else:
            if tokenizer is None or file_sha256(tokenizer) != swarm.tokenizer.sha256:
                raise InternalError("adopting a tokenizer whose bytes were not checked")
            write_atomic(path, lambda f: f.write(tokenizer), mode=0o644)
            values["data.tokenizer"] = str(path)
    result = _with(config, values)
    mine, _ = manifest_of(result)
    if mine.hash != swarm.hash:
        raise InternalError(f"adopting manifest {swarm.hash} gave {mine.hash}")
    return result


def keep(home: Path, manifest: Manifest) -> None:
    """Write ``<home>/manifest.json`` (atomically) unless it holds this manifest already."""
    path = Path(home) / MANIFEST_FILE
    try:
        if path.read_bytes() == manifest.to_bytes():
            return
    except OSError:
        pass
    write_atomic(path, lambda f: f.write(manifest.to_bytes()), mode=0o644)


def kept(home: Path) -> Manifest | None:
    """The manifest the home keeps, None when there is none or it is unusable (logged)."""
    path = Path(home) / MANIFEST_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s: cannot read the kept manifest (%s): ignored", path, exc.strerror)
        return None
    try:
        manifest = decode(data)
        validate(manifest)
    except BadManifest as exc:
        log.warning("%s: the kept manifest is unusable (%s): ignored", path, exc)
        return None
    return manifest


def kept_tokenizer(home: Path, ref: TokenizerRef | None) -> bytes | None:
    """The home's adopted tokenizer.json when it is the one ``ref`` names, else None."""
    if ref is None:
        return None
    try:
        data = (Path(home) / MODEL_DIR / "tokenizer.json").read_bytes()
    except OSError:
        return None
    return data if len(data) == ref.size and file_sha256(data) == ref.sha256 else None
