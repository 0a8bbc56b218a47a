"""Training quality: the swarm against a plain single-process PyTorch loop, in the same run.

    python tools/bench_quality.py --json                         # both presets, loopback
    python tools/bench_quality.py --json --repeats 3             # the issue's figure
    python tools/bench_quality.py --json --preset demo --steps 60
    sudo .venv/bin/python tools/bench_quality.py --json --far    # + the WAN lab's far profile

For each preset and each repeat (``training.seed`` = ``--seed`` + repeat) the same training
runs twice, on the same tokens:

- **reference**: the whole model in one process, float32, no wire, built from the same seam
  with the same seed (so the same initial weights), fed the very batches the trainer draws
  (the same ``make_batches`` of the same configuration, in the same order), ``microbatches``
  of them summed into each step's mean gradient, ``torch.nn.utils.clip_grad_norm_`` over the
  whole model at ``training.grad_clip``, ``torch.optim.AdamW`` (or swarmd's LAMB) at
  ``training.lr`` and ``weight_decay``, the learning rate of ``swarmd.training.optim.lr_at``
  through ``LambdaLR``; evaluated on the trainer's held-out batches every ``eval_every`` steps
  and at the end;
- **swarm**: a local swarm of 2 stages (one ``swarmd join`` per stage; with ``--far``, also
  the same through the WAN lab's ``far`` profile, stages and trainer on three lab hosts), and
  ``swarmd train`` in its own process, with **default settings** apart from the preset's model
  and the run's length (int8 on the wire, the default schedule); its own validation losses
  (through the wire, as it reports them), and the final weights the daemons saved on shutdown
  and the trainer's state evaluated here in float32 (``export_val_loss``: what the swarm
  produced, without the wire's rounding).

Reported per run: the validation curves, ``ratio`` (swarm / reference final validation loss at
equal tokens), ``export_ratio``, each stage's optimizer steps against the trainer's steps,
lost/restarted, and ``data``: how fast the data pipeline prepares batches against how fast the
swarm consumed them. ``summary``: per preset and link the mean ratio over the repeats; targets
(issue 24): <= 1.01 on loopback for both presets, <= 1.02 on ``far``; the reference's own
curve must have settled (its validation loss changed by less than 1% over the last tenth of
the run: ``reference_settled``), else the run was too short to say anything.

With ``--set SWARMD_MODEL_BOUNDARY_RANK=R`` the swarm trains the model with a learned
low-rank stage boundary (docs/compression.md); the reference stays the plain model (the
ratio is compressed against float32 plain at equal tokens).

``--noise N`` (default 2) also runs the reference N more times with every gradient perturbed by
a relative 1e-6 (rounding's size, seeded): a small model's trajectory can land a few percent
apart on float noise alone (the demo preset's seed 1: 2.0%), so each run also reports
``ratio_to_noisy_mean`` (swarm / the mean of the reference's runs) and the reference's
``spread``; ``first_step_apart``, ``train_losses`` and ``grad_norms`` show where the two first
differ.

Presets: ``demo`` (the built-in GPT of ``swarmd demo``: width 128, 4 layers, 64-token
sequences, batch 8, lr 3e-3) and ``llama`` (the ~19M-parameter Llama of
``tools/bench_pipeline.py``, from a ``LlamaConfig``: width 512, 6 layers; seq 64, batch 4,
lr 1e-3). Both warm up over the run's first tenth and then follow a cosine schedule that
ends at its last step (``training.warmup_steps``, ``training.decay_steps``: the run's length),
so the reference settles within the run; everything else is the configuration's default
(64 microbatches a step, exact steps, int8 on the wire, the whole model's clipping). Every daemon is
stopped in a ``finally``; the lab tears itself down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

#: swarm / reference final validation loss at equal tokens (issue 24)
TARGETS = {"loopback": 1.01, "far": 1.02}
#: the reference has settled when its validation loss moved less than this over the last tenth
SETTLED = 0.01
STAGES = 2
#: the relative size of ``--noise``'s perturbation of the reference's gradients: about float32
#: rounding's, what summing the same microbatches in another order changes
NOISE = 1e-6
#: (steps, evaluate every) of each preset
RUN = {"demo": (60, 6), "llama": (40, 4)}
#: a swarm run is stopped after this long
TRAIN_LIMIT_S = 3600.0


#: the setting of a learned low-rank stage boundary: the reference is always the plain model
BOUNDARY_KEY = "SWARMD_MODEL_BOUNDARY_RANK"


def say(text: str) -> None:
    print(f"[bench_quality] {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Preset:
    name: str
    env: dict[str, str]
    steps: int
    eval_every: int
    #: trainers feeding the swarm (``--trainers``): trainer i reads data shard i/n
    trainers: int = 1

    def shard_env(self, i: int) -> dict[str, str]:
        """The settings of trainer ``i`` (its data shard when there are several)."""
        return self.env if self.trainers == 1 else {
            **self.env, "SWARMD_DATA_SHARD": f"{i}/{self.trainers}"}


def preset(name: str, root: Path, steps: int | None, seed: int,
           overrides: dict[str, str], trainers: int = 1) -> Preset:
    """The preset's settings: its model, a cosine schedule over the run, the seed; nothing
    about the schedule of the pipeline (those stay at their defaults) unless ``overrides``."""
    from bench_pipeline import LLAMA_ENV, llama_dir

    from swarmd.local.demo import DEMO_MODEL_ENV

    default_steps, every = RUN[name]
    steps = steps or default_steps
    env = dict(DEMO_MODEL_ENV) if name == "demo" else {
        **LLAMA_ENV, "SWARMD_MODEL_HF": str(llama_dir(root))}
    env.update({"SWARMD_SWARM_STAGES": str(STAGES), "SWARMD_TRAINING_SEED": str(seed),
                "SWARMD_TRAINING_LR_SCHEDULE": "cosine",
                "SWARMD_TRAINING_DECAY_STEPS": str(steps),
                "SWARMD_TRAINING_WARMUP_STEPS": str(max(1, steps // 10)),
                "SWARMD_TRAINING_EVAL_EVERY": str(min(every, steps)),
                "SWARMD_SWARM_NAME": f"bench-quality-{secrets.token_hex(4)}", **overrides})
    return Preset(name, env, steps, min(every, steps), trainers)


def plain(p: Preset) -> Preset:
    """``p`` without a low-rank stage boundary (``--set SWARMD_MODEL_BOUNDARY_RANK=R``
    changes the swarm's model; the reference it is compared with stays the plain one)."""
    return Preset(p.name, {k: v for k, v in p.env.items() if k != BOUNDARY_KEY}, p.steps,
                  p.eval_every, p.trainers)


def load(env: dict[str, str]) -> Any:
    from swarmd.config import load_config

    return load_config(None, {**os.environ, **env})


def batches_of(config: Any, tokenizer: Any) -> Any:
    """The trainer's batches for ``config``, as ``swarmd train`` makes them for a trainer
    alone in its swarm (shard 0 of 1): the same held-out batches, the same order. Close it
    (a context manager: batches are made ahead on a thread)."""
    from swarmd.models.registry import model_seam_of
    from swarmd.training.batches import make_batches

    seq_len = min(config.model.seq_len, model_seam_of(config)[0].max_seq_len)
    data = make_batches(config, tokenizer, data_path=None, batch=config.training.batch_size,
                        seq_len=seq_len, val_batches=config.training.val_batches,
                        say=lambda line: say(f"data: {line}"))
    data.place("bench-quality-reference", [])
    return data


# ---- the reference: one process ----------------------------------------------------------

def evaluate(model: Any, val: list[Any]) -> float:
    import torch

    with torch.no_grad():
        return sum(float(model(x, y)[1]) for x, y in val) / len(val)


def reference(p: Preset, perturb: int = 0) -> dict[str, Any]:
    """The plain loop (module doc), its validation curve and its time. ``perturb`` k > 0:
    every gradient multiplied elementwise by ``1 + NOISE * N(0, 1)`` (a generator seeded with
    k) before the clipping: the loop's own sensitivity to differences of float rounding's
    size, which any other order of summation (a swarm's) also makes."""
    config, tokenizer, model = reference_model(p)
    t = config.training
    params, opt, sched = reference_optimizer(model, t)
    with contextlib.ExitStack() as stack:
        shards = [stack.enter_context(batches_of(load(p.shard_env(i)), tokenizer))
                  for i in range(p.trainers)]
        return _reference_loop(p, t, model, params, opt, sched, shards, perturb)


def reference_model(p: Preset) -> tuple[Any, Any, Any]:
    """(the preset's configuration, its tokenizer, the whole model in one process with the
    swarm's initial weights), torch set up as the reference runs."""
    from swarmd.models.registry import model_seam_of
    import torch

    from bench_pipeline import whole_model

    config = load(p.env)
    seam, tokenizer = model_seam_of(config)
    # one thread, as each process of the swarm (model.threads): on 2 shared cores torch's
    # default two threads spin-wait for each other, 30x slower under load
    torch.set_num_threads(max(1, config.model.threads))
    torch.manual_seed(config.training.seed)
    return config, tokenizer, whole_model(seam, STAGES, config.training.seed)


def reference_optimizer(model: Any, t: Any) -> tuple[list[Any], Any, Any]:
    """The reference's trainable parameters, optimizer and lr schedule: what the swarm's
    ``[training]`` settings ``t`` make of them."""
    import torch

    from swarmd.training.optim import Lamb, lr_at

    params = [q for q in model.parameters() if q.requires_grad]
    decay = {} if t.weight_decay is None else {"weight_decay": t.weight_decay}
    opt = (torch.optim.AdamW(params, lr=t.lr, **decay) if t.optimizer == "adamw"
           else Lamb(params, lr=t.lr, **decay))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(
        s, t.lr, schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
        decay_steps=t.decay_steps) / t.lr)
    return params, opt, sched


def _reference_loop(p: Preset, t: Any, model: Any, params: list[Any], opt: Any, sched: Any,
                    shards: list[Any], perturb: int = 0) -> dict[str, Any]:
    """Each step takes ``microbatches`` batches: from each trainer's shard its share (the
    swarm's trainers split a step equally: ``swarmd.trainer.shares``)."""
    import torch

    batches = shards[0]
    share = t.microbatches // len(shards)
    draws = [b.next for b in shards for _ in range(share)]
    noise = torch.Generator().manual_seed(perturb)
    curve = [(0, evaluate(model, batches.val))]
    losses: list[float] = []
    norms: list[float] = []
    t0 = time.monotonic()
    for step in range(1, p.steps + 1):
        opt.zero_grad(set_to_none=True)
        samples, total = 0, 0.0
        for draw in draws:
            x, y = draw()
            _, loss = model(x, y)
            (loss * x.shape[0]).backward()  # sums over samples, as the swarm's gradients
            samples += x.shape[0]
            total += loss.item() * x.shape[0]
        for q in params:
            if q.grad is not None:
                q.grad /= samples
                if perturb:
                    q.grad *= 1 + NOISE * torch.randn(q.grad.shape, generator=noise)
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip or float("inf"))
        norms.append(float(norm))
        opt.step()
        sched.step()
        losses.append(total / samples)
        if step % p.eval_every == 0 or step == p.steps or step == round(0.9 * p.steps):
            curve.append((step, evaluate(model, batches.val)))
    seconds = time.monotonic() - t0
    at90 = dict(curve).get(round(0.9 * p.steps))
    final = curve[-1][1]
    return {"val_curve": curve, "final_val_loss": final, "initial_val_loss": curve[0][1],
            "train_loss_last_tenth": _mean(losses[-max(1, p.steps // 10):]),
            "train_losses": losses, "grad_norms": norms,
            "settled_change_last_tenth": None if at90 is None else abs(final - at90) / at90,
            "tokens_per_microbatch": batches.val[0][0].numel(),
            "tokens": p.steps * t.microbatches * batches.val[0][0].numel(),
            "seconds": seconds}


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def data_rate(p: Preset, n: int = 500) -> dict[str, float]:
    """Batches the data pipeline prepares per second (``TrainData.measure_rate``)."""
    from swarmd.models.registry import model_seam_of
    config = load(p.env)
    _, tokenizer = model_seam_of(config)
    with batches_of(config, tokenizer) as batches:
        rate = batches.measure_rate(n)
    return {"batches_per_s": rate.batches_per_s}


# ---- the swarm ---------------------------------------------------------------------------

def swarm_weights_loss(p: Preset, stage_homes: list[Path], trainer_home: Path) -> float:
    """The final weights the stage daemons saved on shutdown and the trainer's state, put
    together into one model here and evaluated in float32 on the held-out batches."""
    from swarmd.models.registry import model_seam_of
    from bench_pipeline import whole_model
    from swarmd.state.checkpoint import checkpoint_dir, load_checkpoint
    from swarmd.state import trainer_state

    config = load(p.env)
    seam, tokenizer = model_seam_of(config)
    model = whole_model(seam, STAGES, config.training.seed)
    for i, home in enumerate(stage_homes):
        state = load_checkpoint(checkpoint_dir(home), i)
        if state is None:
            raise RuntimeError(f"stage {i} left no checkpoint in {home}")
        model.stages[i].load_state_dict(dict(state.params))
    saved = trainer_state.load(trainer_home)
    if saved is None:
        raise RuntimeError(f"the trainer left no state in {trainer_home}")
    model.parts.load_state_dict(saved.params)
    with batches_of(config, tokenizer) as batches:
        return evaluate(model, batches.val)


def _metrics(home: Path) -> list[dict[str, Any]]:
    path = home / "train-metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _counters(get: Callable[[str], Any]) -> dict[str, int]:
    c = get("/api/v0/status")["counters"]
    return {k: int(c.get(f"stage.{k}", 0)) for k in (
        "optimizer_steps", "late_samples", "stepped_samples", "dropped_stale", "busy")}


def swarm_loopback(p: Preset, root: Path) -> dict[str, Any]:
    """2 stage daemons on 127.0.0.1, ``swarmd train`` in its own process."""
    from swarmd.local.swarm import DaemonProcess, stop_all

    daemons: list[DaemonProcess] = []
    trainer_home = root / "trainer"
    try:
        first = DaemonProcess(root / "stage0", "--stage", "0", env=p.env)
        daemons.append(first)
        first.wait_started()
        second = DaemonProcess(root / "stage1", "--stage", "1", "--bootstrap", first.addr,
                               env=p.env)
        daemons.append(second)
        second.wait_started()
        homes = [trainer_home] + [root / f"trainer{i}" for i in range(1, p.trainers)]
        results = _train_all(p, homes, first.addr, lambda cmd, **kw: subprocess.Popen(
            cmd, **kw))
        counters = [_counters(d.get) for d in daemons]
    finally:
        stop_all(daemons, seconds=60.0)
    run = _swarm_result(p, results[0], counters, [root / "stage0", root / "stage1"],
                        trainer_home)
    run["trainers"] = [{k: r.get(k) for k in ("microbatches", "steps_exact", "trainer_rounds",
                                             "final_val_loss", "lost")} for r in results]
    return run


def swarm_far(p: Preset, root: Path) -> dict[str, Any]:
    """The same through the WAN lab's ``far`` profile (50 ms one way, 100 Mbit/s): stage 0,
    stage 1 and the trainer on hosts of their own."""
    from bench_wan import link_of
    from tools.wanlab import HostSpec, WanLab
    from tools.wanlab import daemons as lab_daemons

    link = link_of("far")
    trainer_home = root / "trainer"
    with WanLab(hosts=[HostSpec(name=h) for h in ("s0", "s1", "tr")]) as lab:
        for h in lab.hosts:
            lab.set_link(h, rate_down=link.down_mbit, rate_up=link.up_mbit,
                         delay_ms=link.delay_ms, loss=0.0)
        started: list[Any] = []
        try:
            s0 = lab_daemons.LabDaemon(lab, "s0", root / "s0", "--stage", "0", env=p.env)
            started.append(s0)
            s0.wait_started()
            s1 = lab_daemons.LabDaemon(lab, "s1", root / "s1", "--stage", "1", "--bootstrap",
                                       s0.addr, env=p.env)
            started.append(s1)
            s1.wait_started()
            result = _train(p, trainer_home, s0.addr, lambda cmd, **kw: lab.run(
                "tr", cmd, **kw), listen=f"/ip4/{lab.addr('tr')}/tcp/0")
            counters = [_counters(d.get) for d in started]
        finally:
            lab_daemons.stop_all(started, seconds=60.0)
    return _swarm_result(p, result, counters, [root / "s0", root / "s1"], trainer_home)


def _train(p: Preset, home: Path, bootstrap: str, spawn: Callable[..., Any],
           listen: str = "/ip4/127.0.0.1/tcp/0") -> dict[str, Any]:
    return _train_all(p, [home], bootstrap, spawn, listen)[0]


def _train_all(p: Preset, homes: list[Path], bootstrap: str, spawn: Callable[..., Any],
               listen: str = "/ip4/127.0.0.1/tcp/0") -> list[dict[str, Any]]:
    """``swarmd train`` in each home at once (trainer i on data shard i/n), to the end."""
    procs = []
    try:
        for i, home in enumerate(homes):
            home.mkdir(parents=True, exist_ok=True)
            with open(home / "train.stderr", "w") as err:
                procs.append(spawn(
                    [sys.executable, "-m", "swarmd", "train", "--home", str(home), "--json",
                     "--bootstrap", bootstrap, "--steps", str(p.steps), "--listen", listen],
                    stdout=subprocess.PIPE, stderr=err, text=True, cwd=home,
                    env={**os.environ, "SWARMD_LOG_LEVEL": "warning", **p.shard_env(i)}))
        deadline = time.monotonic() + TRAIN_LIMIT_S
        outs = []
        for proc, home in zip(procs, homes):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"swarmd train did not finish within {TRAIN_LIMIT_S:.0f} s")
            if proc.returncode != 0:
                raise RuntimeError(f"swarmd train failed ({proc.returncode}):\n"
                                   f"{(home / 'train.stderr').read_text()[-3000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        return outs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _swarm_result(p: Preset, result: dict[str, Any], counters: list[dict[str, int]],
                  stage_homes: list[Path], trainer_home: Path) -> dict[str, Any]:
    lines = _metrics(trainer_home)
    curve = [(0, result["initial_val_loss"])] + [
        (x["step"], x["val_loss"]) for x in lines if "val_loss" in x and x["step"] > 0]
    if not curve or curve[-1][0] != result["steps"]:
        curve.append((result["steps"], result["final_val_loss"]))
    train = [x["loss"] for x in lines if "loss" in x]
    norms = [x.get("grad_norm") for x in lines if "loss" in x]
    return {"val_curve": curve, "final_val_loss": result["final_val_loss"],
            "initial_val_loss": result["initial_val_loss"],
            "export_val_loss": swarm_weights_loss(p, stage_homes, trainer_home),
            "train_loss_last_tenth": _mean(train[-max(1, len(train) // 10):]),
            "train_losses": train, "grad_norms": norms,
            "trainer_steps": result["steps"],
            # steps every part took with the whole model's clipping coefficient (the others
            # clipped per part: a stage's report came too late, or samples were mixed)
            "exact_steps": sum(1 for x in lines
                               if "loss" in x and x.get("clip_coefficient") is not None),
            "stage_optimizer_steps": [c["optimizer_steps"] for c in counters],
            "stage_lateness_steps": [c["late_samples"] / max(1, c["stepped_samples"])
                                     for c in counters],
            "stage_dropped_stale": [c["dropped_stale"] for c in counters],
            "tokens_per_s": result["tokens_per_s"], "rerouted": result["rerouted"],
            "restarted": result["restarted"], "lost": result["lost"],
            "seconds": result["seconds"]}


# ---- the benchmark -----------------------------------------------------------------------

def one_repeat(name: str, seed: int, links: list[str], steps: int | None,
               overrides: dict[str, str], noise: int = 0, trainers: int = 1
               ) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-quality-") as tmp:
        root = Path(tmp)
        p = preset(name, root, steps, seed, overrides, trainers)
        say(f"{name} seed {seed}: reference, {p.steps} steps")
        ref = reference(plain(p))
        say(f"{name} seed {seed}: reference {ref['initial_val_loss']:.4f} -> "
            f"{ref['final_val_loss']:.4f} in {ref['seconds']:.0f} s")
        noisy = []
        for k in range(1, noise + 1):
            say(f"{name} seed {seed}: reference with its gradients perturbed by {NOISE:g} "
                f"({k} of {noise})")
            noisy.append(reference(plain(p), perturb=k)["final_val_loss"])
        finals = [ref["final_val_loss"], *noisy]
        ref["noise"] = {"perturbed_final_val_losses": noisy, "mean_final_val_loss":
                        _mean(finals), "spread": (max(finals) - min(finals)) / min(finals)}
        rate = data_rate(p)
        runs = []
        for link in links:
            say(f"{name} seed {seed}: swarm on {link}")
            run = (swarm_loopback if link == "loopback" else swarm_far)(p, root / link)
            consumed = run["tokens_per_s"] / ref["tokens_per_microbatch"]
            run.update({"preset": name, "seed": seed, "link": link, "steps": p.steps,
                        "reference": ref,
                        "first_step_apart": first_step_apart(run["train_losses"],
                                                             ref["train_losses"]),
                        "ratio": run["final_val_loss"] / ref["final_val_loss"],
                        "ratio_to_noisy_mean": run["final_val_loss"]
                        / ref["noise"]["mean_final_val_loss"],
                        "export_ratio": run["export_val_loss"] / ref["final_val_loss"],
                        "data": {**rate, "swarm_batches_per_s": consumed,
                                 "prepared_vs_consumed": rate["batches_per_s"]
                                 / max(1e-9, consumed)}})
            say(f"{name} seed {seed} {link}: swarm {run['final_val_loss']:.4f} (exported "
                f"weights {run['export_val_loss']:.4f}), ratio {run['ratio']:.4f}; stage steps "
                f"{run['stage_optimizer_steps']} for {run['trainer_steps']} trainer steps, "
                f"{run['exact_steps']} exact; restarted {run['restarted']}, lost {run['lost']}")
            runs.append(run)
        return runs


def first_step_apart(swarm: list[float], ref: list[float], rel: float = 1e-3) -> int | None:
    """The first step (from 1) whose training loss differs from the reference's by more than
    ``rel`` (relative); None when every step agrees. The same batches on the same initial
    weights: before this step the two computed the same thing up to rounding (and the wire's
    codec), so what differs is in this step or the one before."""
    for i, (a, b) in enumerate(zip(swarm, ref)):
        if abs(a - b) > rel * abs(b):
            return i + 1
    return None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in runs:
        out.setdefault(f"{r['preset']}/{r['link']}", []).append(r)
    summary = {}
    for key, rs in out.items():
        link = key.split("/")[1]
        ratio = _mean([r["final_val_loss"] for r in rs]) / _mean(
            [r["reference"]["final_val_loss"] for r in rs])
        settled = [r["reference"]["settled_change_last_tenth"] for r in rs]
        noisy = _mean([r["reference"]["noise"]["mean_final_val_loss"] for r in rs])
        summary[key] = {
            "ratio_of_means": ratio, "ratios": [r["ratio"] for r in rs],
            # against the reference's mean over its perturbed runs too (``--noise``): a
            # single trajectory of a small model can land a few percent apart on float noise
            "ratio_to_noisy_means": _mean([r["final_val_loss"] for r in rs]) / noisy,
            "reference_spreads": [r["reference"]["noise"]["spread"] for r in rs],
            "export_ratios": [r["export_ratio"] for r in rs],
            "reference_settled": all(s is not None and s < SETTLED for s in settled),
            "stages_step_once_per_trainer_step": all(
                all(n == r["trainer_steps"] for n in r["stage_optimizer_steps"]) for r in rs),
            "lost": sum(r["lost"] for r in rs),
            "target": TARGETS[link], "met": ratio <= TARGETS[link],
            "met_against_noisy_means": _mean([r["final_val_loss"] for r in rs]) / noisy
            <= TARGETS[link]}
    return summary


def measure(presets: list[str], links: list[str], repeats: int, seed: int,
            steps: int | None, overrides: dict[str, str], noise: int = 0,
            trainers: int = 1) -> dict[str, Any]:
    t0 = time.monotonic()
    runs = []
    for rep in range(repeats):
        for name in presets:
            runs += one_repeat(name, seed + rep, links, steps, overrides, noise, trainers)
    config = load(overrides)
    summary = summarize(runs)
    return {"runs": runs, "summary": summary,
            "targets": {k: v["met"] for k, v in summary.items()},
            "defaults": {"schedule": getattr(config.training, "schedule", "pipelined"),
                         "microbatches": config.training.microbatches,
                         "step_drains": config.serving.step_drains,
                         "codec": config.wire.codec, "grad_clip": config.training.grad_clip},
            "overrides": overrides, "repeats": repeats, "noise": noise, "noise_size": NOISE,
            "trainers": trainers,
            "cores": os.cpu_count(),
            "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preset", choices=("demo", "llama", "both"), default="both")
    parser.add_argument("--steps", type=int, help="steps per run (default: the preset's, "
                        + ", ".join(f"{k} {v[0]}" for k, v in RUN.items()) + ")")
    parser.add_argument("--repeats", type=int, default=1, help="seeds per preset")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--noise", type=int, default=2, metavar="N",
                        help="also run the reference N times with its gradients perturbed by "
                             f"{NOISE:g} (relative): its own spread on float noise (default 2)")
    parser.add_argument("--far", action="store_true",
                        help="also through the WAN lab's far profile (root)")
    parser.add_argument("--far-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], metavar="SWARMD_KEY=VALUE",
                        help="a setting for the swarm and the reference alike (experiments: "
                             "the figures count for the defaults)")
    parser.add_argument("--trainers", type=int, default=1,
                        help="trainers feeding the swarm together, trainer i reading data "
                             "shard i/n; the reference's steps take each shard's share "
                             "(loopback only; default 1)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.noise < 0 or (args.steps is not None and args.steps < 10):
        parser.error("--repeats must be at least 1, --noise at least 0 and --steps at least 10")
    overrides = dict(s.split("=", 1) for s in args.set)
    microbatches = load(overrides).training.microbatches
    if args.trainers < 1 or microbatches % args.trainers or (args.trainers > 1 and (
            args.far or args.far_only)):
        parser.error(f"--trainers must divide training.microbatches ({microbatches}), and "
                     f"several trainers run on loopback only")
    presets = ["demo", "llama"] if args.preset == "both" else [args.preset]
    links = ["far"] if args.far_only else ["loopback"] + (["far"] if args.far else [])
    result = measure(presets, links, args.repeats, args.seed, args.steps, overrides,
                     args.noise, args.trainers)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
