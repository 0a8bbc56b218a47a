"""The compute core of a stage server: forward, backward and gradient accumulation. No I/O.

A peer serving stage k receives activations ``x`` (B, T, width) for a microbatch, runs its
blocks, and keeps what backward needs under the microbatch id: the input as a leaf that requires
grad, and the output. Later the gradient of the loss with respect to that output arrives; the
worker back-propagates through its blocks, which accumulates the parameters' gradients, and
returns the gradient with respect to its input for the previous stage. This is exactly the chain
rule of the single-process model cut at stage boundaries (see tests/test_stage_worker.py).

Weight stashing (docs/pipeline.md, "Latency hiding"): a stage steps while microbatches are
still in flight here, so each forward runs on a snapshot of the weights of its step (one copy
per distinct set of weights, shared by every forward that used it), and its backward runs on
that same snapshot: the gradient is the one of the weights the forward used, added to the
live parameters' gradients for the next step to apply (a delayed gradient, at most
``max_staleness`` steps old: ``stepped`` drops older microbatches, whose backward then gets
``unknown_microbatch`` and which the trainer restarts). With no step in between this is
exactly the single-process chain rule.

What is kept is bounded (``max_saved`` microbatches and, when given, ``max_saved_bytes``: a full
worker refuses new forwards with ``StageBusy``, so the sender routes elsewhere; the handlers may
first free the slot of an owner that does not answer or holds more than its share,
``swarmd.pipeline.slots``) and expires (``ttl_s``: a microbatch whose backward never comes is
dropped by ``expire``). With a byte bound, each forward's saved tensors are measured as autograd saves them
(their storages, parameters excluded); a new forward is refused when what is kept plus what it
is predicted to keep (bytes per token of the last forward) would pass the bound, unless nothing
is kept at all (a stage always takes one microbatch, however large). Everything that arrives is checked before
use: wrong shape, dtype or non-finite values raise ``BadActivation`` (the sender's fault).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from swarmd.errors import BadActivation, StageBusy, UnknownMicrobatch
from swarmd.models.gpt import to_device, wire_tensor
from swarmd.pipeline.exact import Source, Sources
from swarmd.pipeline.messages import activation, token_ids

#: a microbatch whose backward comes more than this many optimizer steps after its forward
#: is dropped (``StageWorker.stepped``): bounds the staleness and the stashes kept
MAX_STALENESS = 16
#: what a backward differentiates when a step came between it and its forward: the weights
#: the forward used (``stashed``) or the current ones, the forward run again (``current``)
BACKWARD_WITH = "stashed"
#: weight of each backward's lateness (in steps) in the average the prediction uses
LAG_EMA = 0.1


def _version(module: nn.Module) -> int:
    """Changes whenever any parameter is changed in place (autograd's version counters)."""
    return sum(p._version for p in module.parameters())
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
    #: the weights the forward used (leaves; name -> tensor) and the step they belong to
    weights: dict[str, torch.Tensor]
    step: int
    #: the live weights' version when the forward ran (``_version``)
    version: int
    #: bytes autograd keeps for this forward's backward (0: not measured, no byte bound)
    nbytes: int = 0
    #: gradients arrived so far; members that will never send one (forgotten)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    #: microbatch id -> the (trainer, trainer step) its backward came for
    sources: dict[str, Source] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.grads) + len(self.dropped) == len(self.rows)


class StageWorker:
    def __init__(self, module: nn.Module, *, width: int, max_tokens: int,
                 max_saved: int = 64, ttl_s: float = 120.0,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 max_staleness: int = MAX_STALENESS,
                 backward_with: str = BACKWARD_WITH,
                 max_saved_bytes: int | None = None, vocab: int = 0) -> None:
        """``vocab`` > 0: the stage takes token ids below it (stage 0 holding the embedding),
        not activations, and sends back no gradient of its input (an empty (B, T, 0))."""
        if max_saved < 1 or ttl_s <= 0 or width < 1 or max_tokens < 1 or max_staleness < 0:
            raise ValueError("StageWorker needs max_saved >= 1, ttl_s > 0, width, max_tokens >= 1"
                             ", max_staleness >= 0")
        if max_saved_bytes is not None and max_saved_bytes < 1:
            raise ValueError("StageWorker max_saved_bytes must be None (no bound) or >= 1")
        self.module = module
        self.width = width
        self.max_tokens = max_tokens
        self.vocab = vocab
        self.max_saved = max_saved
        self.ttl_s = ttl_s
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_staleness = max_staleness
        self._saved: dict[str, _Saved] = {}
        #: optimizer steps so far (``stepped``); a microbatch's staleness is counted in these
        self.steps = 0
        #: the stash forwards use now: (weights' in-place version sum, name -> leaf copy)
        self._stash: tuple[int, dict[str, torch.Tensor]] | None = None
        #: weight prediction: the weights before the step being taken, the last step's
        #: change (each with the weights' version it belongs to), and how many steps late
        #: backwards arrive (average)
        if backward_with not in ("stashed", "current"):
            raise ValueError(f"backward_with {backward_with!r}: 'stashed' or 'current'")
        self.backward_with = backward_with
        self.predict = backward_with == "stashed"
        self._pre_step: tuple[int, dict[str, torch.Tensor]] | None = None
        self._last_step: tuple[int, dict[str, torch.Tensor]] | None = None
        self.lag = 0.0
        #: backwards that ran the forward again on the current weights (``current``)
        self.recomputed = 0
        #: bound on the bytes of what is kept (``limits.saved_activation_bytes``); None: none
        self.max_saved_bytes = max_saved_bytes
        #: bytes kept per token by the last measured forward (the prediction for the next)
        self._bytes_per_token = 0.0
        #: forwards refused because of ``max_saved_bytes``
        self.refused_for_bytes = 0
        #: the slowest recent wait from a forward to its backward here (a decaying maximum):
        #: a stop waits this long, a few times over, for a microbatch it holds
        self.slowest_backward_s = 0.0
        #: samples whose gradients are accumulated in the parameters' .grad since the last take
        self.samples_accumulated = 0
        #: the trainer steps those samples came from, counted with them (``Sources``)
        self.sources = Sources()
        #: the sum over those of (samples x the step their forward ran at): with ``steps``,
        #: their lateness (``late_samples``)
        self.forward_steps = 0

    @property
    def late_samples(self) -> int:
        """The lateness of the gradients accumulated here, summed over their samples: for
        each, the optimizer steps between the weights its forward ran on and those the next
        step starts from (a backward that lands after a round took its snapshot counts
        toward the step after, so it is late even with no step between forward and
        backward)."""
        return self.samples_accumulated * self.steps - self.forward_steps

    @property
    def saved(self) -> int:
        return len(self._saved)

    @property
    def saved_bytes(self) -> int:
        """Bytes kept for backward passes to come (measured only under a byte bound)."""
        return sum({id(v): v.nbytes for v in self._saved.values()}.values())

    def _check_bytes(self, tokens: int) -> None:
        cap = self.max_saved_bytes
        if cap is None or not self._saved:
            return
        kept, more = self.saved_bytes, int(self._bytes_per_token * tokens)
        if kept + more > cap:
            self.refused_for_bytes += 1
            raise StageBusy(f"{kept} bytes of activations kept here and ~{more} more for this "
                            f"microbatch would pass limits.saved_activation_bytes ({cap}); "
                            f"route elsewhere")

    def forwarded_at(self) -> dict[str, float]:
        """When the forward of each microbatch kept here ran (``now`` it was given)."""
        return {mb: v.expires_at - self.ttl_s for mb, v in list(self._saved.items())}

    def holds(self, mb_id: str) -> bool:
        """Whether a forward of ``mb_id`` is kept here for its backward."""
        return mb_id in self._saved

    def samples_of(self, mb_id: str) -> int:
        """The samples (rows) of ``mb_id`` kept here; 0 when none is."""
        saved = self._saved.get(mb_id)
        if saved is None:
            return 0
        rows = saved.rows[mb_id]
        return rows.stop - rows.start

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
        self._check_bytes(int(x.shape[0]) * int(x.shape[1]))

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
        self._check_bytes(sum(int(x.shape[0]) * int(x.shape[1]) for _, x in items))
        rows, start = {}, 0
        for mb_id, x in items:
            rows[mb_id] = slice(start, start + int(x.shape[0]))
            start += int(x.shape[0])
        joined = items[0][1] if len(items) == 1 else torch.cat([x for _, x in items])
        inputs = self._inputs(joined)
        weights = self._weights()
        if self.max_saved_bytes is None:
            with torch.enable_grad():
                outputs = functional_call(self.module, weights, (inputs,))
            nbytes = 0
        else:
            outputs, nbytes = self._measured_forward(inputs, weights)
            self._bytes_per_token = nbytes / max(1, int(inputs.shape[0]) * int(inputs.shape[1]))
        saved = _Saved(inputs, outputs, rows, now + self.ttl_s, weights, self.steps,
                       self._stash[0] if self._stash is not None else 0, nbytes)
        for mb_id in rows:
            self._saved[mb_id] = saved
        out = outputs.detach()
        return [wire_tensor(out[r]) for r in rows.values()]

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        """What the module runs on: activations as a leaf that requires grad (their gradient
        goes back), token ids as they are (int64)."""
        if self.vocab:
            return x.to(self.device, torch.int64)
        return to_device(x, self.device, self.dtype).detach().requires_grad_(True)

    def _weights(self) -> dict[str, torch.Tensor]:
        """The stash of the current weights: made once after each change of the weights (an
        optimizer step, a state loaded), then shared by every forward until the next. After
        our own steps, with microbatches coming back ``lag`` steps late on average, it holds
        the weights predicted for when their gradient is applied: live + lag x the last
        step's change (linear weight prediction, docs/pipeline.md)."""
        version = _version(self.module)
        if self._stash is None or self._stash[0] != version:
            lag = round(self.lag, 2) if self.predict else 0.0
            last = self._last_step
            ahead = lag > 0 and last is not None and last[0] == version
            with torch.no_grad():
                copy = {}
                for name, p in self.module.named_parameters():
                    w = p.detach().clone()
                    if ahead and name in last[1]:
                        w.add_(last[1][name], alpha=lag)
                    copy[name] = w.requires_grad_(p.requires_grad)
            self._stash = (version, copy)
        return self._stash[1]

    def before_step(self) -> None:
        """Called just before an optimizer step: the weights it starts from."""
        with torch.no_grad():
            self._pre_step = (_version(self.module), {
                n: p.detach().clone() for n, p in self.module.named_parameters()})

    def stepped(self) -> list[str]:
        """The weights took an optimizer step (after ``before_step``): its change is kept for
        the prediction; microbatches whose forward is now more than ``max_staleness`` steps
        old are dropped (returns their ids; their backward gets ``unknown_microbatch`` and
        the trainer restarts them)."""
        self.steps += 1
        pre, self._pre_step = self._pre_step, None
        self._last_step = None
        if pre is not None:
            with torch.no_grad():
                self._last_step = (_version(self.module), {
                    n: p.detach() - pre[1][n] for n, p in self.module.named_parameters()
                    if n in pre[1]})
        gone = [k for k, v in self._saved.items() if self.steps - v.step > self.max_staleness]
        for k in gone:
            del self._saved[k]
        return gone

    def _measured_forward(self, inputs: torch.Tensor, weights: dict[str, torch.Tensor]
                          ) -> tuple[torch.Tensor, int]:
        """Run the module on ``weights``, adding up the storages autograd saves for backward
        (each once; the weights' own storages, stashed or live, are not activations)."""
        params = {p.untyped_storage().data_ptr()
                  for p in (*self.module.parameters(), *weights.values())}
        kept: dict[int, int] = {}

        def keep(t: torch.Tensor) -> None:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (e.g. sparse): not counted
                return
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()

        def pack(t: torch.Tensor) -> torch.Tensor:
            keep(t)
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            outputs = functional_call(self.module, weights, (inputs,))
        keep(inputs)
        keep(outputs)
        return outputs, sum(kept.values())

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Forward only (validation): nothing is kept."""
        self._check(x, "activations")
        with torch.no_grad():
            return wire_tensor(self.module(self._inputs(x).detach()))

    def backward(self, mb_id: str, grad: torch.Tensor, now: float) -> torch.Tensor:
        """Back-propagate ``grad`` (d loss / d output) and return d loss / d input. For a
        microbatch that ran alone; see ``backward_joined`` for batches."""
        done = self.backward_joined(mb_id, grad, now)
        if done is None:
            raise BadActivation("batched", f"microbatch {mb_id!r} waits for its batch")
        return done[mb_id]

    def backward_joined(self, mb_id: str, grad: torch.Tensor, now: float,
                        source: Source | None = None) -> dict[str, torch.Tensor] | None:
        """Take ``grad`` for ``mb_id``. When it completes its batch, back-propagate the batch
        and return d loss / d input for every member that sent a gradient; else None.
        ``source`` (the trainer and its step) joins ``sources`` with the samples."""
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
        if source is not None:
            saved.sources[mb_id] = source
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
        late = self.steps - saved.step
        self.lag += LAG_EMA * (late - self.lag)
        for mb in saved.rows:
            self._saved.pop(mb, None)
        parts = [to_device(saved.grads[mb], self.device, saved.outputs.dtype) if mb in saved.grads
                 else torch.zeros_like(saved.outputs[r]) for mb, r in saved.rows.items()]
        self._backward(saved, parts[0] if len(parts) == 1 else torch.cat(parts))
        samples = sum(r.stop - r.start for mb, r in saved.rows.items() if mb in saved.grads)
        self.samples_accumulated += samples
        self.forward_steps += saved.step * samples
        for source in saved.sources.values():  # only members that sent a gradient have one
            self.sources.add(*source)
        g = saved.inputs.grad
        if g is None:  # token ids: nothing goes back but that the backward is done
            assert self.vocab
            g = saved.inputs.new_zeros((*saved.inputs.shape, 0), dtype=torch.float32)
        return {mb: wire_tensor(g[r]) for mb, r in saved.rows.items() if mb in saved.grads}

    def _backward(self, saved: _Saved, grad: torch.Tensor) -> None:
        """Back-propagate through the stashed weights the forward used (``current``: when
        the weights changed since, through a forward run again on the current ones); their
        gradients are added to the live parameters' (what the next step applies)."""
        if self.backward_with == "current" and saved.version != _version(self.module):
            weights = self._weights()
            inputs = self._inputs(saved.inputs.detach())
            with torch.enable_grad():
                outputs = functional_call(self.module, weights, (inputs,))
            saved.inputs, saved.outputs, saved.weights = inputs, outputs, weights
            self.recomputed += 1
        live = dict(self.module.named_parameters())
        names = [n for n, w in saved.weights.items() if w.requires_grad]
        wrt = [saved.weights[n] for n in names]
        takes_grad = saved.inputs.requires_grad  # token ids do not
        found = torch.autograd.grad(saved.outputs, [saved.inputs, *wrt] if takes_grad else wrt,
                                    grad, allow_unused=True)
        if takes_grad:
            saved.inputs.grad, found = found[0], found[1:]
        with torch.no_grad():
            for name, g in zip(names, found):
                if g is None:
                    continue
                p = live[name]
                p.grad = g if p.grad is None else p.grad + g

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

    def drop_forwarded_before(self, when: float, keep: Collection[str] = ()) -> list[str]:
        """Drop the microbatches whose forward ran before ``when`` (taken for lost: their
        backward is not coming), but those in ``keep``; returns their ids."""
        gone = [k for k, v in list(self._saved.items())
                if v.expires_at - self.ttl_s < when and k not in keep]
        for k in gone:
            self._saved.pop(k, None)
        return gone

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
        self.forward_steps = 0
        self.sources.take()

    def accumulated(self) -> tuple[list[Source], int]:
        """The sources and samples accumulated now (in the compute thread: one instant)."""
        return self.sources.peek(), self.samples_accumulated

    def _check(self, x: torch.Tensor, what: str) -> None:
        """Token ids where this stage takes them, else a (batch, tokens, width) finite float
        tensor (``swarmd.pipeline.messages``: the same checks as a message's)."""
        if self.vocab and what == "activations":
            token_ids(x, self.vocab, self.max_tokens, "token ids")
        else:
            activation(x, self.width, self.max_tokens, what)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
