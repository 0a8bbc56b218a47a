"""swarmd: SWARM-parallel training as a daemon, over libp2p.

Importing this package is cheap: it pulls in neither libp2p nor torch.
"""

from __future__ import annotations


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarmd")
    except PackageNotFoundError:
        return "0.1.0.dev0"


__version__ = _version()
