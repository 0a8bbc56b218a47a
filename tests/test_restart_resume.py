"""A whole swarm killed with SIGKILL and restarted with the same homes and ``--stage auto``:
each daemon serves its checkpoint's stage again and resumes from that checkpoint (its step and
its weights), not from the initial weights. The daemon of the last stage comes back first and
alone, where the bottleneck rule alone would pick a stage at random."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from daemon_harness import DaemonProcess, start_swarm, stop_all, wait_until
from test_models_swarm import swarmd_train, text_data

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # four daemon starts and a run

ENV = {"SWARMD_SWARM_STAGES": "2", "SWARMD_SWARM_NAME": "restart-swarm",
       "SWARMD_MODEL_THREADS": "1", "SWARMD_MODEL_WIDTH": "32", "SWARMD_MODEL_LAYERS": "2",
       "SWARMD_MODEL_HEADS": "2", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_TRAINING_BATCH_SIZE": "4", "SWARMD_TRAINING_MICROBATCHES": "2",
       "SWARMD_TRAINING_WARMUP_STEPS": "0", "SWARMD_CHECKPOINT_EVERY_STEPS": "1"}
STEPS = 3


def saved_step(home: Path, stage: int) -> int:
    from swarmd.state.checkpoint import checkpoint_dir, load_checkpoint

    state = load_checkpoint(checkpoint_dir(home), stage)
    return -1 if state is None else state.step


def test_a_swarm_killed_and_restarted_resumes_every_stage_from_its_checkpoint(
        tmp_path: Path) -> None:
    data = text_data(tmp_path / "data")
    daemons: list[Any] = []
    try:
        first, _ = start_swarm(tmp_path, [None, None], env=ENV, into=daemons)
        out = swarmd_train(tmp_path / "trainer", ENV, "--bootstrap", first.addr, "--data",
                           str(data), "--steps", str(STEPS))
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["lost"] == 0
        before = {d.home: d.get("/api/v0/stage") for d in daemons}
        assert sorted(s["stage"] for s in before.values()) == [0, 1]
        assert all(s["step"] == STEPS for s in before.values()), before
        for home, stage in before.items():
            wait_until(lambda: saved_step(home, stage["stage"]) == STEPS, 60,
                       f"the checkpoint of stage {stage['stage']} at step {STEPS}")
        for d in daemons:  # the whole swarm dies at once
            d.signal(signal.SIGKILL)
        stop_all(daemons)
        daemons.clear()

        homes = sorted(before, key=lambda h: -before[h]["stage"])  # the last stage's first
        again = DaemonProcess(homes[0], env=ENV)
        daemons.append(again)
        again.wait_started()
        other = DaemonProcess(homes[1], "--bootstrap", again.addr, env=ENV)
        daemons.append(other)
        other.wait_started()
        for d in daemons:
            old = before[d.home]
            now = wait_until(lambda d=d: (s := d.get("/api/v0/stage"))["state"] == "online"
                             and s, 120, f"{d.home.name} serving again")
            assert now["stage"] == old["stage"], d.stderr()[-3000:]
            assert f"placed on stage {old['stage']} (its checkpoint's stage)" in d.stderr()
            assert now["state_from"] == "checkpoint" and now["step"] == STEPS, now
            assert now["params_digest"] == old["params_digest"]  # its weights, not initial
    finally:
        stop_all(daemons)
