"""swarmd: SWARM-parallel training as a daemon, over libp2p.

Importing this package is cheap: it pulls in neither libp2p nor torch.
"""

from __future__ import annotations


from swarmd.version import __version__

__all__ = ["__version__", "train"]


def train(bootstrap: object, **kwargs: object) -> object:
    """Train through a running swarm from Python: ``swarmd.train(bootstrap, model=DIR,
    data=PATH, steps=N, home=DIR, settings={"section.key": value})``; see
    :mod:`swarmd.trainer.api` (imported only when called)."""
    from swarmd.trainer.api import train as _train

    return _train(bootstrap, **kwargs)  # type: ignore[arg-type]
