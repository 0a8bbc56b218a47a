"""Rebalancing through real ``swarmd join`` processes on 127.0.0.1: a peer joins or moves to
the stage that limits the pipeline while training goes on, and nothing is lost."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import uvloop

from daemon_harness import DaemonProcess, start_swarm, stop_all, wait_until
from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.trainer.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_MODEL_LAYERS": "6", "SWARMD_SWARM_STAGES": "3",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "balancing-test",
       "SWARMD_AVERAGING_TIMEOUT_S": "8"}
# fast checks; a threshold above the noise of throughputs measured on 2 shared cores
FAST_CHECKS = {"SWARMD_BALANCING_CHECK_PERIOD_S": "1.0",
               "SWARMD_BALANCING_CONFIRM_PERIOD_S": "0.5", "SWARMD_BALANCING_THRESHOLD": "0.3"}


class _Said(logging.Handler):
    def __init__(self, into: collections.deque[str]) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(f"{record.name}: {record.getMessage()}"[:300])


class _Training:
    """``train()`` in a thread of its own, so the test can act on the swarm meanwhile."""

    def __init__(self, first: DaemonProcess, steps: int, env: dict[str, str]) -> None:
        self.result: Any = None
        self.enough = threading.Event()  # set by the test: finish after the current step
        self.error: BaseException | None = None
        config = load_config(None, {**os.environ, **env})
        #: the trainer's last log lines, INFO and up, heard while it runs
        self.said: collections.deque[str] = collections.deque(maxlen=12)
        listener, trainer_log = _Said(self.said), logging.getLogger("swarmd.trainer")

        def run() -> None:
            # (INFO too: the logger's level is the root's, WARNING, unless set; the trainer
            # says at INFO which stages' step reports it waits for)
            level = trainer_log.level
            trainer_log.setLevel(logging.INFO)
            trainer_log.addHandler(listener)
            try:
                self.result = uvloop.run(asyncio.wait_for(train(
                    config, bootstrap=[first.addr], steps=steps, progress=lambda line: None,
                    bar=False, until=self.enough.is_set), 280))
            except BaseException as exc:  # reported by finish()
                self.error = exc
            finally:
                trainer_log.removeHandler(listener)
                trainer_log.setLevel(level)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def tail(self) -> str:
        """The trainer's last log lines, for a failure's message."""
        return " | ".join(self.said)

    def going(self) -> bool:
        """Whether the run is still on; a run that ended early reports why, as a failure."""
        if self.thread.is_alive():
            return True
        self.finish()
        raise AssertionError(f"training ended early, after {self.result.steps} steps")

    def finish(self) -> Any:
        self.thread.join(300)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "training did not finish"
        return self.result


def _trained(d: DaemonProcess) -> int:
    return int(d.get("/api/v0/status")["counters"].get("stage.backward", 0))


def _where(daemons: list[DaemonProcess]) -> str:
    """Each peer's stage, step and state, its rounds', catch-ups' and stage's counters, and
    the last lines its rounds and its keeper logged, for a failure's message."""
    rows = []
    for i, d in enumerate(daemons):
        try:
            info = d.get("/api/v0/stage")
            sync = {k: v for k, v in d.get("/api/v0/status")["counters"].items()
                    if k.startswith(("sync.", "allreduce.", "state.", "stage.")) and v}
            said = [line for line in d.stderr().splitlines()
                    if " swarmd.averaging" in line or " swarmd.keeper" in line
                    or " swarmd.stage" in line or " swarmd.sync" in line][-6:]
            rows.append(f"peer{i}: stage {info['stage']} step {info['step']} {info['state']} "
                        f"{sync} said {said}")
        except Exception as exc:  # (a failure's message must not fail)
            rows.append(f"peer{i}: {exc!r}")
    return ", ".join(rows)


#: stage 2's surviving peer announces at most ~230 samples/s (what a 1 MB/s download carries
#: of this model's int8 activations), ten times below the ~2,500 each peer measures here and
#: five above what training asks of it: identical peers sharing 2 loaded cores measured up to
#: 3.6x apart, so without it a stage of two (noisy) peers could total less than one
SURVIVOR_DOWNLOAD = {"SWARMD_LIMITS_DOWNLOAD_BYTES_S": "1000000"}


def test_a_new_peer_with_stage_auto_joins_the_stage_that_lost_its_peers(
        tmp_path: Path) -> None:
    env = {**ENV, "SWARMD_BALANCING_ENABLED": "false"}  # joining alone must do it here
    started: list[DaemonProcess] = []
    try:
        d = start_swarm(tmp_path, [0, 0, 1, 1, 2], env=env, into=started)
        d.append(DaemonProcess(tmp_path / "peer5", "--stage", "2", "--bootstrap", d[0].addr,
                               env={**env, **SURVIVOR_DOWNLOAD}))
        started.append(d[5])
        d[5].wait_started()
        wait_until(lambda: all(s["routable_peers"] == 2 for s in
                               d[0].get("/api/v0/swarm")["stages"]), 30, "six routable peers")
        training = _Training(d[0], 2000, env)  # until the newcomer has served
        wait_until(lambda: _trained(d[4]) + _trained(d[5]) >= 8, 120, "stage 2 at work")
        d[4].proc.kill()  # stage 2 keeps one (slow) peer of two
        d[4].proc.wait(10)
        wait_until(lambda: d[0].get("/api/v0/swarm")["stages"][2]["routable_peers"] == 1, 30,
                   "the killed peer out of routing")
        newcomer = DaemonProcess(tmp_path / "new", "--bootstrap", d[0].addr, env=env)
        started.append(newcomer)
        newcomer.wait_started()
        stages = d[0].get("/api/v0/swarm")["stages"]
        assert newcomer.get("/api/v0/status")["stage"] == 2, stages  # where it is needed
        try:
            wait_until(lambda: training.going() and _trained(newcomer) >= 1, 120,
                       "the newcomer serving stage 2")
        except AssertionError as exc:  # once in CI-like load: say where everyone stood
            alive = [p for p in started if p is not d[4]]
            keeper = "\n".join(line for line in newcomer.stderr().splitlines()
                               if "swarmd.keeper" in line or "swarmd.state" in line)[-2000:]
            raise AssertionError(f"{exc}; {_where(alive)} (the newcomer last); trainer said: "
                                 f"{training.tail()}; the newcomer's state: {keeper}") from None
        training.enough.set()
        result = training.finish()
        assert result.lost == 0 and result.final_val_loss < result.initial_val_loss
    finally:
        stop_all(started)


def test_a_peer_of_an_over_served_stage_migrates_to_the_bottleneck(tmp_path: Path) -> None:
    env = {**ENV, **FAST_CHECKS}
    started: list[DaemonProcess] = []
    try:
        d = start_swarm(tmp_path, [0, 0, 0, 1, 2], env=env, into=started)
        wait_until(lambda: [s["routable_peers"] for s in
                            d[0].get("/api/v0/swarm")["stages"]] == [3, 1, 1], 30,
                   "five routable peers")
        training = _Training(d[3], 2000, env)  # until the move is done

        def migrations(p: DaemonProcess) -> int:
            return int(p.get("/api/v0/status")["counters"].get("balance.migrations", 0))

        def moved() -> list[DaemonProcess]:
            return [p for p in d[:3] if migrations(p)]

        def peers_per_stage() -> list[int]:
            return sorted(s["routable_peers"] for s in d[0].get("/api/v0/swarm")["stages"])

        def routable_at(stage: int, peer_id: str) -> bool:
            row = d[0].get("/api/v0/swarm")["stages"][stage]
            return any(p["peer_id"] == peer_id and p["routable"] for p in row["peers"])

        movers = wait_until(lambda: training.going() and moved(), 150,
                            "a stage-0 peer migrating")
        assert len(movers) <= 2, len(movers)  # (a second may follow at once: see below)
        mover = movers[0]
        info = wait_until(lambda: (lambda i: i if i["state"] == "online" else None)(
            mover.get("/api/v0/stage")), 60, "the mover online on its new stage")
        assert info["stage"] in (1, 2)
        # took the new stage's state from its peer
        assert info["state_from"] == "peers", "\n".join(
            line for line in mover.stderr().splitlines() if "swarmd.keeper" in line)[-3000:]
        wait_until(lambda: routable_at(mover.get("/api/v0/stage")["stage"], mover.peer_id), 30,
                   "the mover routable at its new stage")
        served = _trained(mover)
        try:
            wait_until(lambda: training.going() and _trained(mover) > served, 60,
                       "the mover serving its new stage")
        except AssertionError as exc:  # say where each peer stands, and the mover's counters
            raise AssertionError(f"{exc}; {_where(d)}; trainer said: {training.tail()}; "
                                 f"mover: {mover.get('/api/v0/status')['counters']}") from None
        training.enough.set()
        result = training.finish()
        assert result.lost == 0 and result.final_val_loss < result.initial_val_loss
        # no flapping. The policy weighs announced throughputs, and identical peers sharing 2
        # loaded cores measure from 200 to 2,500 samples/s (a peer with less work measures
        # faster), so after the first move the noise may justify more: a second stage-0 peer
        # following the first, a peer of a stage of 2 moving on to a stage that looks slower,
        # the first mover moving on once a second came (each seen in runs here, every move
        # justified by its totals). Capping every peer's announced throughput to one value (a
        # download limit) left the mover downloading its mates' replayed steps forever behind
        # them instead. What the noise cannot do is make peers move back and forth.
        counts = [migrations(p) for p in d]
        assert sum(counts) <= 3 and max(counts) <= 2, counts
        wait_until(lambda: min(peers_per_stage()) >= 1, 30, "every stage still served")
    finally:
        stop_all(started)


def test_two_peers_on_one_stage_fill_the_empty_one_before_any_training(
        tmp_path: Path) -> None:
    # what two --stage auto daemons racing onto one stage leave: stage 1 empty, nothing
    # trained, so every announced throughput is 0 (the totals look balanced)
    env = {**ENV, **FAST_CHECKS, "SWARMD_SWARM_STAGES": "2"}
    started: list[DaemonProcess] = []
    try:
        d = start_swarm(tmp_path, [0, 0], env=env, into=started)

        def stages() -> list[int]:
            return [s["routable_peers"] for s in d[0].get("/api/v0/swarm")["stages"]]

        wait_until(lambda: stages() == [1, 1], 120, "one peer moved to the empty stage")
        counts = [int(p.get("/api/v0/status")["counters"].get("balance.migrations", 0))
                  for p in d]
        assert sorted(counts) == [0, 1], counts
    finally:
        stop_all(started)
