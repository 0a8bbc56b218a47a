"""What a wire codec alone costs the loss: ``bench_quality``'s plain single-process loop, with
every pipeline hop's tensors (forward activations and their gradients, both directions)
passed through a codec's encode and decode, in one process.

    python tools/bench_wire_loss.py --json --variants none,int8,int2
    python tools/bench_wire_loss.py --preset demo --variants int2,int2:grad-stochastic
    python tools/bench_wire_loss.py --preset demo --variants none,int8:rank=32,int4:rank=32

A variant is a codec name (``transport/codecs.py``, e.g. ``int2``, ``int4+zstd``), optionally
followed by ``:stochastic`` (stochastic rounding both ways) or ``:grad-stochastic``
(stochastic rounding for the gradients only), ``:center`` (the codec's channel centring),
``:block=N`` (the codec's block size), ``:forward-only`` or ``:backward-only`` (the codec on
one direction, float32 on the other), and by ``:channels`` (each channel divided by its
RMS over the tokens before the codec, and multiplied back after: an experiment, no codec
sends such scales), by ``:rotate`` (each token's channels multiplied by random signs and a
normalised Hadamard matrix before the codec, and rotated back after: an orthogonal map that
spreads a channel's outliers over all channels, as QuaRot does before low-bit quantisation; an
experiment, no codec does it; the width must be a power of two), and by ``:rank=R``: the model with a learned low-rank boundary
(``model.boundary_rank = R``, ``swarmd.models.boundary``), so every hop carries R values a
token through the codec (``none:rank=32``: the boundary alone, float32 on the wire), and by
``:frozen`` (with ``:rank=R``: the projections kept at their initial random orthonormal
basis, not trained: an experiment, no setting does it). The
``none`` run, the reference of every ratio, is always the plain model. Hops: trainer -> stage 0 -> ... -> last stage -> trainer, as
``bench_quality``'s swarm (``STAGES`` stages); validation goes through the forward hops too,
as the swarm's trainer reports it. Same seed, same batches, same weights as ``bench_quality``'s
reference, so ``ratio`` (variant / ``none`` final validation loss) isolates the codec. Faster
than a swarm run (no processes, no network), it is how variants were screened; the swarm's own
figures come from ``bench_quality.py --set SWARMD_WIRE_CODEC=...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def hadamard_rotation(width: int, seed: int = 0) -> Any:
    """(signs, H / sqrt(width)): x -> (x * signs) @ R is orthogonal, undone by
    (y @ R) * signs (R is symmetric and its own inverse)."""
    import torch

    if width < 1 or width & (width - 1):
        raise SystemExit(f":rotate needs a width that is a power of two, not {width}")
    h = torch.ones(1, 1)
    while h.shape[0] < width:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (width,), generator=g).float() * 2 - 1
    return signs, h / width ** 0.5


def wire_function(forward_spec: Any, backward_spec: Any, channels: bool,
                  rotate: bool = False) -> Any:
    """An autograd function: the forward tensor and its gradient each through a codec."""
    import torch

    from transport.codecs import decode, encode
    from transport.limits import Limits

    limits = Limits(max_tensor_bytes=1 << 34, max_message_bytes=1 << 34)

    def through(x: torch.Tensor, spec: Any) -> torch.Tensor:
        if spec is None:
            return x
        if rotate:
            signs, r = hadamard_rotation(x.shape[-1])
            y = through_plain((x * signs) @ r, spec)
            return (y @ r) * signs
        return through_plain(x, spec)

    def through_plain(x: torch.Tensor, spec: Any) -> torch.Tensor:
        scale = None
        if channels:
            flat = x.reshape(-1, x.shape[-1])
            scale = flat.pow(2).mean(0).sqrt_().clamp_min_(1e-30)
            x = x / scale
        encoded = encode(x, spec)
        y = decode(encoded.meta(), memoryview(bytearray(b"".join(encoded.parts))), limits)
        return y * scale if scale is not None else y

    class Wire(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return through(x.detach(), forward_spec)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return through(grad.contiguous(), backward_spec)

    return Wire.apply


def variant_specs(variant: str) -> tuple[Any, Any, bool]:
    from transport.codecs import CodecSpec

    name, *options = variant.split(":")
    options = [o for o in options if not o.startswith("rank=") and o != "frozen"]
    blocks = [o for o in options if o.startswith("block=")]
    unknown = (set(options) - {"stochastic", "grad-stochastic", "channels", "center",
                                "forward-only", "backward-only", "rotate"} - set(blocks))
    if unknown:
        raise SystemExit(f"unknown variant options {sorted(unknown)} in {variant!r}")
    if name == "none":
        return None, None, "channels" in options
    common: dict[str, Any] = {"center": True} if "center" in options else {}
    if blocks:
        common["block_size"] = int(blocks[-1].split("=")[1])
    stochastic = "stochastic" in options
    forward = CodecSpec.parse(name, **common, **({"rounding": "stochastic"} if stochastic else {}))
    backward = CodecSpec.parse(name, **common, **(
        {"rounding": "stochastic"} if stochastic or "grad-stochastic" in options else {}))
    if "forward-only" in options:
        backward = None
    if "backward-only" in options:
        forward = None
    return forward, backward, "channels" in options


def variant_rank(variant: str) -> int:
    """The ``:rank=R`` of a variant, 0 when it has none."""
    ranks = [o for o in variant.split(":")[1:] if o.startswith("rank=")]
    return int(ranks[-1].split("=")[1]) if ranks else 0


def run(preset_name: str, variant: str, steps: int | None, seed: int) -> dict[str, Any]:
    from bench_quality import (BOUNDARY_KEY, _reference_loop, batches_of, preset,
                               reference_model, reference_optimizer)

    root = Path(os.environ.get("TMPDIR", "/tmp")) / "swarmd-bench-wire-loss"
    root.mkdir(exist_ok=True)
    rank = variant_rank(variant)
    p = preset(preset_name, root, steps, seed, {BOUNDARY_KEY: str(rank)} if rank else {})
    config, tokenizer, model = reference_model(p)
    t = config.training
    forward_spec, backward_spec, channels = variant_specs(variant)
    rotate = "rotate" in variant.split(":")[1:]
    hop = (wire_function(forward_spec, backward_spec, channels, rotate)
           if forward_spec or backward_spec or channels else (lambda h: h))

    def forward(x: Any, y: Any) -> tuple[None, Any]:
        h = hop(model.parts.embed(x))
        for stage in model.stages:
            h = hop(stage(h))
        return None, model.parts.loss(model.parts.head(h), y)

    model.forward = forward  # type: ignore[method-assign]
    if "frozen" in variant.split(":")[1:]:
        for part in (model.parts, *model.stages):
            for side in ("down", "up"):
                getattr(part, side).requires_grad_(False)
    params, opt, sched = reference_optimizer(model, t)
    with batches_of(config, tokenizer) as batches:
        out = _reference_loop(p, t, model, params, opt, sched, [batches])
    width = config.model.width if rank else None
    return {"preset": preset_name, "variant": variant, "seed": seed, "boundary_rank": rank,
            "values_per_token_vs_plain": rank / width if width else 1.0, **out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preset", choices=("demo", "llama"), default="demo")
    parser.add_argument("--variants", default="none,int8,int2",
                        help="comma-separated variants (module doc); ratios are to none's "
                        "loss when it is one of them")
    parser.add_argument("--steps", type=int, help="steps per run (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    t0 = time.monotonic()
    runs = []
    for variant in variants:
        runs.append(run(args.preset, variant, args.steps, args.seed))
        print(f"[bench_wire_loss] {args.preset} {variant}: final val loss "
              f"{runs[-1]['final_val_loss']:.4f}", file=sys.stderr, flush=True)
    base = next((r["final_val_loss"] for r in runs if r["variant"] == "none"), None)
    report = {"runs": runs, "ratios": {r["variant"]: r["final_val_loss"] / base if base else None
                                       for r in runs},
              "seconds": time.monotonic() - t0}
    if args.json:
        print(json.dumps(report))
    else:
        for r in runs:
            print(f"{r['variant']:28s} {r['final_val_loss']:.4f}  {report['ratios'][r['variant']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
