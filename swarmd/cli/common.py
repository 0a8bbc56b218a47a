"""What every command shares: the command record, the home and config options, logging."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROG = "swarmd"


@dataclass(frozen=True)
class Command:
    name: str
    #: one line, shown in ``swarmd --help``
    help: str
    #: adds the command's own options to its subparser
    add_arguments: Callable[[argparse.ArgumentParser], None]
    #: does the work, returns a dataclass
    run: Callable[[argparse.Namespace], Any]
    #: renders the result for people
    text: Callable[[Any], str]
    description: str | None = None
    #: writes in ``log.format``: with ``"json"``, its result and errors are log records too
    log_format: bool = False


# ------------------------------------------------------------------------------ shared options

def add_home_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", metavar="DIR",
                        help="home directory (default: $SWARMD_HOME, else ~/.swarmd)")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", type=Path,
                        help="TOML config file (default: <home>/config.toml if present)")


def home_from_args(args: argparse.Namespace) -> Path:
    from swarmd.node.home import resolve_home

    return resolve_home(getattr(args, "home", None), os.environ)


def config_from_args(args: argparse.Namespace, overrides: dict[str, Any] | None = None):
    """The configuration: ``--config`` or ``<home>/config.toml``, environment, then ``overrides``."""
    from swarmd.config import load_config
    from swarmd.node.home import home_config_path

    path = getattr(args, "config", None)
    if path is None:
        path = home_config_path(home_from_args(args))
    return load_config(path, os.environ, overrides or {})


def asked_log_format(args: argparse.Namespace) -> str:
    """``log.format`` as the environment or the config file asks for it, read without
    validating anything else: how to print an error met before the configuration is loaded."""
    import tomllib

    value = os.environ.get("SWARMD_LOG_FORMAT")
    if value is not None:
        return value.strip().strip('"')
    try:
        path = getattr(args, "config", None)
        if path is None and hasattr(args, "home"):
            from swarmd.node.home import home_config_path

            path = home_config_path(home_from_args(args))
        if path is None:
            return "text"
        return str(tomllib.loads(Path(path).read_text()).get("log", {}).get("format", "text"))
    except Exception:  # an unreadable home or file: the plain line, as before
        return "text"


def configure_logging(level: str, log: Any = None) -> None:
    """Log at ``level``; with ``log`` (the ``[log]`` section) in its format and to its file
    too (``swarmd.node.logs``)."""
    import logging

    from swarmd.node import logs

    if log is None:
        logs.configure(level)
    else:
        logs.configure(level, format=log.format, file=log.file, max_bytes=log.max_bytes,
                       backups=log.backups)
    # the command's own output (json mode's banner, progress and result records) is shown
    # at any log.level, as the text it replaces is
    logging.getLogger("swarmd.cli").setLevel(min(logging.INFO, logging.getLevelName(level.upper())))


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
