"""What a wire codec alone costs the loss: ``bench_quality``'s plain single-process loop, with
every pipeline hop's tensors (forward activations and their gradients, both directions)
passed through a codec's encode and decode, in one process.

    python tools/bench_wire_loss.py --json --variants none,int8,int2
    python tools/bench_wire_loss.py --preset demo --variants int2,int2:grad-stochastic
    python tools/bench_wire_loss.py --preset demo --variants none,int8:rank=32,int4:rank=32

A variant is a codec name (``transport/codecs.py``, e.g. ``int2``, ``int4+zstd``), optionally
followed by ``:stochastic`` (stochastic rounding both ways) or ``:grad-stochastic``
(stochastic rounding for the gradients only), ``:center`` (the codec's channel centring),
``:center-activations`` (centring for the activations only, as the swarm's int2 default),
``:fwd0-stochastic`` (the trainer's embeddings, hop 0's forward, rounded stochastically),
``:block=N`` (the codec's block size), ``:forward-only`` or ``:backward-only`` (the codec on
one direction, float32 on the other), ``:ef`` (error feedback: what the codec lost of a hop's
tensor is added to the same hop's next tensor in that direction, in training), and by
``:channels`` (each channel divided by its
RMS over the tokens before the codec, and multiplied back after: an experiment, no codec
sends such scales), by ``:rotate`` (each token's channels multiplied by random signs and a
normalised Hadamard matrix before the codec, and rotated back after: an orthogonal map that
spreads a channel's outliers over all channels, as QuaRot does before low-bit quantisation; an
experiment, no codec does it; the width must be a power of two), by ``:fwd-hops=I+J``
(the forward through the codec at those hops only, 0 the trainer's to stage 0, the last the
last stage's to the trainer; every gradient still through it), and by ``:rank=R``: the model with a learned low-rank boundary
(``model.boundary_rank = R``, ``swarmd.models.boundary``), so every hop carries R values a
token through the codec (``none:rank=32``: the boundary alone, float32 on the wire), and by
``:frozen`` (with ``:rank=R``: the projections kept at their initial random orthonormal
basis, not trained: an experiment, no setting does it). The
``none`` run, the reference of every ratio, is always the plain model. Hops: trainer -> stage 0 -> ... -> last stage -> trainer, as
``bench_quality``'s swarm (``STAGES`` stages); hop 0 carries token ids, not through any codec,
for a model whose stage 0 holds the embedding (``ModelSeam.stage0_embeds``: the Llama preset
since 2026-12-06); validation goes through the forward hops too,
as the swarm's trainer reports it. Same seed, same batches, same weights as ``bench_quality``'s
reference, so ``ratio`` (variant / ``none`` final validation loss) isolates the codec. Faster
than a swarm run (no processes, no network), it is how variants were screened; the swarm's own
figures come from ``bench_quality.py --set SWARMD_WIRE_CODEC=...``.

One seed says little: the demo preset's final loss moves by a few percent on any perturbation
(a relative 1e-6 on the reference's gradients moves it by 2%, and int8, whose error is a
hundredth of int2's, lands anywhere from 1% below to 5% above float32 depending on the seed).
``--seeds N`` runs every variant on seeds ``seed .. seed+N-1``, ``--noise N`` runs the ``none``
reference N more times per seed with its gradients perturbed as ``bench_quality --noise`` does,
and ``--jobs N`` runs N of those single-threaded runs at once. ``summary`` gives, per variant,
the ratio of its mean final loss over the seeds to ``none``'s (``ratio_of_means``), to the mean
of every reference run, perturbed ones included (``ratio_to_noisy_means``), and each seed's
ratio; ``paired_to`` compares each variant with another variant seed by seed
(``--paired-to int8``: the loss it costs against the default codec).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


#: issue 26's figure: validation loss through a compressed wire / through float32, at most
TARGET = 1.02


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
                  rotate: bool = False, feedback: bool = False) -> Any:
    """An autograd function: the forward tensor and its gradient each through a codec. With
    ``feedback`` (one hop's function: it keeps state), error feedback in training: what the
    codec lost of a hop's tensor (each direction's) is added to that hop's next tensor before
    it is encoded; evaluations go through the codec alone."""
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

    #: per direction, what the codec lost of the last tensor sent (``feedback``)
    lost: dict[str, torch.Tensor] = {}

    def fed_back(x: torch.Tensor, spec: Any, direction: str, training: bool) -> torch.Tensor:
        if not (feedback and training and spec is not None):
            return through(x, spec)
        carried = lost.get(direction)
        if carried is not None and carried.shape == x.shape:
            x = x + carried
        y = through(x, spec)
        lost[direction] = x - y
        return y

    class Wire(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, training: bool) -> torch.Tensor:
            ctx.training = training
            return fed_back(x.detach(), forward_spec, "forward", training)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return fed_back(grad.contiguous(), backward_spec, "backward", ctx.training), None

    return lambda x: Wire.apply(x, torch.is_grad_enabled())


def variant_specs(variant: str) -> tuple[Any, Any, bool]:
    from transport.codecs import CodecSpec

    name, *options = variant.split(":")
    options = [o for o in options if not o.startswith(("rank=", "fwd-hops=")) and o != "frozen"]
    blocks = [o for o in options if o.startswith("block=")]
    unknown = (set(options) - {"stochastic", "grad-stochastic", "channels", "center",
                                "center-activations", "forward-only", "backward-only",
                                "rotate", "fwd0-stochastic", "ef"} - set(blocks))
    if unknown:
        raise SystemExit(f"unknown variant options {sorted(unknown)} in {variant!r}")
    if name == "none":
        return None, None, "channels" in options
    common: dict[str, Any] = {"center": True} if "center" in options else {}
    if blocks:
        common["block_size"] = int(blocks[-1].split("=")[1])
    stochastic = "stochastic" in options
    forward = CodecSpec.parse(name, **common, **({"rounding": "stochastic"} if stochastic else {}),
                              **({"center": True} if "center-activations" in options else {}))
    backward = CodecSpec.parse(name, **common, **(
        {"rounding": "stochastic"} if stochastic or "grad-stochastic" in options else {}))
    if "forward-only" in options:
        backward = None
    if "backward-only" in options:
        forward = None
    return forward, backward, "channels" in options


def variant_forward_hops(variant: str) -> set[int] | None:
    """The hops of ``:fwd-hops=I+J`` (0: trainer -> stage 0, ..., the last: last stage ->
    trainer), the only ones whose forward goes through the codec; None: every hop."""
    named = [o for o in variant.split(":")[1:] if o.startswith("fwd-hops=")]
    if not named:
        return None
    try:
        return {int(h) for h in named[-1].split("=")[1].split("+") if h}
    except ValueError:
        raise SystemExit(f"fwd-hops takes hop numbers joined by +, not {named[-1]!r}") from None


def variant_rank(variant: str) -> int:
    """The ``:rank=R`` of a variant, 0 when it has none."""
    ranks = [o for o in variant.split(":")[1:] if o.startswith("rank=")]
    return int(ranks[-1].split("=")[1]) if ranks else 0


def run(preset_name: str, variant: str, steps: int | None, seed: int,
        perturb: int = 0) -> dict[str, Any]:
    """One training run of ``variant``; ``perturb`` (``none`` only): the reference's gradients
    perturbed as ``bench_quality``'s ``--noise`` runs, with that generator seed."""
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-wire-loss-") as tmp:
        return _run_in(Path(tmp), preset_name, variant, steps, seed, perturb)


def _run_in(root: Path, preset_name: str, variant: str, steps: int | None, seed: int,
            perturb: int) -> dict[str, Any]:
    from bench_quality import (BOUNDARY_KEY, _reference_loop, batches_of, evaluate, preset,
                               reference_model, reference_optimizer)

    rank = variant_rank(variant)
    p = preset(preset_name, root, steps, seed, {BOUNDARY_KEY: str(rank)} if rank else {})
    config, tokenizer, model = reference_model(p)
    t = config.training
    forward_spec, backward_spec, channels = variant_specs(variant)
    rotate = "rotate" in variant.split(":")[1:]
    ef = "ef" in variant.split(":")[1:]

    def hop(forward: Any) -> Any:  # one per hop: error feedback keeps a hop's own state
        if not (forward or backward_spec or channels):
            return lambda h: h
        return wire_function(forward, backward_spec, channels, rotate, ef)

    forward_hops = variant_forward_hops(variant)
    per_hop = [hop(forward_spec if forward_hops is None or i in forward_hops else None)
               for i in range(len(model.stages) + 1)]
    if "fwd0-stochastic" in variant.split(":")[1:] and forward_spec and (
            forward_hops is None or 0 in forward_hops):
        per_hop[0] = hop(replace(forward_spec, rounding="stochastic"))

    def forward(x: Any, y: Any) -> tuple[None, Any]:
        h = model.parts.embed(x)
        if h.is_floating_point():  # token ids (stage 0 holds the embedding) go as they are
            h = per_hop[0](h)
        for i, stage in enumerate(model.stages, 1):
            h = per_hop[i](stage(h))
        return None, model.parts.loss(model.parts.head(h), y)

    model.forward = forward  # type: ignore[method-assign]
    if "frozen" in variant.split(":")[1:]:
        for part in (model.parts, *model.stages):
            for side in ("down", "up"):
                getattr(part, side).requires_grad_(False)
    params, opt, sched = reference_optimizer(model, t)
    with batches_of(config, tokenizer) as batches:
        out = _reference_loop(p, t, model, params, opt, sched, [batches], perturb=perturb)
        # the trained weights with nothing on the wire: the model that is taken out of the
        # swarm (``swarmd export``) is evaluated so, while the trainer's validation (the
        # figure) goes through the codec's forward hops as the swarm's does; a run whose
        # hops send float32 already measured exactly that
        if forward_spec or channels:
            per_hop[:] = [lambda h: h] * len(per_hop)
            out["final_val_loss_float32_hops"] = evaluate(model, batches.val)
        else:
            out["final_val_loss_float32_hops"] = out["final_val_loss"]
    width = config.model.width if rank else None
    return {"preset": preset_name, "variant": variant, "seed": seed, "perturb": perturb,
            "boundary_rank": rank,
            "values_per_token_vs_plain": rank / width if width else 1.0, **out}


def _die_with_parent() -> None:
    """A ``--jobs`` worker ends when the tool does, however it was stopped (a killed tool left
    its workers training for the better part of an hour once): Linux's PR_SET_PDEATHSIG."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a worker outlives a killed tool, as before


def _run_alone(job: tuple[str, str, int | None, int, int]) -> dict[str, Any]:
    """``run`` in a worker process, on one thread (``--jobs``: runs side by side)."""
    import torch

    torch.set_num_threads(1)
    return run(*job)


def summarize(runs: list[dict[str, Any]], paired_to: str | None = None) -> dict[str, Any]:
    """Per variant: its final losses over the seeds against ``none``'s (unperturbed, and every
    reference run), and seed by seed against ``paired_to``'s."""
    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    final: dict[tuple[str, int], float] = {
        (r["variant"], r["seed"]): r["final_val_loss"] for r in runs if not r["perturb"]}
    unwired: dict[tuple[str, int], float] = {
        (r["variant"], r["seed"]): r["final_val_loss_float32_hops"] for r in runs
        if not r["perturb"] and "final_val_loss_float32_hops" in r}
    seeds = sorted({r["seed"] for r in runs})
    out: dict[str, Any] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        # the means over the seeds this variant ran (and none with it)
        ran = [s for s in seeds if (variant, s) in final and ("none", s) in final]
        mine = [final[(variant, s)] for s in ran]
        m = mean(mine)
        base = mean([final[("none", s)] for s in ran])
        noisy = mean([r["final_val_loss"] for r in runs
                      if r["variant"] == "none" and r["seed"] in ran])
        entry: dict[str, Any] = {
            "seeds": ran, "final_val_losses": mine, "mean_final_val_loss": m,
            "ratios": [final[(variant, s)] / final[("none", s)] for s in ran],
            "ratio_of_means": m / base if m and base else None,
            "ratio_to_noisy_means": m / noisy if m and noisy else None}
        plain = [unwired[(variant, s)] for s in ran if (variant, s) in unwired]
        if plain and len(plain) == len(ran) and base:
            # the same weights evaluated with float32 hops, against none's (which has none)
            entry["ratio_of_means_float32_hops"] = mean(plain) / base
        if paired_to and paired_to != variant:
            pairs = [final[(variant, s)] / final[(paired_to, s)] for s in seeds
                     if (variant, s) in final and (paired_to, s) in final]
            entry["paired_to"] = {"variant": paired_to, "ratios": pairs,
                                  "mean_ratio": mean(pairs)}
        out[variant] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preset", choices=("demo", "llama"), default="demo")
    parser.add_argument("--variants", default="none,int8,int2",
                        help="comma-separated variants (module doc); ratios are to none's "
                        "loss when it is one of them")
    parser.add_argument("--steps", type=int, help="steps per run (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="run every variant on N seeds from --seed (default 1)")
    parser.add_argument("--noise", type=int, default=0, metavar="N",
                        help="run the none reference N more times per seed, its gradients "
                        "perturbed (bench_quality's --noise; default 0)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="N single-threaded runs at once (default 1: one run at a time, "
                        "on torch's threads)")
    parser.add_argument("--paired-to", metavar="VARIANT",
                        help="also compare each variant with this one, seed by seed")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or args.seeds < 1 or args.noise < 0 or args.jobs < 1:
        parser.error("give at least one variant; --seeds and --jobs at least 1, --noise at "
                     "least 0")
    if args.noise and "none" not in variants:
        parser.error("--noise perturbs the none reference: add none to --variants")
    if args.paired_to and args.paired_to not in variants:
        parser.error(f"--paired-to {args.paired_to}: not one of --variants")
    for v in variants:
        variant_specs(v)  # a bad variant stops here, before any run
        variant_forward_hops(v)
    jobs = [(args.preset, v, args.steps, seed, 0)
            for seed in range(args.seed, args.seed + args.seeds) for v in variants]
    jobs += [(args.preset, "none", args.steps, seed, k)
             for seed in range(args.seed, args.seed + args.seeds)
             for k in range(1, args.noise + 1)]
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []

    def done(r: dict[str, Any]) -> None:
        runs.append(r)
        print(f"[bench_wire_loss] {r['preset']} seed {r['seed']} {r['variant']}"
              f"{' perturbed %d' % r['perturb'] if r['perturb'] else ''}: final val loss "
              f"{r['final_val_loss']:.4f}", file=sys.stderr, flush=True)

    if args.jobs == 1:
        for job in jobs:
            done(run(*job))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_die_with_parent) as pool:
            for future in as_completed([pool.submit(_run_alone, job) for job in jobs]):
                done(future.result())
    runs.sort(key=lambda r: (r["seed"], variants.index(r["variant"]), r["perturb"]))
    summary = summarize(runs, args.paired_to)
    report = {"runs": runs, "summary": summary,
              "ratios": {v: s["ratio_of_means"] for v, s in summary.items()},
              # issue 26: a compressed wire within TARGET of float32's loss at equal tokens
              "targets": {v: s["ratio_of_means"] is not None and s["ratio_of_means"] <= TARGET
                          for v, s in summary.items() if v != "none"},
              "seconds": time.monotonic() - t0}
    if args.json:
        print(json.dumps(report))
    else:
        for v, s in summary.items():
            paired = s.get("paired_to")
            print(f"{v:28s} mean {s['mean_final_val_loss']:.4f}  ratio of means "
                  f"{s['ratio_of_means']}  to noisy means {s['ratio_to_noisy_means']}  per seed "
                  f"{[round(x, 4) for x in s['ratios']]}"
                  + (f"  / {paired['variant']} {paired['mean_ratio']}" if paired else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
