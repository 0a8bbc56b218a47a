"""Typed configuration of swarmd, loaded and validated once.

Sources, highest precedence first:

1. command line flags, passed to :func:`load_config` as ``overrides`` keyed ``"section.key"``;
2. environment variables ``SWARMD_<SECTION>_<KEY>`` (``SWARMD_NETWORK_LISTEN``); lists are
   comma-separated, booleans accept true/false/1/0/yes/no/on/off;
3. the TOML file given with ``--config``;
4. the defaults declared below.

Every key is declared once, as a field of a section dataclass whose ``metadata["spec"]`` holds
its one-line doc, what a valid value looks like and its validator. Validation, the error
messages and the documented default file (:func:`render_default_toml`, shipped as
``swarmd/default_config.toml``) all come from these declarations.

Every problem raises :class:`swarmd.errors.ConfigError` with one line naming the source (the
file, ``environment variable SWARMD_...`` or ``command line flag``), the key, the bad value and
what is expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from swarmd.config_fields import (  # the declarations' vocabulary
    FieldSpec, _Invalid, _Section, _convert, _device, _host_port, _int_range, _invalid_message, _is_loopback, _multiaddrs, _one_of, _opt, _parse_text,
    _positive, _positive_seconds, _power_of_two, _show, _swarm_name, _toml_value, split_host_port,
)
from swarmd.config_stage import (OPTIMIZERS, AveragingConfig, BalancingSection,
                                  CheckpointConfig, ServingSection)
from swarmd.errors import ConfigError
from transport.limits import Limits

if TYPE_CHECKING:
    from swarmd.model import ModelConfig

__all__ = [
    "Config", "SwarmConfig", "ModelSection", "TrainingConfig", "DataConfig", "NetworkConfig",
    "WireConfig", "HttpConfig", "LogConfig", "AveragingConfig", "CheckpointConfig",
    "FieldSpec", "ConfigError", "load_config", "render_toml", "render_default_toml",
    "field_specs", "ENV_PREFIX", "RESERVED_ENV", "CODECS", "DTYPES",
]

#: prefix of the environment variables that set configuration keys
ENV_PREFIX = "SWARMD_"
#: ``SWARMD_*`` variables that are not configuration keys; the loader ignores them
RESERVED_ENV = frozenset({"SWARMD_HOME"})
#: allowed values of ``wire.codec``
CODECS = tuple(f"{base}{suffix}" for base in ("none", "fp16", "int8") for suffix in ("", "+zstd"))
LOG_LEVELS = ("debug", "info", "warning", "error")
#: allowed values of ``model.dtype`` (the names of ``swarmd.model.DTYPES``, kept torch-free here)
DTYPES = ("float32", "bfloat16", "float16")

_LIMITS = Limits()


@dataclass(frozen=True)
class SwarmConfig(_Section):
    SECTION: ClassVar[str] = "swarm"
    DOC: ClassVar[str] = "The swarm this node belongs to."

    name: str = _opt(
        "swarmd-default",
        "Name of the swarm; peers only work with peers of the same name, keeping swarms apart.",
        'a name of 1 to 64 letters, digits, ".", "_" or "-", starting with a letter or digit',
        _swarm_name,
    )
    stages: int = _opt(
        2,
        "Number of pipeline stages the model is cut into; peers announcing another stage are "
        "kept out of routing.",
        "an integer from 1 to 4096",
        _int_range(1, 4096),
    )
    model: str = _opt(
        "swarmd-default",
        "Identifier of the model this swarm trains; peers announcing another are kept out of "
        "routing.",
        'a name of 1 to 64 letters, digits, ".", "_" or "-", starting with a letter or digit',
        _swarm_name,
    )


@dataclass(frozen=True)
class ModelSection(_Section):
    SECTION: ClassVar[str] = "model"
    DOC: ClassVar[str] = ("The model: a byte-level GPT; every peer of a swarm needs the same shape "
                          "(width, heads, layers, seq_len, share_layers).")

    width: int = _opt(
        128, "Width of the residual stream (embedding size); a multiple of model.heads.",
        "an integer from 1 to 65536", _int_range(1, 65536),
    )
    heads: int = _opt(
        4, "Attention heads per layer.", "an integer from 1 to 1024", _int_range(1, 1024),
    )
    layers: int = _opt(
        4, "Transformer layers, counting each application of a shared layer.",
        "an integer from 1 to 4096", _int_range(1, 4096),
    )
    seq_len: int = _opt(
        128, "Longest sequence (context) in bytes.", "an integer from 1 to 1048576",
        _int_range(1, 1 << 20),
    )
    share_layers: int = _opt(
        1, "Consecutive layers sharing one set of weights (1: none shared); divides model.layers.",
        "an integer from 1 to 4096", _int_range(1, 4096),
    )
    dtype: str = _opt(
        "float32", "Type of parameters and activations: float32, bfloat16 or float16.",
        "one of " + ", ".join(f'"{d}"' for d in DTYPES), _one_of(DTYPES),
    )
    device: str = _opt(
        "auto", "Where this node computes: auto (CUDA when available, else CPU), cpu, cuda or "
        "cuda:N.", '"auto", "cpu", "cuda" or "cuda:N"', _device,
    )
    threads: int = _opt(
        0, "torch CPU threads of this process (0: torch's default, one per core). Set it when "
        "several swarmd processes share one machine's cores, as `swarmd demo` does.",
        "an integer from 0 to 1024", _int_range(0, 1024),
    )


@dataclass(frozen=True)
class TrainingConfig(_Section):
    SECTION: ClassVar[str] = "training"
    DOC: ClassVar[str] = "How the trainer trains: microbatches, learning rate, seed."

    batch_size: int = _opt(
        8, "Sequences per microbatch, the unit that travels through the pipeline.",
        "an integer from 1 to 65536", _int_range(1, 65536),
    )
    microbatches: int = _opt(
        4, "Microbatches per optimizer step of a trainer.", "an integer from 1 to 65536",
        _int_range(1, 65536),
    )
    in_flight: int = _opt(
        0, "Microbatches a trainer keeps in the pipeline at once (0: training.microbatches).",
        "an integer from 0 to 4096", _int_range(0, 4096),
    )
    lr: float = _opt(
        3e-3, "Learning rate.", "a number greater than 0", _positive,
    )
    optimizer: str = _opt(
        "adamw", "Optimizer of every stage and trainer: adamw or lamb.",
        "one of " + ", ".join(f'"{o}"' for o in OPTIMIZERS), _one_of(OPTIMIZERS),
    )
    seed: int = _opt(
        0, "Seed of the initial weights (with the model hash) and of batch sampling.",
        "an integer from 0 to 2**63 - 1", _int_range(0, (1 << 63) - 1),
    )


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION: ClassVar[str] = "data"
    DOC: ClassVar[str] = "What the trainer trains on: bytes of text."

    path: str = _opt(
        "", "Text file or directory of text files (read in sorted order, binary files skipped); "
        "empty: the Python standard library's sources.",
        'a path, or "" for the standard library sources',
    )
    max_bytes: int = _opt(
        32 << 20, "Most bytes of the corpus read (32 MiB).", "a positive integer", _int_range(1),
    )


@dataclass(frozen=True)
class NetworkConfig(_Section):
    SECTION: ClassVar[str] = "network"
    DOC: ClassVar[str] = "Peer-to-peer networking (libp2p)."

    listen: tuple[str, ...] = _opt(
        ["/ip4/0.0.0.0/tcp/31337"],
        "Multiaddrs to accept peer connections on.",
        'a list of multiaddrs such as "/ip4/0.0.0.0/tcp/31337"',
        _multiaddrs(need_peer_id=False),
    )
    bootstrap: tuple[str, ...] = _opt(
        [],
        "Peers to join through, as multiaddrs ending in /p2p/<peer id>; empty starts a new swarm.",
        'a list of multiaddrs ending in /p2p/<peer id>, such as '
        '"/ip4/192.0.2.7/tcp/31337/p2p/12D3KooW..."',
        _multiaddrs(need_peer_id=True),
    )
    max_connections: int = _opt(
        1024, "Most peer connections open at once.", "an integer from 1 to 1000000",
        _int_range(1, 1_000_000),
    )
    handshake_timeout_s: float = _opt(
        5.0, "Seconds allowed for the security and multiplexer handshake of a new connection.",
        "a number of seconds greater than 0", _positive_seconds,
    )
    dial_timeout_s: float = _opt(
        10.0, "Seconds allowed to dial a peer before giving up.",
        "a number of seconds greater than 0", _positive_seconds,
    )
    request_timeout_s: float = _opt(
        30.0, "Seconds allowed for one request and its reply.",
        "a number of seconds greater than 0", _positive_seconds,
    )


@dataclass(frozen=True)
class WireConfig(_Section):
    SECTION: ClassVar[str] = "wire"
    DOC: ClassVar[str] = "How tensors travel between peers, and what a peer may send us."

    codec: str = _opt(
        "int8",
        "Tensor encoding: none, fp16 or int8 (blockwise), each optionally followed by +zstd.",
        "one of " + ", ".join(f'"{c}"' for c in CODECS),
        _one_of(CODECS),
    )
    int8_block_size: int = _opt(
        64, "Values per scale block of the int8 codec.",
        "a power of two from 16 to 65536", _power_of_two(16, 65536),
    )
    int8_scale_dtype: str = _opt(
        "float16", "Type of the per-block scales of the int8 codec.",
        '"float16" or "float32"', _one_of(("float16", "float32")),
    )
    zstd_level: int = _opt(
        1, "zstd level of the +zstd codecs: 1 is fastest, 22 smallest.",
        "an integer from 1 to 22", _int_range(1, 22),
    )
    max_header_bytes: int = _opt(
        _LIMITS.max_header_bytes, "Largest frame header accepted from a peer, in bytes (64 KiB).",
        "a positive integer", _int_range(1),
    )
    max_message_bytes: int = _opt(
        _LIMITS.max_message_bytes,
        "Largest message payload accepted from a peer, in bytes (256 MiB).",
        "a positive integer", _int_range(1),
    )
    max_tensor_bytes: int = _opt(
        _LIMITS.max_tensor_bytes,
        "Largest decoded tensor accepted from a peer, in bytes (1 GiB).",
        "a positive integer", _int_range(1),
    )
    chunk_bytes: int = _opt(
        _LIMITS.chunk_bytes, "Size of the pieces a payload is streamed in, in bytes (1 MiB).",
        "a positive integer", _int_range(1),
    )


@dataclass(frozen=True)
class HttpConfig(_Section):
    SECTION: ClassVar[str] = "http"
    DOC: ClassVar[str] = "The local HTTP API that `swarmd status` and the other commands talk to."

    listen: str = _opt(
        "127.0.0.1:8411", "Address (host:port) the HTTP API listens on; port 0 picks a free one.",
        'host:port with an IP address or localhost, such as "127.0.0.1:8411"', _host_port,
    )
    allow_non_loopback: bool = _opt(
        False,
        "Allow a non-loopback http.listen (the API has no authentication: keep it private).",
        "true or false",
    )


@dataclass(frozen=True)
class LogConfig(_Section):
    SECTION: ClassVar[str] = "log"
    DOC: ClassVar[str] = "Logging."

    level: str = _opt(
        "info", "Least severe level logged: debug, info, warning or error.",
        "one of " + ", ".join(f'"{v}"' for v in LOG_LEVELS), _one_of(LOG_LEVELS),
    )
    format: str = _opt(
        "text", "Log line format: text for people, json for machines (one object per line).",
        '"text" or "json"', _one_of(("text", "json")),
    )


def _cross_checks(get: Callable[[str], Any],
                  blame: Callable[..., str]) -> Iterator[tuple[str, str]]:
    """Checks spanning several keys: yields ``(key to blame, message)``.

    ``blame(*keys)`` picks, among keys that are only wrong together, the one set by the
    strongest source (a flag before an environment variable before the file before a default).
    """
    http_listen = get("http.listen")
    host, _ = split_host_port(http_listen)
    if not get("http.allow_non_loopback") and not _is_loopback(host):
        yield "http.listen", (
            f"http.listen = {_show(http_listen)} is not a loopback address and the HTTP API has "
            f"no authentication: listen on 127.0.0.1, or set http.allow_non_loopback = true "
            f"to expose it anyway"
        )
    width, heads = get("model.width"), get("model.heads")
    if width % heads:
        key = blame("model.heads", "model.width")
        yield key, (f"{key} = {get(key)} is invalid: model.width ({width}) must be a multiple of "
                    f"model.heads ({heads})")
    layers, share = get("model.layers"), get("model.share_layers")
    if layers % share:
        key = blame("model.share_layers", "model.layers")
        yield key, (f"{key} = {get(key)} is invalid: model.share_layers ({share}) must divide "
                    f"model.layers ({layers})")
    elif get("swarm.stages") > layers // share:
        key = blame("swarm.stages", "model.layers", "model.share_layers")
        groups = layers // share
        yield key, (f"{key} = {get(key)} is invalid: swarm.stages ({get('swarm.stages')}) is more "
                    f"than the {groups} group(s) of layers (model.layers {layers} / "
                    f"model.share_layers {share}) a stage boundary can fall between; use at most "
                    f"{groups} stage(s), or more layers")


@dataclass(frozen=True)
class Config:
    """The whole configuration; each attribute is one TOML table."""

    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    balancing: BalancingSection = field(default_factory=BalancingSection)
    serving: ServingSection = field(default_factory=ServingSection)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        for _key, message in _cross_checks(self.get, lambda *keys: keys[0]):
            raise ConfigError(f"Config(...): {message}")

    def get(self, key: str) -> Any:
        """The value of ``"section.key"``."""
        section, _, name = key.partition(".")
        if key not in _SPECS:
            raise KeyError(key)
        return getattr(getattr(self, section), name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (lists for tuples), e.g. for JSON output."""
        return {
            s: {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(getattr(self, s)).items()}
            for s in _SECTIONS
        }

    def model_config(self) -> ModelConfig:
        """The model's shape as a :class:`swarmd.model.ModelConfig` (imports torch)."""
        from swarmd.model import ModelConfig

        m = self.model
        return ModelConfig(width=m.width, heads=m.heads, layers=m.layers, seq_len=m.seq_len,
                           share_layers=m.share_layers)

    def torch_placement(self) -> tuple[Any, Any]:
        """``(device, dtype)`` from ``[model]``, checked against this machine; also applies
        ``model.threads``. Raises ``ConfigError`` saying what to change."""
        import torch

        from swarmd.model import resolve_device, resolve_dtype

        if self.model.threads:
            torch.set_num_threads(self.model.threads)
        try:
            return resolve_device(self.model.device), resolve_dtype(self.model.dtype)
        except ValueError as exc:
            raise ConfigError(f"model.device / model.dtype: {exc}") from None

    def target_batch_size(self) -> int:
        """Samples a stage accumulates over all its peers before it steps."""
        t = self.training
        return self.averaging.target_batch_size or t.batch_size * t.microbatches

    def model_hash(self) -> str:
        """What peers must agree on to train together: the swarm's model name and the hash of
        the model's architecture. Announced by every peer; a mismatch keeps a peer out."""
        return f"{self.swarm.model}:{self.model_config().model_hash()}"

    def wire_limits(self) -> Limits:
        """The receiver-side transport limits set by ``[wire]``."""
        w = self.wire
        return Limits(
            max_header_bytes=w.max_header_bytes,
            max_message_bytes=w.max_message_bytes,
            max_tensor_bytes=w.max_tensor_bytes,
            chunk_bytes=w.chunk_bytes,
        )


_SECTIONS: dict[str, type[_Section]] = {
    cls.SECTION: cls for cls in (SwarmConfig, ModelSection, TrainingConfig, DataConfig,
                                 AveragingConfig, CheckpointConfig, BalancingSection,
                                 ServingSection, NetworkConfig, WireConfig, HttpConfig, LogConfig)
}
_SPECS: dict[str, dataclasses.Field] = {
    f"{section}.{f.name}": f for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)  # type: ignore[arg-type]
}
assert list(_SECTIONS) == [f.name for f in dataclasses.fields(Config)]
assert not any("_" in s for s in _SECTIONS), "a section name with _ breaks SWARMD_<SECTION>_<KEY>"


def field_specs() -> dict[str, tuple[Any, FieldSpec]]:
    """``{"section.key": (default, spec)}`` for every key, in file order."""
    return {key: (f.default, f.metadata["spec"]) for key, f in _SPECS.items()}


def _suggest_key(section: str | None, name: str) -> str | None:
    """The closest known ``section.key`` to an unknown one, if any is close."""
    dotted = f"{section}.{name}" if section else name
    same_name = [k for k in _SPECS if k.rpartition(".")[2] == name]
    if same_name:
        return same_name[0]
    if section in _SECTIONS:
        keys = [f.name for f in dataclasses.fields(_SECTIONS[section])]  # type: ignore[arg-type]
        close = difflib.get_close_matches(name, keys, n=1)
        if close:
            return f"{section}.{close[0]}"
    close = difflib.get_close_matches(dotted, list(_SPECS), n=1)
    return close[0] if close else None


def _did_you_mean(suggestion: str | None, fmt: str = '"{}"') -> str:
    return f" (did you mean {fmt.format(suggestion)}?)" if suggestion else ""


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.replace(".", "_").upper()


# ------------------------------------------------------------------------------------ loading

def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a TOML config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text (at line {line})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _source_rank(source: str) -> int:
    """How strong a source is: flag 3, environment variable 2, file 1, default 0."""
    if source == "command line flag":
        return 3
    if source.startswith("environment variable "):
        return 2
    return 0 if source == "default" else 1


def load_config(
    path: Path | None,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration from defaults < ``path`` < ``env`` < ``overrides``.

    ``env`` is the process environment (pass ``os.environ``); only ``SWARMD_<SECTION>_<KEY>``
    names with a known upper-case section are read, and an unknown key in a known section is
    an error. ``overrides`` maps ``"section.key"`` to a typed value, or to a string parsed as
    an environment variable would be; ``None`` values (flags not given) are skipped.
    """
    values: dict[str, Any] = {key: f.default for key, f in _SPECS.items()}
    sources: dict[str, str] = {key: "default" for key in _SPECS}

    def put(source: str, key: str, raw: Any, text: bool) -> None:
        f = _SPECS[key]
        try:
            values[key] = _parse_text(f, raw) if text else _convert(f, raw)
        except _Invalid as exc:
            raise ConfigError(_invalid_message(source, key, raw, f, exc)) from None
        sources[key] = source

    if path is not None:
        source = str(path)
        for section, table in _read_toml(path).items():
            if section not in _SECTIONS:
                if not isinstance(table, dict):
                    suggestion = _suggest_key(None, section)
                    raise ConfigError(f'{source}: unknown key "{section}" at the top level, keys '
                                      f'belong in a [section]{_did_you_mean(suggestion)}')
                close = difflib.get_close_matches(section, list(_SECTIONS), n=1)
                raise ConfigError(f"{source}: unknown section [{section}]"
                                  + _did_you_mean(close[0] if close else None, "[{}]")
                                  + "; known sections: "
                                  + ", ".join(f"[{s}]" for s in _SECTIONS))
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {section} = {_show(table)} is invalid; "
                                  f"expected a table [{section}]")
            for name, raw in table.items():
                key = f"{section}.{name}"
                if key not in _SPECS:
                    raise ConfigError(f'{source}: unknown key "{key}"'
                                      + _did_you_mean(_suggest_key(section, name)))
                put(source, key, raw, text=False)

    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
            continue
        section_part, sep, name_part = var[len(ENV_PREFIX):].partition("_")
        section = section_part.lower()
        if not sep or section not in _SECTIONS or section_part != section.upper():
            continue  # not shaped like a configuration key
        key = f"{section}.{name_part.lower()}"
        source = f"environment variable {var}"
        if key not in _SPECS or name_part != name_part.upper():
            suggestion = _suggest_key(section, name_part.lower())
            raise ConfigError(f'{source}: unknown key "{key}"'
                              + _did_you_mean(suggestion and _env_name(suggestion), "{}"))
        put(source, key, env[var], text=True)

    for key, raw in (overrides or {}).items():
        source = "command line flag"
        if key not in _SPECS:
            section, _, name = key.partition(".")
            raise ConfigError(f'{source}: unknown key "{key}"'
                              + _did_you_mean(_suggest_key(section, name)))
        if raw is None:
            continue
        put(source, key, raw, text=isinstance(raw, str) and not isinstance(_SPECS[key].default, str))

    def blame(*keys: str) -> str:
        return max(keys, key=lambda k: _source_rank(sources[k]))

    for key, message in _cross_checks(values.__getitem__, blame):
        raise ConfigError(f"{sources[key]}: {message}")

    sections = {}
    for section, cls in _SECTIONS.items():
        prefix = section + "."
        sections[section] = cls(**{k[len(prefix):]: v for k, v in values.items()
                                   if k.startswith(prefix)})
    return Config(**sections)


# ---------------------------------------------------------------------------------- rendering

_HEADER = """\
# swarmd configuration.
#
# Every key is listed with its default value. A key can also be set by an environment variable
# SWARMD_<SECTION>_<KEY> (e.g. SWARMD_NETWORK_LISTEN, lists comma-separated) or by a command
# line flag. Precedence: flag > environment variable > this file > default.
"""


def render_toml(config: Config) -> str:
    """``config`` as a documented TOML file: every key with a one-line comment above it."""
    parts = [_HEADER]
    for section, cls in _SECTIONS.items():
        parts.append(f"\n# {cls.DOC}\n[{section}]\n")
        for index, f in enumerate(dataclasses.fields(cls)):  # type: ignore[arg-type]
            spec: FieldSpec = f.metadata["spec"]
            if index:
                parts.append("\n")
            value = config.get(f"{section}.{f.name}")
            parts.append(f"# {spec.doc}\n{f.name} = {_toml_value(value)}\n")
    return "".join(parts)


def render_default_toml() -> str:
    """The documented default configuration (the contents of ``swarmd/default_config.toml``)."""
    return render_toml(Config())
