"""Which model a node builds: ``model.factory``, ``model.hf`` or the built-in GPT.

* ``model.factory = "package.module:callable"``: ``callable(config)`` with the
  :class:`~swarmd.models.gpt.ModelConfig` of the ``[model]`` keys returns a
  :class:`~swarmd.models.seam.ModelSeam` (a user's own model);
* ``model.hf = DIR``: :class:`~swarmd.models.hf.HFCausalLM` of ``DIR/config.json``;
* neither: :class:`~swarmd.models.builtin.BuiltinGPT`;

each wrapped in :class:`~swarmd.models.boundary.LowRankBoundary` when ``model.boundary_rank``
is set.

The factory's name is part of the fingerprint peers compare, so two swarms running different
factories with equal settings are still told apart.

A configuration (:class:`~swarmd.config.Config`) is settings only; what is built from it is
here: :func:`model_config_of` (the built-in GPT's shape), :func:`torch_placement_of`,
:func:`model_seam_of`, :func:`model_fingerprint_of` and :func:`model_hash_of` (the last three
built once per configuration, then cached).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmd.errors import ConfigError, ModelError
from swarmd.models.seam import Fingerprint, ModelSeam
from swarmd.models.gpt import ModelConfig, resolve_device, resolve_dtype

if TYPE_CHECKING:
    from swarmd.config import Config
    from swarmd.training.tokens import Tokenizer

__all__ = ["resolve_factory", "make_seam", "seam_from_config", "fingerprint_from_config",
           "FACTORY_RE", "model_config_of", "torch_placement_of", "model_seam_of",
           "model_fingerprint_of", "model_hash_of"]

#: ``package.module:callable`` (the callable may be dotted: ``module:Class.method``)
FACTORY_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def resolve_factory(spec: str) -> Callable[[ModelConfig], ModelSeam]:
    """The callable ``spec`` names; :class:`ModelError` saying what is wrong otherwise."""
    if not FACTORY_RE.fullmatch(spec):
        raise ModelError(f'model.factory = "{spec}": expected "package.module:callable"')
    module_name, _, attr = spec.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f'model.factory = "{spec}": cannot import {module_name} ({exc}); '
                         f"install the package or put it on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ModelError(f'model.factory = "{spec}": {module_name} has no attribute {attr}')
        target = getattr(target, part)
    if not callable(target):
        raise ModelError(f'model.factory = "{spec}": {attr} is not callable')
    return target  # type: ignore[return-value]


def make_seam(config: ModelConfig, *, factory: str = "", hf: str = "") -> ModelSeam:
    """The model a node builds from its ``[model]`` keys (see the module's doc)."""
    if factory and hf:
        raise ModelError(f'model.factory = "{factory}" and model.hf = "{hf}" are both set; '
                         f"set one of them (or neither, for the built-in GPT)")
    if factory:
        build = resolve_factory(factory)
        try:
            seam = build(config)
        except ModelError:
            raise
        except Exception as exc:  # the user's code: one line saying what it raised
            raise ModelError(f'model.factory = "{factory}" failed: {type(exc).__name__}: '
                             f"{exc}") from None
        if not isinstance(seam, ModelSeam):
            raise ModelError(f'model.factory = "{factory}" returned {type(seam).__name__}, not a '
                             f"swarmd.models.seam.ModelSeam")
        seam.factory = factory
        return seam
    if hf:
        from swarmd.models.hf import HFCausalLM

        return HFCausalLM.from_dir(Path(hf))
    from swarmd.models.builtin import BuiltinGPT

    return BuiltinGPT(config)


def seam_from_config(config: Config) -> tuple[ModelSeam, Tokenizer]:
    """The model and the tokenizer a node of ``config`` uses: the built-in GPT's vocabulary is
    the tokenizer's; a Hugging Face or user's model must fit the tokenizer (ModelError)."""
    from swarmd.training.tokens import check_fits, load_tokenizer, tokenizer_spec

    tokenizer = load_tokenizer(tokenizer_spec(config.data.tokenizer, config.model.hf))
    shape = dataclasses.replace(model_config_of(config), vocab=tokenizer.vocab_size)
    seam = make_seam(shape, factory=config.model.factory, hf=config.model.hf)
    if config.model.boundary_rank:
        from swarmd.models.boundary import with_boundary

        try:
            seam = with_boundary(seam, config.model.boundary_rank)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
    check_fits(tokenizer, seam.vocab_size, model=config.model.hf or seam.factory)
    return seam, tokenizer


def fingerprint_from_config(config: Config, seam: ModelSeam) -> Fingerprint:
    """The fingerprint peers of ``config`` compare (model, dtype and optimizer)."""
    return seam.fingerprint(dtype=config.model.dtype, optimizer=config.training.optimizer)


def model_config_of(config: Config) -> ModelConfig:
    """The model's shape from ``[model]`` as a :class:`swarmd.models.gpt.ModelConfig`."""
    m = config.model
    return ModelConfig(width=m.width, heads=m.heads, layers=m.layers, seq_len=m.seq_len,
                       share_layers=m.share_layers)


def torch_placement_of(config: Config) -> tuple[Any, Any]:
    """``(device, dtype)`` from ``[model]``, checked against this machine; also applies
    ``limits.cpu_threads`` (else ``model.threads``). Raises ``ConfigError`` saying what to
    change."""
    import torch

    threads = config.limits.threads or config.model.threads
    if threads:
        torch.set_num_threads(threads)
    try:
        return resolve_device(config.model.device), resolve_dtype(config.model.dtype)
    except ValueError as exc:
        raise ConfigError(f"model.device / model.dtype: {exc}") from None


def model_seam_of(config: Config) -> tuple[ModelSeam, Tokenizer]:
    """``(seam, tokenizer)`` of ``config``'s model (built once, then cached)."""
    seam, tokenizer, _ = _model_of(config)
    return seam, tokenizer


def model_fingerprint_of(config: Config) -> Fingerprint:
    """The :class:`~swarmd.models.seam.Fingerprint` of ``config``'s model."""
    return _model_of(config)[2]


def model_hash_of(config: Config) -> str:
    """What peers must agree on to train together: the swarm's model name and the hash of
    the model's fingerprint (architecture, every setting that changes the computation,
    dtype and optimizer; :func:`fingerprint_from_config`). Announced by every peer; a mismatch
    keeps a peer out. Builds the model's seam once per configuration (imports torch; raises
    ``ModelError`` for a model that cannot be built)."""
    return f"{config.swarm.model}:{model_fingerprint_of(config).hash}"


@functools.lru_cache(maxsize=8)
def _model_of(config: Config) -> tuple[ModelSeam, Tokenizer, Fingerprint]:
    """(seam, tokenizer, fingerprint) of ``config`` (frozen, so equal configs share them)."""
    seam, tokenizer = seam_from_config(config)
    return seam, tokenizer, fingerprint_from_config(config, seam)
