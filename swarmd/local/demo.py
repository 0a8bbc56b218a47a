"""``swarmd demo``: a local swarm that really trains, start to finish, with one command.

Starts ``peers`` daemons as separate processes on 127.0.0.1 (peer i serves stage i mod
``stages``, so every stage is covered), trains ``steps`` steps through them from this process,
prints the status URL of one daemon and progress, stops every daemon, and ends with a summary.
Exits non-zero when the validation loss did not go down. ``--model DIR`` trains a Hugging Face
model directory (``model.hf``) instead of the built-in GPT, ``--data PATH`` other text.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

#: the demo's model, data and threads (the benchmarks' "demo" preset, whose schedule is the
#: configuration's default)
DEMO_MODEL_ENV = {
    # small enough to train visibly in a few minutes on two CPU cores
    "SWARMD_MODEL_WIDTH": "128", "SWARMD_MODEL_LAYERS": "4", "SWARMD_MODEL_HEADS": "4",
    "SWARMD_MODEL_SEQ_LEN": "64", "SWARMD_TRAINING_BATCH_SIZE": "8",
    "SWARMD_TRAINING_LR": "0.003", "SWARMD_DATA_MAX_BYTES": "8388608",
    # 8 held-out batches of 8 x 65 tokens: each evaluation (start, every 100 steps, end) is
    # sequential forwards through the swarm, about 0.1 s each on two shared cores
    "SWARMD_TRAINING_VAL_BATCHES": "8",
    # every process of the demo shares this machine's cores: one torch thread each
    "SWARMD_MODEL_THREADS": "1",
}
#: ``swarmd demo`` (and the tests that train like it): every peer on this machine, where a
#: step's pipeline round trip costs next to nothing, so a step can be small and the demo's
#: loss falls within a minute (``training.microbatches`` is sized for a WAN: docs/pipeline.md,
#: "Exact steps")
DEMO_ENV = {**DEMO_MODEL_ENV, "SWARMD_TRAINING_MICROBATCHES": "4"}


@dataclass(frozen=True)
class DemoResult:
    peers: int
    stages: int
    steps: int
    initial_val_loss: float
    final_val_loss: float
    tokens_per_s: float
    rerouted: int
    restarted: int
    lost: int
    seconds: float
    status_url: str


def model_env(model: Path) -> dict[str, str]:
    """The settings of a demo of the Hugging Face model directory ``model``: ``model.hf``, and
    its tokenizer.json as ``data.tokenizer`` when it has one (else bytes)."""
    from swarmd.models.hf import load_hf_config

    load_hf_config(model)  # a directory that is not a supported model fails here, in one line
    env = {"SWARMD_MODEL_HF": str(model.resolve())}
    if (model / "tokenizer.json").is_file():
        env["SWARMD_DATA_TOKENIZER"] = str((model / "tokenizer.json").resolve())
    return env


def run_demo(*, peers: int, stages: int, steps: int, model: Path | None = None,
             data: Path | None = None, progress: Callable[[str], None] = print) -> DemoResult:
    """``model``: a Hugging Face model directory to train instead of the built-in GPT;
    ``data``: what to train on (default: the Python standard library's sources)."""
    import uvloop

    from swarmd.config import load_config
    from swarmd.local.swarm import DaemonProcess, start_swarm, stop_all
    from swarmd.trainer.run import train

    if stages < 1 or peers < stages:
        raise ValueError(f"a demo needs at least one peer per stage ({peers} peers, "
                         f"{stages} stages)")
    env = {**DEMO_ENV, "SWARMD_SWARM_STAGES": str(stages),
           "SWARMD_SWARM_NAME": f"demo-{secrets.token_hex(4)}",
           **(model_env(Path(model)) if model is not None else {}),
           **({"SWARMD_DATA_PATH": str(Path(data).resolve())} if data is not None else {})}
    with tempfile.TemporaryDirectory(prefix="swarmd-demo-") as root:
        daemons: list[DaemonProcess] = []
        try:
            first, *_ = start_swarm(Path(root), [i % stages for i in range(peers)], env=env,
                                    into=daemons)
            progress(f"{peers} daemons up; watch the swarm at {first.url}")
            config = load_config(None, {**os.environ, **env})
            result = uvloop.run(train(config, bootstrap=[first.addr], steps=steps,
                                      progress=progress))
            rerouted = result.rerouted + sum(
                int(d.get("/api/v0/status")["counters"].get("stage.rerouted", 0))
                for d in daemons if d.proc.poll() is None)
        finally:
            stop_all(daemons)
    return DemoResult(peers=peers, stages=stages, steps=steps,
                      initial_val_loss=result.initial_val_loss,
                      final_val_loss=result.final_val_loss, tokens_per_s=result.tokens_per_s,
                      rerouted=rerouted, restarted=result.restarted, lost=result.lost,
                      seconds=result.seconds, status_url=first.url)
