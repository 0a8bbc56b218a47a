"""Preemption: a stage peer that gets SIGTERM during training leaves within
``node.shutdown_grace_s`` (issue 15, item 3), through real ``swarmd join`` processes on
127.0.0.1 and a real trainer in this process.

It announces ``leaving``, refuses new forwards with ``busy`` (its stage's other peer takes
them), lets the microbatches in flight finish or hands them back, saves its checkpoint and
exits 0; the trainer loses nothing and restarts at most what that peer held."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvloop

from daemon_harness import DaemonProcess, start_swarm, stop_all, wait_until
from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.state.checkpoint import load_checkpoint
from swarmd.trainer.run import train
from swarmd.local.zygote import swarmd_popen

pytestmark = pytest.mark.integration

GRACE_S = 5.0
ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "preemption-test",
       "SWARMD_AVERAGING_TIMEOUT_S": "8", "SWARMD_NODE_SHUTDOWN_GRACE_S": str(GRACE_S)}
#: what the leaving peer logs once its microbatches finished or were handed back
HELD = re.compile(r"leaving stage 1: (\d+) microbatch\(es\) were in flight here, (\d+) handed "
                  r"back")


def _last_metrics(path: Path) -> dict[str, Any] | None:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    return json.loads(lines[-1]) if lines and lines[-1].endswith("}") else None


class _Preempter:
    """Sends SIGTERM to ``victim`` once the trainer has done ``after_steps`` steps and waits
    for it to exit (at most the grace plus 2 s); what it saw, for the test to check."""

    def __init__(self, victim: DaemonProcess, metrics: Path, after_steps: int) -> None:
        self.victim, self.metrics, self.after_steps = victim, metrics, after_steps
        self.restarted_before: int | None = None
        self.exit_status: int | None = None
        self.exit_s: float | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Preempter:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._thread.join(GRACE_S + 10)

    def _run(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = _last_metrics(self.metrics)
            if line is not None and "loss" in line and line["step"] >= self.after_steps:
                self.restarted_before = line["restarted"]
                _until_holding(self.victim)  # so that it has something to finish
                t0 = time.monotonic()  # a deadline of the feature, not a benchmark
                self.victim.signal(signal.SIGTERM)
                try:
                    self.exit_status = self.victim.wait(GRACE_S + 2)
                    self.exit_s = time.monotonic() - t0
                except subprocess.TimeoutExpired:
                    self.error = f"still running {GRACE_S + 2:.0f} s after SIGTERM"
                return
            time.sleep(0.02)
        self.error = f"the trainer never reached step {self.after_steps}"


def _until_holding(victim: DaemonProcess) -> None:
    """Until ``victim`` holds a microbatch (or 10 s passed: then go on anyway)."""
    until = time.monotonic() + 10
    while time.monotonic() < until:
        try:
            if victim.get("/api/v0/status")["counters"].get("stage.in_flight"):
                return
        except OSError:  # answering slowly under load: ask again
            pass


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A stage-0 peer and the stage-1 peer that stays, shared by the two tests (two daemon
    starts fewer), and ``victim(root)``: a stage-1 peer to stop, a fresh one for each test (the
    first starts with the swarm)."""
    root = tmp_path_factory.mktemp("preemption")
    started: list[DaemonProcess] = []
    try:
        d0, keep, first = start_swarm(root, [0, 1, 1], env=ENV, into=started)
        spare = [first]

        def victim(home: Path) -> DaemonProcess:
            if spare:
                return spare.pop()
            d = DaemonProcess(home, "--stage", "1", "--bootstrap", d0.addr, env=ENV)
            started.append(d)
            d.wait_started()
            return d

        yield d0, keep, victim
    finally:
        stop_all(started)


def _checkpoint_files(home: Path) -> list[str]:
    """The files in a home's checkpoint directory, none half-written; the spool of state
    downloads (``incoming``, there when the peer took its stage's state from a mate) must be
    empty."""
    directory = home / "checkpoints"
    incoming = directory / "incoming"
    if incoming.is_dir():
        assert os.listdir(incoming) == [], os.listdir(incoming)
    return sorted(x for x in os.listdir(directory) if x != "incoming")


@pytest.mark.timeout(300)  # three daemon starts (the module's) and a training run; slow on a loaded machine
def test_a_peer_stopped_by_sigterm_mid_training_leaves_in_its_grace_and_loses_nothing(
        swarm: Any, tmp_path: Path) -> None:
    d0, keep, start_victim = swarm
    victim = start_victim(tmp_path / "victim")
    wait_until(lambda: d0.get("/api/v0/swarm")["stages"][1]["routable_peers"] == 2, 30,
               "two stage-1 peers routable")
    home = tmp_path / "trainer"
    config = load_config(None, {**os.environ, **ENV})
    with _Preempter(victim, home / "train-metrics.jsonl", after_steps=3) as preempter:
        result = uvloop.run(asyncio.wait_for(
            train(config, bootstrap=[d0.addr], steps=12, home=home, progress=lambda line: None,
                  bar=False), 280))
    assert preempter.error is None, f"{preempter.error}:\n{victim.stderr()[-3000:]}"
    assert preempter.exit_status == 0, victim.stderr()[-3000:]
    assert preempter.exit_s is not None and preempter.exit_s <= GRACE_S + 2
    log = victim.stderr()
    held = HELD.search(log)
    assert held is not None, log[-3000:]
    in_flight, handed_back = int(held.group(1)), int(held.group(2))
    print(f"exit {preempter.exit_status} after {preempter.exit_s:.2f} s (grace {GRACE_S} s); "
          f"in flight {in_flight}, handed back {handed_back}; restarted "
          f"{preempter.restarted_before} -> {result.restarted}, lost {result.lost}")
    assert handed_back <= in_flight
    # the trainer routed around the leaving peer: nothing lost, restarts only of what it held
    assert result.steps == 12 and result.lost == 0
    assert result.final_val_loss < result.initial_val_loss
    assert preempter.restarted_before is not None
    assert result.restarted - preempter.restarted_before <= in_flight, (result, in_flight)
    # its checkpoint was saved on the way out, whole, and nothing half-written is left
    assert _checkpoint_files(victim.home) == ["stage-1.swst"]
    saved = load_checkpoint(victim.home / "checkpoints", 1)
    assert saved is not None and saved.step >= 1
    # the peer that stayed served the rest of the run
    assert keep.proc.poll() is None
    assert keep.get("/api/v0/stage")["step"] >= saved.step


@pytest.mark.timeout(300)  # a daemon start and a training run; slow on a loaded machine
def test_a_peer_whose_trainer_froze_leaves_at_the_drain_deadline_and_the_run_goes_on(
        swarm: Any, tmp_path: Path) -> None:
    """The trainer (a ``swarmd train`` process) is frozen with SIGSTOP mid-step, so what the
    leaving peer holds for it cannot finish: the peer waits out its drain, hands that back,
    saves and exits 0 within the grace; the trainer, thawed, finishes without losing any."""
    d0, keep, start_victim = swarm
    victim = start_victim(tmp_path / "victim")  # the first test's one has left
    wait_until(lambda: d0.get("/api/v0/swarm")["stages"][1]["routable_peers"] == 2, 30,
               "two stage-1 peers routable")
    home = tmp_path / "trainer"
    trainer = swarmd_popen(
        ["train", "--json", "--home", str(home), "--steps", "10",
         "--bootstrap", d0.addr], env={**os.environ, **ENV}, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    try:
        wait_until(lambda: (_last_metrics(home / "train-metrics.jsonl") or {}).get("step", 0)
                   >= 3, 240, "three trainer steps")
        _until_holding(victim)
        trainer.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        victim.signal(signal.SIGTERM)
        assert victim.wait(GRACE_S + 2) == 0, victim.stderr()[-3000:]
        exit_s = time.monotonic() - t0
    finally:
        trainer.send_signal(signal.SIGCONT)
    out, _ = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    held = HELD.search(victim.stderr())
    assert held is not None, victim.stderr()[-3000:]
    print(f"exit after {exit_s:.2f} s (grace {GRACE_S} s); in flight {held.group(1)}, handed "
          f"back {held.group(2)}; restarted {result['restarted']}, lost {result['lost']}")
    assert int(held.group(2)) <= int(held.group(1))
    assert result["steps"] == 10 and result["lost"] == 0
    assert result["final_val_loss"] < result["initial_val_loss"]
    assert _checkpoint_files(victim.home) == ["stage-1.swst"]
    assert keep.proc.poll() is None
