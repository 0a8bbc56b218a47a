"""Restarts that resume, through real daemons.

A whole swarm and its trainer killed with SIGKILL while training, then restarted with the same
homes and ``--stage auto``: each daemon serves its checkpoint's stage again from that
checkpoint (the step and weights saved in its home, not the initial ones), the trainer resumes
from its saved state, and nothing is lost. The daemon of the last stage comes back first and
alone, where the bottleneck rule alone would pick a stage at random.

A daemon whose home holds a stage's checkpoint but is placed on another stage (that one had no
peer) offers the checkpoint to its old stage's peer, which started from the initial weights
and takes it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon_harness import ROOT, DaemonProcess, start_swarm, stop_all, wait_until
from test_models_swarm import swarmd_train, text_data
from swarmd.local.zygote import swarmd_popen
from swarmd.models.registry import model_hash_of, model_seam_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # four daemon starts and a run

ENV = {"SWARMD_SWARM_STAGES": "2", "SWARMD_SWARM_NAME": "restart-swarm",
       "SWARMD_MODEL_THREADS": "1", "SWARMD_MODEL_WIDTH": "32", "SWARMD_MODEL_LAYERS": "2",
       "SWARMD_MODEL_HEADS": "2", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_TRAINING_BATCH_SIZE": "4", "SWARMD_TRAINING_MICROBATCHES": "2",
       "SWARMD_TRAINING_WARMUP_STEPS": "0", "SWARMD_CHECKPOINT_EVERY_STEPS": "1",
       "SWARMD_TRAINING_VAL_BATCHES": "2", "SWARMD_TRAINING_EVAL_EVERY": "0"}
STEPS = 3


def checkpoint(home: Path, stage: int) -> Any:
    from swarmd.state.checkpoint import checkpoint_dir, load_checkpoint

    return load_checkpoint(checkpoint_dir(home), stage)


def saved_step(home: Path, stage: int) -> int:
    state = checkpoint(home, stage)
    return -1 if state is None else state.step


def weights_digest(config: Any, stage: int, params: dict[str, torch.Tensor]) -> str:
    """What a daemon serving ``stage`` with these weights reports as ``params_digest``
    (``Stepper.fingerprint``: its parameters' bytes in module order)."""
    from swarmd.models.gpt import tensor_bytes

    module = model_seam_of(config)[0].build_stage(stage, config.swarm.stages)
    h = hashlib.blake2b(digest_size=16)
    for name, _ in module.named_parameters():
        h.update(tensor_bytes(params[name]))
    return h.hexdigest()


def test_a_swarm_and_its_trainer_killed_with_sigkill_resume_from_their_saved_state(
        tmp_path: Path) -> None:
    from swarmd.config import load_config
    from swarmd.state import trainer_state

    config = load_config(None, ENV)
    data = text_data(tmp_path / "data")
    trainer_home = tmp_path / "trainer"
    daemons: list[Any] = []
    trainer = None
    trainer_err = open(tmp_path / "trainer.stderr", "w")
    try:
        first, _ = start_swarm(tmp_path, [None, None], env=ENV, into=daemons)
        # both placed by --stage auto, the second through the first as soon as that one says
        # it started: one on each stage (on one stage both, nothing would ever train)
        stages = wait_until(lambda: sorted((d.home, d.get("/api/v0/stage")["stage"])
                                           for d in daemons), 60, "both daemons' stages")
        assert sorted(s for _, s in stages) == [0, 1], [d.stderr()[-2000:] for d in daemons]
        trainer = swarmd_popen(
            ["train", "--home", str(trainer_home), "--json",
             "--bootstrap", first.addr, "--data", str(data), "--steps", "10000"],
            stdout=subprocess.DEVNULL, stderr=trainer_err, text=True, cwd=ROOT,
            env={**os.environ, **ENV})
        try:
            wait_until(lambda: (trainer_state.load(trainer_home) or _NoState).step >= STEPS
                       and all(saved_step(h, s) >= STEPS for h, s in stages), 240,
                       f"the trainer and both stages saved at step {STEPS} or later")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the trainer's stderr ends with:\n"
                                 f"{(tmp_path / 'trainer.stderr').read_text()[-3000:]}") from None
        for process in [trainer, *(d.proc for d in daemons)]:  # all at once, mid-training
            process.send_signal(signal.SIGKILL)
        trainer.wait(30)
        stop_all(daemons)
        daemons.clear()

        saved = {home: checkpoint(home, stage) for home, stage in stages}
        trained = trainer_state.load(trainer_home)
        assert trained is not None and trained.step >= STEPS
        homes = sorted(saved, key=lambda h: -saved[h].stage)  # the last stage's first
        again = DaemonProcess(homes[0], env=ENV)
        daemons.append(again)
        again.wait_started()
        other = DaemonProcess(homes[1], "--bootstrap", again.addr, env=ENV)
        daemons.append(other)
        other.wait_started()
        for d in daemons:
            state = saved[d.home]
            now = wait_until(lambda d=d: (s := d.get("/api/v0/stage"))["state"] == "online"
                             and s, 120, f"{d.home.name} serving again")
            assert now["stage"] == state.stage, d.stderr()[-3000:]
            assert f"placed on stage {state.stage} (its checkpoint's stage)" in d.stderr()
            assert now["state_from"] == "checkpoint" and now["step"] == state.step, now
            # its weights are the checkpoint's, not the initial ones
            assert now["params_digest"] == weights_digest(config, state.stage, state.params)
            assert state.step > 0

        out = swarmd_train(trainer_home, ENV, "--bootstrap", again.addr, "--data", str(data),
                           "--steps", str(trained.step + 2))
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["resumed_from"] == trained.step and result["steps"] == trained.step + 2
        assert result["lost"] == 0
        assert f"resumed from step {trained.step}" in out.stderr + out.stdout
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
        trainer_err.close()
        stop_all(daemons)


class _NoState:
    step = -1


def test_a_daemon_placed_away_from_its_checkpoint_offers_it_to_that_stages_peer(
        tmp_path: Path) -> None:
    from swarmd.config import load_config
    from swarmd.state.checkpoint import checkpoint_dir, save_checkpoint
    from swarmd.state.encoding import capture
    from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer

    env = {**ENV, "SWARMD_SWARM_NAME": "offer-swarm", "SWARMD_BALANCING_ENABLED": "false"}
    config = load_config(None, env)
    # the moved daemon's home: a checkpoint of stage 0 at step 7, trained weights
    module = model_seam_of(config)[0].build_stage(0, 2, seed=config.training.seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.01)
    optimizer = SwarmOptimizer(module.parameters(), OptimSettings.from_config(config.training))
    state = capture(module, optimizer, stage=0, step=7, model_hash=model_hash_of(config))
    save_checkpoint(checkpoint_dir(tmp_path / "moved"), state)
    expected = weights_digest(config, 0, state.params)
    daemons: list[Any] = []
    try:
        fresh = DaemonProcess(tmp_path / "fresh", "--stage", "0", env=env)  # initial weights
        daemons.append(fresh)
        fresh.wait_started()
        assert fresh.get("/api/v0/stage")["step"] == 0
        moved = DaemonProcess(tmp_path / "moved", "--bootstrap", fresh.addr, env=env)
        daemons.append(moved)
        moved.wait_started()
        assert moved.get("/api/v0/stage")["stage"] == 1  # stage 1 had nobody
        assert "offering this home's checkpoint of stage 0 (step 7)" in moved.stderr()
        now = wait_until(lambda: (s := fresh.get("/api/v0/stage"))["step"] == 7 and s, 60,
                         "the stage-0 peer taking the offered checkpoint")
        assert now["params_digest"] == expected
        counters = fresh.get("/api/v0/status")["counters"]
        assert counters["state.offers_taken"] == 1, counters
    finally:
        stop_all(daemons)
