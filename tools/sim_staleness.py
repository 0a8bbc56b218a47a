"""Delayed gradients in one process: what staleness and weight prediction cost, without a swarm.

    python tools/sim_staleness.py --json                           # sync, 16 in flight at 0, 1, 1.5 x
    python tools/sim_staleness.py --json --in-flight 8 --gains 0,1 --steps 200 --stages-only
    python tools/sim_staleness.py --json --stages-only --gains 1 --beta1 0.8,0.7   # late runs' beta1
    python tools/sim_staleness.py --json --stages-only --gains 1 --momentum 0.5    # beta1 by lateness
    python tools/sim_staleness.py --json --late-stage 0 --in-flight 5 --gains 0 --dc 0,1000

The whole demo model (built as the swarm builds it: same seed, same initial weights, AdamW at
the demo's learning rate) trains on the batches ``train()`` draws. Microbatch ``i`` of a run
with ``N`` in flight and ``M`` microbatches per step is computed on the weights of the step
when it would have been sent (the steps whose ``M`` microbatches had all come back, i.e. ``d``
steps before the one that applies its gradient), as the stages' weight stashing does, with the
forward on the weights predicted ``gain x d`` steps ahead along the change of the step before it
was sent (what a stage knows at a forward; until 2026-12-01 this used the latest step's change,
known only at the backward, which made prediction look far better than it is) (linear
weight prediction; ``gain`` 0: none). ``--stages-only`` keeps the trainer's parts (embedding,
head) current, as in the swarm. Reports the validation loss on fixed held-out batches and its
ratio to the synchronous run (no delay; so is any ``N <= M``). Deterministic: one seed, one thread.
``--beta1`` (Adam's beta1 of the late runs), ``--momentum K`` (beta1 lowered each step by its
gradients' mean lateness, ``stale_beta1``) and ``--lr-scale`` screen staleness compensations
(docs/pipeline.md, "Momentum reduction"); ``--dc L`` delay compensation (DC-ASGD, Zheng et al.
2017: a late gradient g plus L x g*g*(w_now - w_then)), ``--late-lr F`` a lower lr for the
late weights only; ``--late-stage K`` makes only stage K late, ``--lr`` sets the base learning
rate of every run (docs/pipeline.md, "What a late gradient costs"). Every late stage is modelled
as equally late (5 in flight, 4 a step: one step late; 16: 3.75), where the swarm at 16 in
flight measured stage 0 1.4-2.1 steps and stage 1 0.25 late.
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

VAL_BATCHES = 8


def stale_beta1(base: float, lateness: float, *, k: float) -> float:
    """Momentum reduction under staleness ("Asynchrony begets momentum", Mitliagkas et al.
    2016): beta1 = 1 - (1 - base) x (1 + k x lateness), at least 0 (measured, not adopted:
    docs/pipeline.md)."""
    return base if lateness <= 0 or k <= 0 else max(0.0, 1 - (1 - base) * (1 + k * lateness))


def run(steps: int, in_flight: int, gain: float, *, stages_only: bool, seed: int,
        beta1: float | None = None, lr_scale: float = 1.0, momentum: float = 0.0,
        dc: float = 0.0, late_lr: float = 1.0, late_stage: int | None = None,
        lr: float | None = None) -> float:
    from swarmd.models.registry import model_seam_of

    import torch

    from bench_pipeline import whole_model
    from swarmd.config import load_config
    from swarmd.training.data import load_corpus
    from swarmd.training.optim import lr_at, make_optimizer

    config = load_config(None, _env(lr))
    seam, _ = model_seam_of(config)
    seq = min(config.model.seq_len, seam.max_seq_len)
    batch, per_step = config.training.batch_size, config.training.microbatches
    corpus = load_corpus(Path(config.data.path) if config.data.path else None,
                         max_bytes=config.data.max_bytes, seq_len=seq)
    model = whole_model(seam, config.swarm.stages, config.training.seed)
    names = [n for n, _ in model.named_parameters()]
    prefix = "stages." if late_stage is None else f"stages.{late_stage}."
    late = [n for n in names if not (stages_only or late_stage is not None)
            or n.startswith(prefix)]
    delayed = in_flight > per_step
    groups = [{"params": [p for n, p in model.named_parameters() if n not in late]},
              {"params": [p for n, p in model.named_parameters() if n in late],
               "factor": late_lr if delayed else 1.0}]
    optimizer = make_optimizer(config.training.optimizer,
                               [g for g in groups if g["params"]],  # type: ignore[misc]
                               config.training.lr * lr_scale,
                               weight_decay=config.training.weight_decay)
    if beta1 is not None:
        for group in optimizer.param_groups:
            group["betas"] = (beta1, group["betas"][1])
    draw = torch.Generator().manual_seed(config.training.seed + seed)
    val_draw = torch.Generator().manual_seed(123)
    val = [corpus.sample_batch("val", batch, seq, val_draw) for _ in range(VAL_BATCHES)]
    by_part: dict[str, list[torch.nn.Parameter]] = {}
    for n, p in model.named_parameters():
        by_part.setdefault(".".join(n.split(".")[:2]) if n.startswith("stages.") else "", []
                           ).append(p)
    parts = list(by_part.values())

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    history = {0: weights()}
    base_beta1 = optimizer.param_groups[0]["betas"][0]
    for step in range(steps):
        lateness = 0.0
        for j in range(per_step):
            x, y = corpus.sample_batch("train", batch, seq, draw)
            i = step * per_step + j
            sent_at = step if in_flight <= per_step else \
                min(step, max(0, i - in_flight + 1) // per_step)
            d = step - sent_at
            lateness += d / per_step
            w = {n: p.detach() for n, p in model.named_parameters()}
            for n in late:
                w[n] = history[sent_at][n]
                if gain and d and sent_at >= 1:  # what the stage knew then: its last step
                    w[n] = w[n] + (gain * d) * (history[sent_at][n] - history[sent_at - 1][n])
            params = {n: t.clone().requires_grad_(True) for n, t in w.items()}
            _, loss = torch.func.functional_call(model, params, (x, y))
            grads = list(torch.autograd.grad(loss / per_step, [params[n] for n in names]))
            if dc and d:
                _compensate(grads, names, late, dict(model.named_parameters()),
                            history[sent_at], dc, per_step)
            for (_, p), g in zip(model.named_parameters(), grads):
                p.grad = g if p.grad is None else p.grad + g
        if momentum:
            for group in optimizer.param_groups:
                group["betas"] = (stale_beta1(base_beta1, lateness, k=momentum),
                                  group["betas"][1])
        if config.training.grad_clip > 0:  # each stage and the trainer clip their own part
            for part in parts:
                torch.nn.utils.clip_grad_norm_(part, config.training.grad_clip)
        for group in optimizer.param_groups:  # the trainer's and the stages' schedule
            group["lr"] = group.get("factor", 1.0) * lr_at(step, config.training.lr * lr_scale,
                                schedule=config.training.lr_schedule,
                                warmup_steps=config.training.warmup_steps,
                                decay_steps=config.training.decay_steps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history[step + 1] = weights()
        for k in [k for k in history if k < step + 1 - (in_flight // per_step + 2)]:
            del history[k]
    with torch.no_grad():
        return sum(float(model(x, y)[1]) for x, y in val) / len(val)


def _env(lr: float | None) -> dict[str, str]:
    from bench_pipeline import bench_env

    return {**os.environ, **bench_env("demo"),
            **({} if lr is None else {"SWARMD_TRAINING_LR": str(lr)})}


def _compensate(grads: list[Any], names: list[str], late: list[str], live: dict[str, Any],
                then: dict[str, Any], dc: float, per_step: int) -> None:
    """DC-ASGD in place: each late weight's gradient (of the microbatch's mean loss, here
    divided by ``per_step``) plus ``dc`` x g * g * (the weights now - those it was computed
    on), the diagonal outer-product estimate of the Hessian times the weights' change."""
    for k, n in enumerate(names):
        if n in late:
            g = grads[k] * per_step
            grads[k] = (g + dc * g * g * (live[n].detach() - then[n])) / per_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--gains", default="0,1,1.5", help="comma-separated prediction gains")
    parser.add_argument("--stages-only", action="store_true",
                        help="only the stages' weights are late (the trainer's parts current)")
    parser.add_argument("--seed", type=int, default=0, help="offset of the data order's seed")
    parser.add_argument("--beta1", default="", help="comma-separated Adam beta1 of the late runs")
    parser.add_argument("--momentum", default="",
                        help="comma-separated k of the stale-momentum rule (stale_beta1)")
    parser.add_argument("--lr-scale", type=float, default=1.0, help="lr factor of the late runs")
    parser.add_argument("--dc", default="", help="comma-separated DC-ASGD lambdas")
    parser.add_argument("--late-lr", type=float, default=1.0,
                        help="lr factor of the late weights only, in the late runs")
    parser.add_argument("--late-stage", type=int, default=None,
                        help="only this stage's weights are late")
    parser.add_argument("--lr", type=float, default=None, help="base lr (default: the demo's)")
    args = parser.parse_args(argv)
    gains = [float(g) for g in args.gains.split(",") if g]
    if args.steps < 1 or args.in_flight < 1 or any(g < 0 for g in gains):
        parser.error("--steps and --in-flight must be at least 1, gains not negative")
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    t0 = time.monotonic()
    from swarmd.config import load_config

    per_step = load_config(None, _env(args.lr)).training.microbatches
    sync = run(args.steps, per_step, 0.0, stages_only=args.stages_only, seed=args.seed,
               lr=args.lr)
    betas = [float(b) for b in args.beta1.split(",") if b] or [None]
    ks = [float(k) for k in args.momentum.split(",") if k] or [0.0]
    dcs = [float(x) for x in args.dc.split(",") if x] or [0.0]
    runs = [{"in_flight": args.in_flight, "gain": g, "beta1": b, "momentum": k, "dc": dc,
             "lr_scale": args.lr_scale, "late_lr": args.late_lr, "late_stage": args.late_stage,
             "val_loss": (v := run(args.steps, args.in_flight, g,
                                   stages_only=args.stages_only, seed=args.seed, beta1=b,
                                   lr_scale=args.lr_scale, momentum=k, dc=dc,
                                   late_lr=args.late_lr, late_stage=args.late_stage,
                                   lr=args.lr)),
             "ratio_vs_sync": v / sync} for g in gains for b in betas for k in ks for dc in dcs]
    result: dict[str, Any] = {"steps": args.steps, "stages_only": args.stages_only,
                              "lr": args.lr,
                              "seed": args.seed, "sync_val_loss": sync, "runs": runs,
                              "seconds": time.monotonic() - t0}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
