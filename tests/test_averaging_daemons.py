"""The peers of a stage train one set of weights: averaging, state transfer and checkpoints
through real ``swarmd join`` processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvloop

from daemon_harness import DaemonProcess, start_swarm, stop_all, wait_until
from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.trainer.run import train

pytestmark = pytest.mark.integration

ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "averaging-test",
       "SWARMD_AVERAGING_TIMEOUT_S": "8"}


def _train(first: DaemonProcess, steps: int) -> Any:
    config = load_config(None, {**os.environ, **ENV})
    return uvloop.run(asyncio.wait_for(
        train(config, bootstrap=[first.addr], steps=steps, progress=lambda line: None,
              bar=False), 280))


def _stage(d: DaemonProcess) -> dict[str, Any]:
    """``GET /api/v0/stage``, asked again while the daemon answers 503 (its digest is computed
    between two compute tasks, which can take a while on a loaded machine)."""
    return wait_until(lambda: d.get("/api/v0/stage", timeout=15), 60, "the stage info")


def _state_lines(d: DaemonProcess) -> str:
    """What the daemon's log says about where its state came from (for a failure)."""
    return "\n".join(line for line in d.stderr().splitlines()
                     if "swarmd.keeper" in line or "state" in line.lower())[-3000:]


def _agree(peers: list[DaemonProcess], what: str) -> dict[str, Any]:
    """Wait until every peer is at the same step with the same weights; return one's info."""
    def same() -> dict[str, Any] | None:
        infos = [d.get("/api/v0/stage", timeout=15) for d in peers]
        steps = {i["step"] for i in infos}
        digests = {i["params_digest"] for i in infos}
        return infos[0] if len(steps) == 1 and len(digests) == 1 else None
    try:
        return wait_until(same, 60, what)  # a loaded machine answers 503 for a while
    except AssertionError as exc:  # say where each peer is and what its rounds did
        seen = [(d.get("/api/v0/stage")["step"], {
            k: v for k, v in d.get("/api/v0/status")["counters"].items()
            if k.startswith(("sync.", "state.", "allreduce.bad", "allreduce.refused"))})
            for d in peers]
        raise AssertionError(f"{exc}; peers: {seen}") from None


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A stage-0 and three stage-1 daemons shared by the next two tests (one swarm start
    fewer): the first trains and only reads; the second, which kills a peer, comes after it
    and counts its rounds and steps from where the first left them."""
    started: list[DaemonProcess] = []
    try:
        d = start_swarm(tmp_path_factory.mktemp("four"), [0, 1, 1, 1], env=ENV, into=started)
        wait_until(lambda: d[0].get("/api/v0/swarm")["stages"][1]["routable_peers"] == 3, 30,
                   "three stage-1 peers routable")
        yield d
    finally:
        stop_all(started)


def _rounds(d: DaemonProcess) -> int:
    return int(d.get("/api/v0/status")["counters"].get("sync.rounds", 0))


def test_three_peers_of_a_stage_step_together_and_hold_equal_weights(four: Any) -> None:
    d0, *stage1 = four
    result = _train(d0, 12)
    assert result.lost == 0 and result.final_val_loss < result.initial_val_loss
    info = _agree(stage1, "the three stage-1 peers at one step with equal weights")
    # exact steps (swarmd.pipeline.exact): one stage step per trainer step, each reported to
    # the trainer and answered with the whole model's clipping coefficient
    assert info["step"] == 12, info["step"]
    assert _stage(d0)["step"] == 12
    rounds = [d.get("/api/v0/status")["counters"] for d in stage1]
    assert sum(c.get("sync.rounds", 0) for c in rounds) >= 6 * 3  # averaged, not alone
    assert all(c.get("sync.rounds_failed", 0) == 0 for c in rounds)
    assert sum(c.get("stage.step_reports", 0) for c in rounds) >= 12, rounds
    assert all(c.get("stage.step_reports_expired", 0) == 0
               and c.get("stage.step_report_failed", 0) == 0 for c in rounds), [
        {k: v for k, v in c.items() if k.startswith(("stage.step_report", "sync."))}
        for c in rounds]


def test_a_peer_killed_mid_training_leaves_the_others_equal(four: Any) -> None:
    d0, *stage1 = four
    victim = stage1[2]
    # the swarm trained before: rounds and steps are counted from here
    start_rounds = _rounds(victim)
    start_step = _agree(stage1, "the stage-1 peers at one step before the run")["step"]
    killed = threading.Event()

    def killer() -> None:  # SIGKILL one peer once it has averaged a few rounds
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                rounds = _rounds(victim)
            except OSError:  # answering slowly under load: ask again
                rounds = 0
            if rounds >= start_rounds + 3:
                victim.proc.kill()
                killed.set()
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    result = _train(d0, 18)
    watcher.join(5)
    assert killed.is_set(), [{k: v for k, v in d.get("/api/v0/status")["counters"].items()
                              if k.startswith(("sync.", "allreduce.bad", "allreduce.refused",
                                               "allreduce.rounds"))} for d in stage1]
    assert result.lost == 0 and result.final_val_loss < result.initial_val_loss
    info = _agree(stage1[:2], "the surviving stage-1 peers at one step with equal weights")
    counters = [d.get("/api/v0/status")["counters"] for d in stage1[:2]]
    assert info["step"] >= start_step + 8, [
        {k: v for k, v in c.items() if "sync" in k or "stage" in k or "allreduce" in k}
        for c in counters]
    stop_all(four)  # its last test: not left running beside the next test's daemons


@pytest.mark.timeout(300)  # four daemon starts and a training run; slow on a loaded machine
def test_a_restarted_peer_resumes_from_its_peers_or_checkpoint(daemons: Any,
                                                                 tmp_path: Path) -> None:
    d0, a, b = daemons(0, 1, 1)
    wait_until(lambda: d0.get("/api/v0/swarm")["stages"][1]["routable_peers"] == 2, 30,
               "two stage-1 peers routable")
    _train(d0, 8)
    before = _agree([a, b], "both stage-1 peers at one step")
    assert before["step"] >= 4
    # SIGKILL b and start it again on the same home: a is alive, so b takes a's state
    b.proc.kill()
    b.proc.wait(10)
    b2 = DaemonProcess(tmp_path / "peer2", "--stage", "1", "--bootstrap", d0.addr, env=ENV)
    try:
        b2.wait_started()
        info = _stage(b2)
        assert info["state_from"] == "peers" and info["step"] == before["step"], \
            _state_lines(b2)
        assert info["params_digest"] == _stage(a)["params_digest"]
    finally:
        b2.stop()
    # stage 0 has one peer: stopped gracefully it saves a checkpoint and resumes from it
    step0 = _stage(d0)["step"]
    digest0 = _stage(d0)["params_digest"]
    assert step0 >= 4
    d0.stop()
    again = DaemonProcess(tmp_path / "peer0", "--stage", "0", env=ENV)
    try:
        again.wait_started()
        info = _stage(again)
        assert info["state_from"] == "checkpoint"
        assert (info["step"], info["params_digest"]) == (step0, digest0)
    finally:
        again.stop()
    # a corrupt checkpoint is reported, set aside, and the peer starts fresh only because
    # no peer of its stage is alive
    path = tmp_path / "peer0" / "checkpoints" / "stage-0.swst"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    third = DaemonProcess(tmp_path / "peer0", "--stage", "0", env=ENV)
    try:
        third.wait_started()
        assert _stage(third)["state_from"] == "initial"
        assert list((tmp_path / "peer0" / "checkpoints").glob("stage-0.swst.corrupt-*"))
    finally:
        third.stop()
