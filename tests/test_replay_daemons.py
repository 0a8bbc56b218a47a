"""Catch-up by replay with real daemons: a stage-1 peer joins while its stage trains, its
download capped so that the stage steps on while the state is in transit; it replays the
steps taken meanwhile (``state_replay``) instead of downloading again, and ends with the
same weights as its mate."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import uvloop

from daemon_harness import DaemonProcess, stop_all, wait_until
from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.trainer.run import train

pytestmark = pytest.mark.integration

ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "replay-test",
       "SWARMD_AVERAGING_TIMEOUT_S": "8", "SWARMD_BALANCING_ENABLED": "false",
       # the capped download takes ~2 s; this tiny stage steps up to ~7 times a second, so the
       # default 8 kept steps were often too few (the joiner then downloaded again instead of
       # replaying: the test failed under parallel load); ~300 kB a step, 256 steps ~77 MB
       "SWARMD_STATE_REPLAY_STEPS": "256"}
#: the joiner's download cap: its state (1.2 MB) takes 2 s to arrive, a step far less. At
#: 200 kB/s the test took 2 minutes, most of it replaying 36 steps' gradients (300 kB each)
#: through the cap; at 600 kB/s 10-20 steps, 45 s (65 s beside two busy cores)
SLOW = {"SWARMD_LIMITS_DOWNLOAD_BYTES_S": os.environ.get("SWARMD_TEST_REPLAY_CAP", "600000")}


def _counters(d: DaemonProcess) -> dict[str, Any]:
    return {k: v for k, v in d.get("/api/v0/status", timeout=15)["counters"].items()
            if k.startswith("state.") or k == "sync.local_steps"}


def _log(d: DaemonProcess) -> str:
    return "\n".join(line for line in d.stderr().splitlines()
                     if "swarmd.keeper" in line or "state" in line)[-3000:]


@pytest.mark.timeout(420)
def test_a_joiner_whose_download_lands_late_replays_the_steps_since(
        daemons: Any, tmp_path: Path) -> None:
    d0, a = daemons(0, 1)
    config = load_config(None, {**os.environ, **ENV})
    done = threading.Event()
    stop = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(uvloop.run(asyncio.wait_for(train(
                config, bootstrap=[d0.addr], steps=2000, progress=lambda line: None, bar=False,
                until=stop.is_set), 360)))
        except BaseException as exc:  # reported by the test below
            outcome.append(exc)
        finally:
            done.set()

    trainer = threading.Thread(target=run, daemon=True)
    trainer.start()
    b = None
    try:
        wait_until(lambda: a.get("/api/v0/stage", timeout=15)["step"] >= 2 or done.is_set(),
                   180, "stage 1 stepping")
        assert not done.is_set(), outcome
        b = DaemonProcess(tmp_path / "joiner", "--stage", "1", "--bootstrap", d0.addr,
                          env={**ENV, **SLOW})
        b.wait_started(180)
        try:
            wait_until(lambda: _counters(b).get("state.replayed_steps", 0) > 0
                       or done.is_set(), 180, "the joiner replaying steps")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {_counters(b)}\n{_log(b)}") from None
        counted = _counters(b)
        assert counted.get("state.replayed_steps", 0) > 0, f"{counted}\n{_log(b)}"
        stop.set()
        done.wait(300)
        assert outcome and not isinstance(outcome[0], BaseException), outcome

        def agree() -> bool:
            infos = [d.get("/api/v0/stage", timeout=15) for d in (a, b)]
            return len({(i["step"], i["params_digest"]) for i in infos}) == 1
        try:
            wait_until(agree, 120, "both stage-1 peers at one step with equal weights")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {_counters(a)} {_counters(b)}\n{_log(b)}") from None
        final = _counters(b)
        # a replay is bitwise: a mismatch only follows the joiner's own weights leaving its
        # mate's, i.e. a step it took alone while its view (pulled through its capped
        # download) had lost the mate; the drift repair then made them agree (above)
        assert final.get("state.replay_mismatch", 0) == 0 \
            or final.get("sync.local_steps", 0) > 0, final
        print(f"joiner: {final}\n{_log(b)}")  # shown with -s: how it caught up
    finally:
        stop.set()
        done.wait(60)
        if b is not None:
            stop_all([b])
