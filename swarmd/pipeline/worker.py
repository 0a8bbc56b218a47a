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

from dataclasses import dataclass, field

import torch
from torch import nn

from swarmd.errors import BadActivation, StageBusy, UnknownMicrobatch
from swarmd.training.model import wire_tensor

#: per backward, the slowest forward-to-backward wait remembered shrinks by this factor
BACKWARD_DECAY = 0.98


@dataclass(slots=True, eq=False)
class _Saved:
    """One forward pass: of one microbatch, or of several run as one batch (``rows``)."""

    inputs: torch.Tensor  # leaf, requires_grad
    outputs: torch.Tensor
    #: microbatch id -> its rows of inputs and outputs, in order
    rows: dict[str, slice]
    expires_at: float
    #: gradients arrived so far; members that will never send one (forgotten)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.grads) + len(self.dropped) == len(self.rows)


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
        #: the slowest recent wait from a forward to its backward here (a decaying maximum):
        #: a stop waits this long, a few times over, for a microbatch it holds
        self.slowest_backward_s = 0.0
        #: samples whose gradients are accumulated in the parameters' .grad since the last take
        self.samples_accumulated = 0

    @property
    def saved(self) -> int:
        return len(self._saved)

    def holds(self, mb_id: str) -> bool:
        """Whether a forward of ``mb_id`` is kept here for its backward."""
        return mb_id in self._saved

    def forward(self, mb_id: str, x: torch.Tensor, now: float) -> torch.Tensor:
        """Run the stage on ``x`` (B, T, width); keep what backward needs; return the output."""
        return self.forward_many([(mb_id, x)], now)[0]

    def check_forward(self, mb_id: str, x: torch.Tensor) -> None:
        """What ``forward`` refuses, checked before a microbatch joins a batch."""
        if mb_id in self._saved:
            raise BadActivation("duplicate", f"microbatch {mb_id!r} is already in flight here")
        if len(self._saved) >= self.max_saved:
            raise StageBusy(f"{self.max_saved} microbatches in flight here; route elsewhere")
        self._check(x, "activations")

    def forward_many(self, items: list[tuple[str, torch.Tensor]], now: float
                     ) -> list[torch.Tensor]:
        """Forward several microbatches of the same sequence length as one batch (one module
        call); each gets its own rows of the output. Their backward is joined: it runs once
        every member's gradient arrived (``backward``) or the rest were given up
        (``finish``)."""
        if not items or len({int(x.shape[1]) for _, x in items}) != 1:
            raise ValueError("forward_many needs microbatches of one sequence length")
        if len({mb for mb, _ in items}) != len(items):
            raise BadActivation("duplicate", "the same microbatch twice in one batch")
        for mb_id, x in items:
            self.check_forward(mb_id, x)
        if len(self._saved) + len(items) > self.max_saved:
            raise StageBusy(f"{self.max_saved} microbatches in flight here; route elsewhere")
        rows, start = {}, 0
        for mb_id, x in items:
            rows[mb_id] = slice(start, start + int(x.shape[0]))
            start += int(x.shape[0])
        joined = items[0][1] if len(items) == 1 else torch.cat([x for _, x in items])
        inputs = joined.to(self.device, self.dtype).detach().requires_grad_(True)
        with torch.enable_grad():
            outputs = self.module(inputs)
        saved = _Saved(inputs, outputs, rows, now + self.ttl_s)
        for mb_id in rows:
            self._saved[mb_id] = saved
        out = outputs.detach()
        return [wire_tensor(out[r]) for r in rows.values()]

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Forward only (validation): nothing is kept."""
        self._check(x, "activations")
        with torch.no_grad():
            return wire_tensor(self.module(x.to(self.device, self.dtype)))

    def backward(self, mb_id: str, grad: torch.Tensor, now: float) -> torch.Tensor:
        """Back-propagate ``grad`` (d loss / d output) and return d loss / d input. For a
        microbatch that ran alone; see ``backward_joined`` for batches."""
        done = self.backward_joined(mb_id, grad, now)
        if done is None:
            raise BadActivation("batched", f"microbatch {mb_id!r} waits for its batch")
        return done[mb_id]

    def backward_joined(self, mb_id: str, grad: torch.Tensor, now: float
                        ) -> dict[str, torch.Tensor] | None:
        """Take ``grad`` for ``mb_id``. When it completes its batch, back-propagate the batch
        and return d loss / d input for every member that sent a gradient; else None."""
        saved = self._saved.get(mb_id)
        if saved is None or saved.expires_at <= now or mb_id in saved.grads:
            if saved is not None and saved.expires_at <= now:
                self.expire(now)
            raise UnknownMicrobatch(f"no forward of microbatch {mb_id!r} is kept here (never "
                                    f"seen, already done, or expired): restart it")
        rows = saved.rows[mb_id]
        shape = (rows.stop - rows.start, *saved.outputs.shape[1:])
        if tuple(grad.shape) != tuple(shape):
            raise BadActivation("shape", f"gradient of shape {tuple(grad.shape)} for an output "
                                         f"of shape {tuple(shape)}")
        self._check(grad, "gradient")
        waited = now - (saved.expires_at - self.ttl_s)
        self.slowest_backward_s = max(waited, BACKWARD_DECAY * self.slowest_backward_s)
        saved.grads[mb_id] = grad
        return self._run_backward(saved) if saved.complete else None

    def finish(self, mb_id: str) -> dict[str, torch.Tensor]:
        """Give up waiting for the rest of ``mb_id``'s batch: back-propagate what arrived (the
        missing members count as zero gradient and are dropped: their backward, should it
        still come, gets ``unknown_microbatch``)."""
        saved = self._saved.get(mb_id)
        if saved is None or not saved.grads:
            return {}
        saved.dropped |= saved.rows.keys() - saved.grads.keys()
        return self._run_backward(saved)

    def waiting(self, mb_id: str) -> bool:
        """Whether ``mb_id`` sent its gradient and waits for the rest of its batch."""
        saved = self._saved.get(mb_id)
        return saved is not None and mb_id in saved.grads

    def _run_backward(self, saved: _Saved) -> dict[str, torch.Tensor]:
        for mb in saved.rows:
            self._saved.pop(mb, None)
        parts = [saved.grads[mb].to(self.device, saved.outputs.dtype) if mb in saved.grads
                 else torch.zeros_like(saved.outputs[r]) for mb, r in saved.rows.items()]
        torch.autograd.backward(saved.outputs, parts[0] if len(parts) == 1 else torch.cat(parts))
        self.samples_accumulated += sum(r.stop - r.start for mb, r in saved.rows.items()
                                        if mb in saved.grads)
        assert saved.inputs.grad is not None
        g = saved.inputs.grad
        return {mb: wire_tensor(g[r]) for mb, r in saved.rows.items() if mb in saved.grads}

    def forget(self, mb_id: str) -> None:
        """Drop a microbatch whose chain failed further on: its backward will never come."""
        saved = self._saved.pop(mb_id, None)
        if saved is not None:
            saved.dropped.add(mb_id)
            if not (saved.rows.keys() - saved.dropped):  # nobody left in the batch
                for mb in saved.rows:
                    self._saved.pop(mb, None)

    def saved_within(self, now: float, age_s: float) -> int:
        """Microbatches kept here whose forward ran at most ``age_s`` seconds before ``now``
        (older ones are most likely given up by their trainer)."""
        return sum(1 for v in list(self._saved.values()) if now - (v.expires_at - self.ttl_s)
                   <= age_s)

    def expire(self, now: float) -> list[str]:
        """Drop microbatches whose backward did not come in time; returns their ids. Safe
        beside a backward in the compute thread (a stop's hand-back runs on the event loop)."""
        gone = [k for k, v in list(self._saved.items()) if v.expires_at <= now]
        for k in gone:
            self._saved.pop(k, None)
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

