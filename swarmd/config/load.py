"""Loading swarmd's configuration: defaults < ``--config`` file < environment < flags.

A :class:`Config` is settings only: the model it describes is built by
``swarmd.models.registry`` (``model_seam_of``, ``model_hash_of``, ...), its manifest by
``swarmd.manifest.local.swarm_manifest``.

Every problem raises :class:`swarmd.errors.ConfigError` with one line naming the source (the
file, ``environment variable SWARMD_...`` or ``command line flag``), the key, the bad value and
what is expected. The sections themselves are declared in :mod:`swarmd.config.sections`.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmd.config.fields import (FieldSpec, _Invalid, _Section, _convert, _invalid_message,
                                  _parse_text, _show, _toml_value)
from swarmd.config.sections import (ENV_PREFIX, RESERVED_ENV, DataConfig, HttpConfig, LogConfig,
                                    ModelSection, NetworkConfig, NodeConfig, SwarmConfig,
                                    TrainingConfig, WireConfig, _cross_checks)
from swarmd.config.limits import LimitsConfig
from swarmd.config.stage import (AveragingConfig, BalancingSection, CheckpointConfig,
                                 ServingSection, StateSection)
from swarmd.errors import ConfigError
from transport.limits import Limits


@dataclass(frozen=True)
class Config:
    """The whole configuration; each attribute is one TOML table."""

    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    state: StateSection = field(default_factory=StateSection)
    balancing: BalancingSection = field(default_factory=BalancingSection)
    serving: ServingSection = field(default_factory=ServingSection)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    log: LogConfig = field(default_factory=LogConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    node: NodeConfig = field(default_factory=NodeConfig)

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

    def target_batch_size(self) -> int:
        """Samples a stage accumulates over all its peers before it steps."""
        t = self.training
        return self.averaging.target_batch_size or t.batch_size * t.microbatches

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
                                 AveragingConfig, CheckpointConfig, StateSection,
                                 BalancingSection, ServingSection, NetworkConfig, WireConfig,
                                 HttpConfig, LogConfig, LimitsConfig, NodeConfig)
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


class _Layers:
    """The values being loaded, with the source each came from (for error messages)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {key: f.default for key, f in _SPECS.items()}
        self.sources: dict[str, str] = {key: "default" for key in _SPECS}

    def put(self, source: str, key: str, raw: Any, text: bool) -> None:
        f = _SPECS[key]
        try:
            self.values[key] = _parse_text(f, raw) if text else _convert(f, raw)
        except _Invalid as exc:
            raise ConfigError(_invalid_message(source, key, raw, f, exc)) from None
        self.sources[key] = source

    def blame(self, *keys: str) -> str:
        """Of keys that conflict, the one set by the strongest source."""
        return max(keys, key=lambda k: _source_rank(self.sources[k]))

    def file(self, path: Path) -> None:
        source = str(path)
        for section, table in _read_toml(path).items():
            if section not in _SECTIONS:
                raise ConfigError(_unknown_section(source, section, table))
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {section} = {_show(table)} is invalid; "
                                  f"expected a table [{section}]")
            for name, raw in table.items():
                key = f"{section}.{name}"
                if key not in _SPECS:
                    raise ConfigError(f'{source}: unknown key "{key}"'
                                      + _did_you_mean(_suggest_key(section, name)))
                self.put(source, key, raw, text=False)

    def environment(self, env: Mapping[str, str]) -> None:
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
            self.put(source, key, env[var], text=True)

    def flags(self, overrides: Mapping[str, Any]) -> None:
        source = "command line flag"
        for key, raw in overrides.items():
            if key not in _SPECS:
                section, _, name = key.partition(".")
                raise ConfigError(f'{source}: unknown key "{key}"'
                                  + _did_you_mean(_suggest_key(section, name)))
            if raw is None:
                continue
            self.put(source, key, raw,
                     text=isinstance(raw, str) and not isinstance(_SPECS[key].default, str))

    def build(self) -> Config:
        for key, message in _cross_checks(self.values.__getitem__, self.blame):
            raise ConfigError(f"{self.sources[key]}: {message}")
        sections = {}
        for section, cls in _SECTIONS.items():
            prefix = section + "."
            sections[section] = cls(**{k[len(prefix):]: v for k, v in self.values.items()
                                       if k.startswith(prefix)})
        return Config(**sections)


def _unknown_section(source: str, section: str, table: Any) -> str:
    if not isinstance(table, dict):
        suggestion = _suggest_key(None, section)
        return (f'{source}: unknown key "{section}" at the top level, keys '
                f'belong in a [section]{_did_you_mean(suggestion)}')
    close = difflib.get_close_matches(section, list(_SECTIONS), n=1)
    return (f"{source}: unknown section [{section}]"
            + _did_you_mean(close[0] if close else None, "[{}]")
            + "; known sections: " + ", ".join(f"[{s}]" for s in _SECTIONS))


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
    layers = _Layers()
    if path is not None:
        layers.file(path)
    layers.environment(env)
    layers.flags(overrides or {})
    return layers.build()


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
    """The documented default configuration (the contents of ``swarmd/config/default.toml``)."""
    return render_toml(Config())
