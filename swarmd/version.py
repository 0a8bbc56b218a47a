"""swarmd's version: the installed distribution's, else a development one."""

from __future__ import annotations


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarmd")
    except PackageNotFoundError:
        return "0.1.0.dev0"


__version__ = _version()
