"""The compute core of a stage server: forward, backward and gradient accumulation. No I/O.

A peer serving stage k receives activations ``x`` (B, T, width) for a microbatch, runs its
blocks, and keeps what backward needs under the microbatch id: the input as a leaf that requires
grad, and the output. Later the gradient of the loss with respect to that output arrives; the
worker back-propagates through its blocks, which accumulates the parameters' gradients, and
returns the gradient with respect to its input for the previous stage. This is exactly the chain
rule of the single-process model cut at stage boundaries (see tests/test_stage_worker.py).

What is kept is bounded (``max_saved``: a full worker refuses new forwards with ``StageBusy``, so
the sender routes elsewhere; nothing is evicted under load) and expires (``ttl_s``: a microbatch
whose backward never comes is dropped by ``expire``). Everything that arrives is checked before
use: wrong shape, dtype or non-finite values raise ``BadActivation`` (the sender's fault).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swarmd.errors import BadActivation, StageBusy, UnknownMicrobatch
from swarmd.model import wire_tensor


@dataclass(slots=True)
class _Saved:
    inputs: torch.Tensor  # leaf, requires_grad
    outputs: torch.Tensor
    samples: int
    expires_at: float


class StageWorker:
    def __init__(self, module: nn.Module, *, width: int, max_tokens: int,
                 max_saved: int = 64, ttl_s: float = 120.0,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if max_saved < 1 or ttl_s <= 0 or width < 1 or max_tokens < 1:
            raise ValueError("StageWorker needs max_saved >= 1, ttl_s > 0, width, max_tokens >= 1")
        self.module = module
        self.width = width
        self.max_tokens = max_tokens
        self.max_saved = max_saved
        self.ttl_s = ttl_s
        self.dtype = dtype
        self.device = torch.device(device)
        self._saved: dict[str, _Saved] = {}
        #: samples whose gradients are accumulated in the parameters' .grad since the last take
        self.samples_accumulated = 0

    @property
    def saved(self) -> int:
        return len(self._saved)

    def forward(self, mb_id: str, x: torch.Tensor, now: float) -> torch.Tensor:
        """Run the stage on ``x`` (B, T, width); keep what backward needs; return the output."""
        if mb_id in self._saved:
            raise BadActivation("duplicate", f"microbatch {mb_id!r} is already in flight here")
        if len(self._saved) >= self.max_saved:
            raise StageBusy(f"{self.max_saved} microbatches in flight here; route elsewhere")
        self._check(x, "activations")
        inputs = x.to(self.device, self.dtype).detach().requires_grad_(True)
        with torch.enable_grad():
            outputs = self.module(inputs)
        self._saved[mb_id] = _Saved(inputs, outputs, int(x.shape[0]), now + self.ttl_s)
        return wire_tensor(outputs.detach())

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Forward only (validation): nothing is kept."""
        self._check(x, "activations")
        with torch.no_grad():
            return wire_tensor(self.module(x.to(self.device, self.dtype)))

    def backward(self, mb_id: str, grad: torch.Tensor, now: float) -> torch.Tensor:
        """Back-propagate ``grad`` (d loss / d output) and return d loss / d input."""
        saved = self._saved.get(mb_id)
        if saved is None or saved.expires_at <= now:
            self._saved.pop(mb_id, None)
            raise UnknownMicrobatch(f"no forward of microbatch {mb_id!r} is kept here (never "
                                    f"seen, already done, or expired): restart it")
        if tuple(grad.shape) != tuple(saved.outputs.shape):
            raise BadActivation("shape", f"gradient of shape {tuple(grad.shape)} for an output "
                                         f"of shape {tuple(saved.outputs.shape)}")
        self._check(grad, "gradient")
        del self._saved[mb_id]
        torch.autograd.backward(saved.outputs, grad.to(self.device, saved.outputs.dtype))
        self.samples_accumulated += saved.samples
        assert saved.inputs.grad is not None
        return wire_tensor(saved.inputs.grad)

    def forget(self, mb_id: str) -> None:
        """Drop a microbatch whose chain failed further on: its backward will never come."""
        self._saved.pop(mb_id, None)

    def expire(self, now: float) -> list[str]:
        """Drop microbatches whose backward did not come in time; returns their ids."""
        gone = [k for k, v in self._saved.items() if v.expires_at <= now]
        for k in gone:
            del self._saved[k]
        return gone

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)
        self.samples_accumulated = 0

    def _check(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise BadActivation("type", f"{what} must be a tensor")
        if x.dim() != 3 or x.shape[-1] != self.width or x.shape[0] < 1 or x.shape[1] < 1:
            raise BadActivation("shape", f"{what} must be (batch, tokens, {self.width}), got "
                                         f"{tuple(x.shape)}")
        if x.shape[0] * x.shape[1] > self.max_tokens:
            raise BadActivation("too_large", f"{what} of {x.shape[0]}x{x.shape[1]} tokens, at "
                                             f"most {self.max_tokens} here")
        if not x.is_floating_point():
            raise BadActivation("dtype", f"{what} must be floating point, got {x.dtype}")
        if not bool(torch.isfinite(x).all()):
            raise BadActivation("not_finite", f"{what} contain NaN or Inf")

