"""A downloaded part (a stage, or the trainers' embedding and head) as named weights.

The weights of a part arrive as its module's ``state_dict`` (``StageState.params``). Loaded
into the module the model's seam builds for that part (same class, same dtype as the swarm
trains in), they are checked to fit (every name, shape and dtype: else the peer sent another
model's weights) and their round digest (``swarmd.state.round_digest``) is computed as their
peers compute it. Then each tensor is given its name in a whole model's checkpoint:

* a Hugging Face model (``swarmd.models.hf``): the ``save_pretrained`` names, by the seam's own
  ``checkpoint_names`` (a stage's ``layers.<i>.*`` is ``model.layers.<i>.*``, the trainer's
  ``embed_tokens.*`` is ``model.embed_tokens.*``, ...); a tied ``lm_head.weight`` is left out,
  as ``save_pretrained`` leaves it out;
* the built-in GPT (``swarmd.models.builtin``): ``embedding.*``, ``head.*``,
  ``blocks.<group>.*``, the names ``BuiltinGPT`` reads pretrained weights by.

CPU work (seconds for a big stage): call it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from swarmd.errors import InternalError, ModelError, SwarmdError
from swarmd.models.seam import ModelSeam
from swarmd.state.round_digest import round_digest_of

__all__ = ["NamedPart", "PartMismatch", "stage_part", "trainer_part", "export_kind"]


class PartMismatch(SwarmdError):
    """Weights that do not fit the part they were sent for (names, shapes or dtypes): the
    peer that sent them is at fault."""

    code = "part_mismatch"


@dataclass(frozen=True, slots=True, kw_only=True)
class NamedPart:
    """One part's weights by checkpoint name, and their round digest as the part's peers
    compute it."""

    tensors: Mapping[str, torch.Tensor]
    digest: str


def export_kind(seam: ModelSeam) -> str:
    """``"hf"`` or ``"builtin"``; :class:`ModelError` for a model export cannot name."""
    from swarmd.models.boundary import LowRankBoundary
    from swarmd.models.builtin import BuiltinGPT
    from swarmd.models.hf import HFCausalLM

    if isinstance(seam, LowRankBoundary):
        raise ModelError(f"swarmd export writes plain transformers and built-in models; this "
                         f"swarm trains with model.boundary_rank = {seam.rank} (a learned "
                         f"projection to {seam.rank} values at every stage boundary), which "
                         f"neither architecture has. Its weights are in the stages' "
                         f"checkpoints; export needs a swarm with model.boundary_rank = 0")
    if isinstance(seam, HFCausalLM):
        return "hf"
    if isinstance(seam, BuiltinGPT):
        return "builtin"
    raise ModelError(f"swarmd export writes Hugging Face models (model.hf) and the built-in "
                     f"GPT; this swarm trains {seam.factory or type(seam).__name__}, whose "
                     f"parameters it cannot name")


def stage_part(seam: ModelSeam, index: int, num_stages: int, params: Mapping[str, torch.Tensor],
               *, dtype: torch.dtype) -> NamedPart:
    """Stage ``index`` of ``num_stages`` from its downloaded ``params``."""
    module = seam.build_stage(index, num_stages, device="cpu", dtype=dtype)
    return _named(seam, module, params, what=f"stage {index}")


def trainer_part(seam: ModelSeam, params: Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype) -> NamedPart:
    """The trainers' embedding and head from their ``params``."""
    module = seam.build_trainer(device="cpu", dtype=dtype)
    return _named(seam, module, params, what="the trainers' embedding and head")


def _named(seam: ModelSeam, module: nn.Module, params: Mapping[str, torch.Tensor], *,
           what: str) -> NamedPart:
    _load(module, params, what)
    digest = round_digest_of(module.parameters())
    names = _names(seam, module)
    own = module.state_dict()
    unnamed = sorted(set(own) - set(names) - _tied(seam, module))
    if unnamed:
        raise InternalError(f"{what}: no checkpoint name for {unnamed[:5]}")
    return NamedPart(tensors={names[k]: own[k].detach().clone() for k in names}, digest=digest)


def _load(module: nn.Module, params: Mapping[str, torch.Tensor], what: str) -> None:
    mine = module.state_dict()
    missing, extra = sorted(set(mine) - set(params)), sorted(set(params) - set(mine))
    if missing or extra:
        raise PartMismatch(f"{what}: the weights sent are another model's: missing "
                           f"{missing[:5]}, unexpected {extra[:5]}")
    for name, t in mine.items():
        got = params[name]
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(t.shape) \
                or got.dtype != t.dtype:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise PartMismatch(f"{what}: tensor {name!r} is {getattr(got, 'dtype', '?')} "
                               f"{shape} in the weights sent, {t.dtype} {tuple(t.shape)} in "
                               f"the model")
    module.load_state_dict(dict(params), strict=True)


def _names(seam: ModelSeam, module: nn.Module) -> dict[str, str]:
    from swarmd.models import builtin

    if export_kind(seam) == "hf":
        return seam.checkpoint_names(module)  # type: ignore[attr-defined]
    return builtin.checkpoint_names(module)


def _tied(seam: ModelSeam, module: nn.Module) -> set[str]:
    """Local names left out of the checkpoint because they are another tensor's."""
    return {"lm_head.weight"} if getattr(seam, "tied", False) else set()
