"""Errors of swarmd. Each carries a short machine-readable ``code`` and the process exit status
the CLI uses for it; the message is one line meant for the operator (what is wrong, where, and
what to do)."""

from __future__ import annotations


class SwarmdError(Exception):
    """Base of every error raised by ``swarmd`` (not ``transport``)."""

    #: short machine-readable code (JSON error replies, metrics labels)
    code = "swarmd_error"
    #: exit status of the CLI when this error ends a command: 1 other failure, 2 config/usage
    exit_status = 1


class ConfigError(SwarmdError):
    """The configuration (file, environment variable or flag) is invalid; names key and source."""

    code = "config"
    exit_status = 2


class HomeError(SwarmdError):
    """The home directory is missing, not initialised or unusable."""

    code = "home"
