"""The pipeline's messages as typed values, built and checked from the wire in one place. Pure.

``forward``, ``backward``, ``result``, ``grad`` and ``abandon`` (and the ``ok`` reply of a
forward) are frozen, slotted, keyword-only dataclasses. ``parse_*`` builds one from what
arrived (anything with ``kind``, ``meta`` and ``tensors``, e.g. ``transport.frames.Message``):
every field's type, size and range is checked, the number of tensors and their shape and
dtype against what the receiver expects, and unknown keys are dropped (a message is re-built
for the next hop, never copied). ``wire()`` gives the ``Message`` keyword arguments to send one.

What cannot be judged from one message alone is the caller's: who may send it (the path's
authority rules, docs/pipeline.md) and whether the microbatch is known here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.errors import BadActivation, ModelMismatch, WrongStage

__all__ = ["Expect", "Forward", "Backward", "Result", "Grad", "Abandon", "HopReply",
           "StepReport", "StepAnswer", "Flush", "parse_flush", "parse_flushed",
           "NormNote", "parse_norm_note",
           "TrainerProgress", "parse_forward", "parse_backward",
           "parse_result", "parse_grad", "parse_abandon", "parse_hop_reply",
           "parse_step_report", "parse_step_answer", "parse_progress", "progress_meta",
           "is_shard", "hop_seconds"]

#: most characters of a microbatch id and of a peer id
MAX_MB_CHARS = 160
MAX_PEER_CHARS = 128
MAX_MODEL_CHARS = 128
MAX_STEP = 1 << 62
#: a hop's reported seconds above this are nonsense
MAX_SECONDS = 1e6
#: the range of a backward's loss scale
MIN_SCALE, MAX_SCALE = 2.0 ** -24, 2.0 ** 32
#: a trainer's reported losses beyond this (either sign) are nonsense
MAX_LOSS = 1e6
#: most characters of a data shard ("i/n")
MAX_SHARD_CHARS = 24


@dataclass(frozen=True, slots=True, kw_only=True)
class Expect:
    """What a receiver serves: a forward or backward for anything else is refused."""

    stage: int
    num_stages: int
    model: str
    width: int
    max_tokens: int
    #: > 0: this stage takes token ids below it, not activations (stage 0 holding the
    #: embedding: ``ModelSeam.stage0_embeds``)
    vocab: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Forward:
    mb: str
    stage: int
    step: int
    #: the peers of stages 0 .. stage-1 it went through
    path: tuple[str, ...]
    trainer: str
    model: str
    x: torch.Tensor
    #: validation: forward only, nothing kept, no backward follows
    eval: bool = False
    #: the stage step each stage must run it on (``swarmd.pipeline.exact``), one per stage;
    #: None: whatever step the stage is at
    at: tuple[int, ...] | None = None

    def next_hop(self, me: str, y: torch.Tensor) -> Forward:
        """The forward this peer sends on: its output, one stage further, itself on the path."""
        return Forward(mb=self.mb, stage=self.stage + 1, step=self.step,
                       path=(*self.path, me), trainer=self.trainer, model=self.model, x=y,
                       eval=self.eval, at=self.at)

    def wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"mb": self.mb, "stage": self.stage, "step": self.step,
                                "path": list(self.path), "trainer": self.trainer,
                                "model": self.model}
        if self.eval:
            meta["eval"] = True
        if self.at is not None:
            meta["at"] = list(self.at)
        return {"kind": "forward", "meta": meta, "tensors": (self.x,)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Backward:
    mb: str
    stage: int
    step: int
    #: every stage's peer, 0 .. num_stages-1
    path: tuple[str, ...]
    trainer: str
    model: str
    grad: torch.Tensor
    #: the trainer's loss scale: the gradient is d(scale * loss); stages divide by it
    scale: float = 1.0
    #: a gradient overflowed on the way (float16): ``grad`` is zeros, the step is skipped
    overflow: bool = False

    def previous_hop(self, g: torch.Tensor, *, overflow: bool = False) -> Backward:
        return Backward(mb=self.mb, stage=self.stage - 1, step=self.step, path=self.path,
                        trainer=self.trainer, model=self.model, grad=g, scale=self.scale,
                        overflow=self.overflow or overflow)

    def wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"mb": self.mb, "stage": self.stage, "step": self.step,
                                "path": list(self.path), "trainer": self.trainer,
                                "model": self.model}
        if self.scale != 1.0:
            meta["scale"] = self.scale
        if self.overflow:
            meta["overflow"] = True
        return {"kind": "backward", "tensors": (self.grad,), "meta": meta}


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """The last stage's output for the trainer."""

    mb: str
    path: tuple[str, ...]
    y: torch.Tensor

    def wire(self) -> dict[str, Any]:
        return {"kind": "result", "meta": {"mb": self.mb, "path": list(self.path)},
                "tensors": (self.y,)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Grad:
    """Stage 0's input gradient for the trainer."""

    mb: str
    grad: torch.Tensor
    #: a gradient overflowed along the path (float16): the trainer skips its step
    overflow: bool = False

    def wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"mb": self.mb}
        if self.overflow:
            meta["overflow"] = True
        return {"kind": "grad", "meta": meta, "tensors": (self.grad,)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Abandon:
    """A trainer gave a microbatch up after a peer of its path kept its forward (the chain
    broke further on; the trainer restarts it under a new id): what that peer keeps for its
    backward can go at once, and a step draining for it need not wait until it is taken for
    lost (``stepping.LOST_MIN_S``)."""

    mb: str

    def wire(self) -> dict[str, Any]:
        return {"kind": "abandon", "meta": {"mb": self.mb}}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """A stage peer to the trainer whose step its next step's samples all came from
    (``swarmd.pipeline.exact``): the squared norm of that step's mean gradient at ``stage``
    (after its round's averaging, loss scale removed), the stage step it applies it at and
    the samples it holds. Answered with the whole model's clipping coefficient."""

    step: int
    stage: int
    stage_step: int
    sqnorm: float
    samples: int
    #: the stage takes no step for it now (its round failed): the trainer need not wait
    failed: bool = False

    def wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"step": self.step, "stage": self.stage,
                                "stage_step": self.stage_step, "sqnorm": self.sqnorm,
                                "samples": self.samples}
        if self.failed:
            meta["failed"] = True
        return {"kind": "step_report", "meta": meta}


@dataclass(frozen=True, slots=True, kw_only=True)
class NormNote:
    """One part's squared norm of a trainer's step (``swarmd.pipeline.exact``, "Norm
    notes"), to the stage peers that step with it: from the trainer (``part`` is
    ``num_stages``, with its clipping bound ``clip``) once its part's gradient is complete,
    from a stage peer (``part`` its stage) as it reports the step. Answered ``ok``."""

    trainer: str
    step: int
    part: int
    sqnorm: float
    clip: float | None = None

    def wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"trainer": self.trainer, "step": self.step, "part": self.part,
                                "sqnorm": self.sqnorm}
        if self.clip is not None:
            meta["clip"] = self.clip
        return {"kind": "norm_note", "meta": meta}


def parse_norm_note(message: Any, *, num_stages: int) -> NormNote:
    """A ``NormNote``: a part of this model (a stage, or ``num_stages``: the trainer's, which
    alone has a ``clip``), finite numbers >= 0."""
    meta = _meta(message, "norm_note")
    _tensors(message, 0, "norm_note")
    part = _int(meta, "part", 0, num_stages + 1, "norm_note")
    numbers = {}
    for key in ("sqnorm", "clip"):
        value = meta.get(key)
        if value is None and key == "clip":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0):
            raise BadActivation("not_finite", f"norm_note meta {key!r} must be a finite "
                                              f"number >= 0")
        numbers[key] = float(value)
    if ("clip" in numbers) != (part == num_stages):
        raise BadActivation("clip", "a norm_note has a clip exactly when it is the trainer's")
    return NormNote(trainer=_text(meta, "trainer", MAX_PEER_CHARS, "norm_note"),
                    step=_int(meta, "step", 0, MAX_STEP, "norm_note"), part=part,
                    sqnorm=numbers["sqnorm"], clip=numbers.get("clip"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Flush:
    """A trainer to every peer of ``stage`` after a step of its that was not exact: step now
    on whatever the stage holds of this trainer's steps (samples left over from a step whose
    other shares never came), so that its next step starts on a stage holding nothing.
    Answered ``ok`` with the stage's step after it (``{"stage_step": n}``)."""

    stage: int
    #: the trainer's step it is about to take (the samples held are from earlier ones)
    step: int

    def wire(self) -> dict[str, Any]:
        return {"kind": "flush", "meta": {"stage": self.stage, "step": self.step}}


def parse_flush(message: Any, *, num_stages: int) -> Flush:
    meta = _meta(message, "flush")
    _tensors(message, 0, "flush")
    return Flush(stage=_int(meta, "stage", 0, num_stages, "flush"),
                 step=_int(meta, "step", 0, MAX_STEP, "flush"))


def parse_flushed(message: Any) -> int:
    """The stage step of a flush's ``ok``."""
    return _int(_meta(message, "ok"), "stage_step", 0, MAX_STEP, "flush")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerProgress:
    """How a trainer's run goes, told to the stage peers it talks to (in its ``ok`` to a
    ``result`` or ``grad`` and in its ``StepAnswer``; ``swarmd.pipeline.progress`` keeps it):
    the steps it took and the mean loss of the last one, its latest validation loss and the
    step it was measured at, its data shard (``"i/n"``) and epoch. None: not known yet."""

    step: int
    loss: float | None = None
    val_loss: float | None = None
    val_step: int | None = None
    shard: str | None = None
    epoch: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.step < MAX_STEP:
            raise ValueError(f"a trainer's step {self.step} is out of range")
        for value in (self.loss, self.val_loss):
            if value is not None and not (math.isfinite(value) and abs(value) < MAX_LOSS):
                raise ValueError(f"a trainer's loss {value} is not a finite number")
        if (self.val_loss is None) != (self.val_step is None):
            raise ValueError("a validation loss goes with the step it was measured at")
        if self.shard is not None and not is_shard(self.shard):
            raise ValueError(f"a data shard is i/n with 0 <= i < n, not {self.shard!r}")

    def wire(self) -> dict[str, Any]:
        return {k: v for k, v in (("step", self.step), ("loss", self.loss),
                                  ("val_loss", self.val_loss), ("val_step", self.val_step),
                                  ("shard", self.shard), ("epoch", self.epoch))
                if v is not None}


def progress_meta(progress: TrainerProgress | None) -> dict[str, Any]:
    """The ``meta`` of a trainer's ``ok`` reply that tells ``progress`` ({} when None)."""
    return {} if progress is None else {"progress": progress.wire()}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepAnswer:
    """The trainer's answer to a ``step_report``: the coefficient every part of the model
    scales that step's gradient by, None when the step's reports did not all arrive in time
    (each part clips its own); and the trainer's progress (read by ``parse_progress``)."""

    coefficient: float | None
    progress: TrainerProgress | None = None

    def wire(self) -> dict[str, Any]:
        return {"kind": "ok", "meta": {"coefficient": self.coefficient,
                                       **progress_meta(self.progress)}}


@dataclass(frozen=True, slots=True, kw_only=True)
class HopReply:
    """A forward's ``ok``: the peer's own queue and compute (``service_s``), its compute
    alone (``compute_s``, its share of a batch's), how long it held the request, the rest
    of the chain included (``held_s``), and how long this reply waits in the peer's own
    upload cap before it leaves (``upload_wait_s``: its bucket's debt when the reply is built;
    a capped peer whose averaging fills its upload says it); None when not said."""

    service_s: float | None = None
    held_s: float | None = None
    compute_s: float | None = None
    upload_wait_s: float | None = None

    def wire(self) -> dict[str, Any]:
        meta = {k: v for k, v in (("service_s", self.service_s), ("held_s", self.held_s),
                                  ("compute_s", self.compute_s),
                                  ("upload_wait_s", self.upload_wait_s)) if v is not None}
        return {"kind": "ok", "meta": meta}

    def seconds(self, round_trip_s: float) -> float:
        """What the hop cost the peer it went to: its compute plus the transfer (the round trip
        less the time it held the request, less the time the reply said it waits in the
        peer's upload cap: the cap is in the peer's announced throughput already, the ceiling
        the wiring holds it to; counted in the hop too, other traffic in its upload would
        lower its rate twice). The time it waited in its queue is not: that is load, which the
        wiring keeps itself (counted in the rate too, a loaded peer would look slower than it
        computes, and shares would stop following throughput). Its service time when it says
        no compute time (an older peer); the round trip when the reply says nothing usable."""
        service, held, compute = self.service_s, self.held_s, self.compute_s
        if service is None or held is None or service > held or held > round_trip_s:
            return round_trip_s
        transfer = round_trip_s - held
        if self.upload_wait_s is not None:
            transfer = max(0.0, transfer - self.upload_wait_s)
        if compute is not None and compute <= service:
            return compute + transfer
        return service + transfer


# ---- building from the wire ----------------------------------------------------------------
def parse_forward(message: Any, expect: Expect) -> Forward:
    meta = _meta(message, "forward")
    model = _text(meta, "model", MAX_MODEL_CHARS, "forward")
    if model != expect.model:
        raise ModelMismatch(f"this peer trains model {expect.model}, the request is for "
                            f"{model}")
    stage = _int(meta, "stage", 0, MAX_STEP, "forward")
    if stage != expect.stage:
        raise WrongStage(f"this peer serves stage {expect.stage}, not {stage}")
    path = _path(meta, "forward", stage)
    evaluate = meta.get("eval", False)
    if not isinstance(evaluate, bool):
        raise BadActivation("malformed", "forward meta 'eval' must be a boolean")
    at = meta.get("at")
    if at is not None and not (isinstance(at, (list, tuple)) and len(at) == expect.num_stages
                               and all(type(n) is int and 0 <= n < MAX_STEP for n in at)):
        raise BadActivation("malformed", f"forward meta 'at' must list {expect.num_stages} "
                                         f"stage steps")
    (x,) = _tensors(message, 1, "forward")
    if expect.vocab:
        token_ids(x, expect.vocab, expect.max_tokens, "token ids")
    else:
        activation(x, expect.width, expect.max_tokens, "activations")
    return Forward(mb=_mb(meta, "forward"), stage=stage,
                   step=_int(meta, "step", 0, MAX_STEP, "forward"), path=path,
                   trainer=_text(meta, "trainer", MAX_PEER_CHARS, "forward"), model=model,
                   x=x, eval=evaluate, at=None if at is None else tuple(at))


def parse_backward(message: Any, expect: Expect) -> Backward:
    meta = _meta(message, "backward")
    model = _text(meta, "model", MAX_MODEL_CHARS, "backward")
    if model != expect.model:
        raise ModelMismatch(f"this peer trains model {expect.model}, the request is for "
                            f"{model}")
    stage = _int(meta, "stage", 0, MAX_STEP, "backward")
    if stage != expect.stage:
        raise WrongStage(f"this peer serves stage {expect.stage}, not {stage}")
    path = _path(meta, "backward", expect.num_stages)
    (grad,) = _tensors(message, 1, "backward")
    activation(grad, expect.width, expect.max_tokens, "gradient")
    return Backward(mb=_mb(meta, "backward"), stage=stage,
                    step=_int(meta, "step", 0, MAX_STEP, "backward"), path=path,
                    trainer=_text(meta, "trainer", MAX_PEER_CHARS, "backward"), model=model,
                    grad=grad, scale=_scale(meta), overflow=_flag(meta, "overflow", "backward"))


def parse_result(message: Any, *, num_stages: int, shape: tuple[int, ...]) -> Result:
    meta = _meta(message, "result")
    path = _path(meta, "result", num_stages)
    (y,) = _tensors(message, 1, "result")
    _shaped(y, shape, "result")
    return Result(mb=_mb(meta, "result"), path=path, y=y)


def parse_grad(message: Any, *, shape: tuple[int, ...]) -> Grad:
    meta = _meta(message, "grad")
    (g,) = _tensors(message, 1, "grad")
    _shaped(g, shape, "grad")
    return Grad(mb=_mb(meta, "grad"), grad=g, overflow=_flag(meta, "overflow", "grad"))


def parse_abandon(message: Any) -> Abandon:
    meta = _meta(message, "abandon")
    _tensors(message, 0, "abandon")
    return Abandon(mb=_mb(meta, "abandon"))


def parse_step_report(message: Any, *, num_stages: int) -> StepReport:
    """A stage's report (``StepReport``): a stage of this model, a finite squared norm."""
    meta = _meta(message, "step_report")
    _tensors(message, 0, "step_report")
    sqnorm = meta.get("sqnorm")
    if isinstance(sqnorm, bool) or not isinstance(sqnorm, (int, float)) or not (
            math.isfinite(sqnorm) and sqnorm >= 0):
        raise BadActivation("not_finite", "step_report meta 'sqnorm' must be a finite number "
                                          ">= 0")
    return StepReport(step=_int(meta, "step", 0, MAX_STEP, "step_report"),
                      stage=_int(meta, "stage", 0, num_stages, "step_report"),
                      stage_step=_int(meta, "stage_step", 0, MAX_STEP, "step_report"),
                      sqnorm=float(sqnorm),
                      samples=_int(meta, "samples", 0, MAX_STEP, "step_report"),
                      failed=_flag(meta, "failed", "step_report"))


def parse_step_answer(message: Any) -> StepAnswer:
    """The trainer's answer: a coefficient in (0, 1], or None."""
    if getattr(message, "kind", None) != "ok":
        raise BadActivation("reply", f"a step_report is answered with ok, not "
                                     f"{getattr(message, 'kind', None)!r}")
    meta = getattr(message, "meta", None)
    value = meta.get("coefficient") if isinstance(meta, Mapping) else None
    if value is None:
        return StepAnswer(coefficient=None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= 1):
        raise BadActivation("malformed", "a step answer's coefficient must be a number in "
                                         "(0, 1] or null")
    return StepAnswer(coefficient=float(value))


def parse_progress(message: Any) -> TrainerProgress | None:
    """A trainer's progress from its ``ok`` reply (``meta["progress"]``); None when the reply
    tells none (an older trainer). Each field is checked: a step, finite losses, a validation
    loss with its step, a shard ``i/n`` with ``i < n``, an epoch; anything else is refused
    (``BadActivation``, reason ``progress``) and the rest of the reply still counts."""
    meta = getattr(message, "meta", None)
    if not isinstance(meta, Mapping) or meta.get("progress") is None:
        return None
    body = meta["progress"]
    if not isinstance(body, Mapping):
        raise BadActivation("progress", "a trainer's progress must be a map")
    step = _int(body, "step", 0, MAX_STEP, "progress")
    loss, val_loss = _loss(body, "loss"), _loss(body, "val_loss")
    val_step = body.get("val_step")
    if val_step is not None and not (type(val_step) is int and 0 <= val_step < MAX_STEP):
        raise BadActivation("progress", "progress 'val_step' must be a step")
    if (val_loss is None) != (val_step is None):
        raise BadActivation("progress", "progress 'val_loss' goes with 'val_step'")
    epoch = body.get("epoch")
    if epoch is not None and not (type(epoch) is int and 0 <= epoch < MAX_STEP):
        raise BadActivation("progress", "progress 'epoch' must be an integer from 0")
    return TrainerProgress(step=step, loss=loss, val_loss=val_loss, val_step=val_step,
                           shard=_shard(body.get("shard")), epoch=epoch)


def _loss(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and abs(value) < MAX_LOSS):
        raise BadActivation("progress", f"progress {key!r} must be a finite number")
    return float(value)


def is_shard(value: Any) -> bool:
    """Whether ``value`` is ``"i/n"`` with ``0 <= i < n`` (``swarmd.data.order.Shard``), in at
    most ``MAX_SHARD_CHARS`` characters."""
    if not isinstance(value, str) or len(value) > MAX_SHARD_CHARS:
        return False
    index, sep, count = value.partition("/")
    return bool(sep) and index.isascii() and count.isascii() and index.isdigit() and \
        count.isdigit() and int(index) < int(count)


def _shard(value: Any) -> str | None:
    if value is None or is_shard(value):
        return value
    raise BadActivation("progress", "progress 'shard' must be i/n with 0 <= i < n")


def parse_hop_reply(message: Any) -> HopReply:
    """An ``ok`` reply; unusable timings count as not said (the round trip is used)."""
    if getattr(message, "kind", None) != "ok":
        raise BadActivation("reply", f"a forward is answered with ok, not "
                                     f"{getattr(message, 'kind', None)!r}")
    meta = getattr(message, "meta", None)
    meta = meta if isinstance(meta, Mapping) else {}
    service, held, compute, wait = (_seconds(meta.get(k)) for k in (
        "service_s", "held_s", "compute_s", "upload_wait_s"))
    return HopReply(service_s=service, held_s=held, compute_s=compute, upload_wait_s=wait)


def hop_seconds(reply: Any, round_trip_s: float) -> float:
    """``parse_hop_reply(reply).seconds(round_trip_s)``; the round trip for any other reply."""
    try:
        return parse_hop_reply(reply).seconds(round_trip_s)
    except BadActivation:
        return round_trip_s


def token_ids(x: Any, vocab: int, max_tokens: int, what: str) -> None:
    """A (batch, tokens) integer tensor of ids below ``vocab``, at most ``max_tokens`` ids."""
    if not isinstance(x, torch.Tensor):
        raise BadActivation("type", f"{what} must be a tensor")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise BadActivation("shape", f"{what} must be (batch, tokens), got {tuple(x.shape)}")
    if x.shape[0] * x.shape[1] > max_tokens:
        raise BadActivation("too_large", f"{what}: {x.shape[0]}x{x.shape[1]} tokens, at most "
                                         f"{max_tokens} here")
    if x.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise BadActivation("dtype", f"{what} must be integers, got {x.dtype}")
    if int(x.min()) < 0 or int(x.max()) >= vocab:
        raise BadActivation("out_of_range", f"{what} must lie in 0..{vocab - 1}, got "
                                            f"{int(x.min())}..{int(x.max())}")


def activation(x: Any, width: int, max_tokens: int, what: str) -> None:
    """A (batch, tokens, width) floating tensor of at most ``max_tokens`` tokens."""
    if not isinstance(x, torch.Tensor):
        raise BadActivation("type", f"{what} must be a tensor")
    if x.dim() != 3 or x.shape[-1] != width or x.shape[0] < 1 or x.shape[1] < 1:
        raise BadActivation("shape", f"{what} must be (batch, tokens, {width}), got "
                                     f"{tuple(x.shape)}")
    if x.shape[0] * x.shape[1] > max_tokens:
        raise BadActivation("too_large", f"{what} of {x.shape[0]}x{x.shape[1]} tokens, at "
                                         f"most {max_tokens} here")
    if not x.is_floating_point():
        raise BadActivation("dtype", f"{what} must be floating point, got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise BadActivation("not_finite", f"{what} contain NaN or Inf")


# ---- fields ----------------------------------------------------------------------------------
def _meta(message: Any, kind: str) -> Mapping[str, Any]:
    if getattr(message, "kind", None) != kind:
        raise BadActivation("malformed", f"expected a {kind}, got {getattr(message, 'kind', None)!r}")
    meta = getattr(message, "meta", None)
    if not isinstance(meta, Mapping):
        raise BadActivation("malformed", f"{kind} meta must be a map")
    return meta


def _tensors(message: Any, n: int, kind: str) -> tuple[Any, ...]:
    tensors = getattr(message, "tensors", ())
    if not isinstance(tensors, tuple) or len(tensors) != n:
        raise BadActivation("malformed", f"a {kind} carries exactly {n} tensor(s)")
    return tensors


def _shaped(t: Any, shape: tuple[int, ...], kind: str) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise BadActivation("dtype", f"a {kind} carries a floating point tensor")
    if tuple(t.shape) != tuple(shape):
        raise BadActivation("shape", f"a {kind} of shape {tuple(t.shape)}, expected "
                                     f"{tuple(shape)}")


def _text(meta: Mapping[str, Any], key: str, limit: int, kind: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise BadActivation("malformed", f"{kind} meta {key!r} missing or not a string of "
                                         f"1..{limit} characters")
    return value


def _mb(meta: Mapping[str, Any], kind: str) -> str:
    return _text(meta, "mb", MAX_MB_CHARS, kind)


def _int(meta: Mapping[str, Any], key: str, low: int, high: int, kind: str) -> int:
    value = meta.get(key)
    if type(value) is not int or not low <= value < high:
        raise BadActivation("malformed", f"{kind} meta {key!r} missing or not an integer "
                                         f"from {low}")
    return value


def _path(meta: Mapping[str, Any], kind: str, length: int) -> tuple[str, ...]:
    path = meta.get("path")
    if not isinstance(path, (list, tuple)) or len(path) != length:
        raise BadActivation("path", f"a {kind}'s path must list {length} peer(s), one per "
                                    f"stage")
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_CHARS for p in path):
        raise BadActivation("path", f"a {kind}'s path entries must be peer ids")
    if len(set(path)) != len(path):
        raise BadActivation("path", f"a {kind}'s path names a peer twice")
    return tuple(path)


def _scale(meta: Mapping[str, Any]) -> float:
    """A backward's loss scale: a finite number from 2**-24 to 2**32 (1 when not said)."""
    value = meta.get("scale", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and MIN_SCALE <= value <= MAX_SCALE):
        raise BadActivation("malformed", f"backward meta 'scale' must be a number from "
                                         f"{MIN_SCALE} to {MAX_SCALE}")
    return float(value)


def _flag(meta: Mapping[str, Any], key: str, kind: str) -> bool:
    value = meta.get(key, False)
    if not isinstance(value, bool):
        raise BadActivation("malformed", f"{kind} meta {key!r} must be a boolean")
    return value


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0 <= value < MAX_SECONDS else None
