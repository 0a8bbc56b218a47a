"""Typed configuration of swarmd, loaded and validated once.

Sources, highest precedence first: command-line flags, ``SWARMD_<SECTION>_<KEY>`` environment
variables, the ``--config`` TOML file, the defaults. ``sections`` declares every key (its doc,
valid values and validator: the documented default file ``default.toml`` is rendered from
them), ``load`` applies the sources, ``stage`` holds the stage-related sections and ``fields``
the declarations' vocabulary.
"""

from swarmd.config.load import Config, field_specs, load_config, render_default_toml, render_toml
from swarmd.config.sections import (CODECS, DTYPES, ENV_PREFIX, RESERVED_ENV, DataConfig,
                                    HttpConfig, LogConfig, ModelSection, NetworkConfig,
                                    NodeConfig,
                                    SwarmConfig, TrainingConfig, WireConfig)
from swarmd.config.fields import FieldSpec
from swarmd.config.limits import LimitsConfig
from swarmd.config.stage import AveragingConfig, CheckpointConfig
from swarmd.errors import ConfigError

__all__ = [
    "Config", "SwarmConfig", "ModelSection", "TrainingConfig", "DataConfig", "NetworkConfig",
    "WireConfig", "HttpConfig", "LogConfig", "AveragingConfig", "CheckpointConfig",
    "LimitsConfig", "NodeConfig", "FieldSpec", "ConfigError", "load_config", "render_toml",
    "render_default_toml",
    "field_specs", "ENV_PREFIX", "RESERVED_ENV", "CODECS", "DTYPES",
]
