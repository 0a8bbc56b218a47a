"""The trainer's compute: its embedding, head and loss, and its optimizer step. No I/O.

Run in the trainer's compute thread, never on the event loop (``Trainer._run``). A mixin of
``swarmd.trainer.trainer.Trainer``, which owns the attributes used here: ``parts`` (embed,
head, loss), ``params`` (tied weights once), ``optimizer`` (a ``SwarmOptimizer``), ``scaler``
(float16's loss scale, else None), ``device``, ``dtype``, ``counters`` and the step's running
``_samples`` and ``_overflow``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from swarmd.models.gpt import to_device, wire_tensor


class TrainerCompute:
    parts: Any
    params: list[torch.nn.Parameter]
    optimizer: Any
    scaler: Any
    device: torch.device
    dtype: torch.dtype
    counters: Counter[str]
    _samples: int
    _overflow: bool

    @property
    def loss_scale(self) -> float:
        """The loss is multiplied by this before backward (float16; else 1)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _add_head(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """A microbatch's head gradients (once per microbatch, however often it restarted)
        and its samples; a parameter without one gets zeros (it still takes the step)."""
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
        self._samples += samples

    def _add(self, grads: list[torch.Tensor | None]) -> None:
        """A finished microbatch's embedding gradients (None where the embedding plays no
        part, and for every parameter where stage 0 holds the embedding)."""
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

    def _own_sqnorm(self) -> float:
        """What ``_mean_gradient`` will give, without changing the gradients: the norm note
        of a step whose microbatches all passed the head (``swarmd.pipeline.exact``)."""
        n = max(1, self._samples)
        return self._sqnorm(p.grad / n for p in self.params if p.grad is not None)

    def _mean_gradient(self) -> float:
        """The sums over samples become the step's mean gradient; its squared norm (loss scale
        removed: what the optimizer would clip)."""
        for p in self.params:
            if p.grad is not None:
                p.grad /= max(1, self._samples)
        return self._gradient_sqnorm()

    def _gradient_sqnorm(self) -> float:
        """The squared norm of the parts' (mean) gradient as it is now, loss scale removed."""
        return self._sqnorm(p.grad for p in self.params if p.grad is not None)

    def _sqnorm(self, grads: Iterable[torch.Tensor]) -> float:
        """The squared norm of ``grads``, summed in their order (the norm note and the step
        must give the same float), loss scale removed."""
        total = 0.0
        for g in grads:
            total += float(g.detach().float().pow(2).sum())
        return total / (self.loss_scale * self.loss_scale)

    def _step_and_zero(self, coefficient: float | None = None) -> None:
        """The step over the mean gradient (``_mean_gradient``), scaled first by the whole
        model's clipping ``coefficient`` when given; skipped when a gradient overflowed
        (float16: the loss scale backs off); then zero them."""
        if coefficient is not None and coefficient < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad *= coefficient
        if self._overflow:
            self.optimizer.skip_next()
        self.optimizer.scale = self.loss_scale
        stepped = self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(not stepped)
        self._overflow = False
        self.optimizer.zero_grad(set_to_none=True)
        self._samples = 0

    def _embed(self, x: torch.Tensor, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return self.parts.embed(to_device(x, self.device))

    def _embed_kept(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The embedding with its graph, and its weights' versions (see ``_embed_backward``)."""
        return self._embed(x, True), [p._version for p in self.params]

    def _embed_backward(self, x: torch.Tensor, h: torch.Tensor, versions: list[int],
                        g_h: torch.Tensor) -> list[torch.Tensor | None]:
        """Each parameter's gradient through the embedding (None where it plays no part). When
        a step changed the weights since ``h`` was made (the pipelined schedule), the forward
        is run again on the current weights: the graph kept may hold weights that changed in
        place (cheap: the embedding is a lookup)."""
        if not h.is_floating_point():  # token ids: stage 0 holds the embedding
            return [None] * len(self.params)
        if versions != [p._version for p in self.params]:
            h = self._embed(x, True)
            self.counters["embedding_recomputed"] += 1
        return list(torch.autograd.grad(h, self.params, to_device(g_h, self.device, h.dtype),
                                        allow_unused=True))

    def _head_backward(self, out: torch.Tensor, y: torch.Tensor, scale: float
                       ) -> tuple[float, torch.Tensor, list[torch.Tensor | None], bool]:
        """The loss, its gradient for the last stage, the head's gradients, and whether any of
        those overflowed (float16 under a too large loss scale)."""
        out = to_device(out, self.device, self.dtype).requires_grad_(True)
        loss = self.parts.loss(self.parts.head(out), to_device(y, self.device))
        g_out, *g_head = torch.autograd.grad(loss * (scale * self.loss_scale),
                                             [out, *self.params], allow_unused=True)
        assert g_out is not None
        overflow = self.scaler is not None and not all(
            bool(torch.isfinite(g).all()) for g in (g_out, *g_head) if g is not None)
        return float(loss.detach()), wire_tensor(g_out), g_head, overflow

    def _eval_loss(self, out: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            out = to_device(out, self.device, self.dtype)
            return float(self.parts.loss(self.parts.head(out), to_device(y, self.device)))
