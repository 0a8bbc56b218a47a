"""Training from Python (a script or a notebook) in a few lines::

    import swarmd

    result = swarmd.train("/ip4/127.0.0.1/tcp/4001/p2p/12D3Koo...", model="./my-llama",
                          data="./corpus.jsonl", steps=200, home="./trainer",
                          settings={"swarm.name": "my-swarm", "swarm.stages": 2})
    print(result.final_val_loss)

``model`` is a Hugging Face model directory (``model.hf``) or ``"package.module:callable"``
(``model.factory``); ``settings`` any ``"section.key"`` of the configuration (as ``swarmd
config`` lists them), over ``config`` (a TOML file) and ``SWARMD_*`` environment variables. It
runs where no event loop runs as well as inside one (Jupyter): then in a thread of its own.
:func:`train_async` is the coroutine, for code already in an event loop that can await it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["train", "train_async", "config_for"]


def config_for(*, model: str | Path | None = None, data: str | Path | None = None,
               config: str | Path | None = None,
               settings: Mapping[str, Any] | None = None) -> Any:
    """The :class:`swarmd.config.Config` of these arguments (``ConfigError`` naming a bad
    one)."""
    from swarmd.config import load_config
    from swarmd.models.registry import FACTORY_RE

    overrides = dict(settings or {})
    if model is not None:
        spec = str(model)
        key = "model.factory" if FACTORY_RE.fullmatch(spec) and not Path(spec).exists() else "model.hf"
        overrides[key] = spec
    if data is not None:
        overrides["data.path"] = str(data)
    return load_config(Path(config) if config is not None else None, os.environ, overrides)


async def train_async(bootstrap: str | Sequence[str], *, model: str | Path | None = None,
                      data: str | Path | None = None, steps: int = 100,
                      home: str | Path | None = None, config: str | Path | None = None,
                      settings: Mapping[str, Any] | None = None,
                      progress: Callable[[str], None] = print) -> Any:
    """Join the swarm at ``bootstrap`` as a trainer and train until step ``steps``; the
    :class:`~swarmd.trainer.run.TrainResult`. With ``home`` the trainer keeps its identity and
    state there and resumes it (``swarmd.state.trainer_state``)."""
    from swarmd.errors import ConfigError
    from swarmd.trainer.run import train as run_train

    addrs = [bootstrap] if isinstance(bootstrap, str) else list(bootstrap)
    if not addrs:
        raise ConfigError("swarmd.train needs a swarm to join: pass bootstrap="
                          '"/ip4/HOST/tcp/PORT/p2p/PEER_ID" (a running daemon\'s address)')
    if steps < 1:
        raise ConfigError(f"swarmd.train: steps = {steps}: must be at least 1")
    cfg = config_for(model=model, data=data, config=config, settings=settings)
    where = Path(home) if home is not None else None
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
    return await run_train(cfg, bootstrap=addrs, steps=steps, home=where, progress=progress,
                           bar=False)


def train(bootstrap: str | Sequence[str], **kwargs: Any) -> Any:
    """:func:`train_async` run to the end (see the module's doc); blocks until done."""
    import uvloop

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return uvloop.run(train_async(bootstrap, **kwargs))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="swarmd-train") as pool:
        return pool.submit(uvloop.run, train_async(bootstrap, **kwargs)).result()
