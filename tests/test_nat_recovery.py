"""A NATed daemon whose home router restarts (issue 12, "Recovery"), in the WAN lab.

The lab's ``gateway_outage`` makes a NAT gateway drop every packet for N seconds and forget its
NAT table, as a router that restarts. First the lab itself: nothing passes while it is down, a
connection made before it does not survive it, new ones work after it. Then the figure: a NATed
stage peer serving a running trainer, its gateway down for 30 s: within 60 s of the recovery it
serves microbatches again. Skipped, with the reason, where the lab cannot run (not root).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.integration

ENV = {"SWARMD_BALANCING_ENABLED": "false", "SWARMD_TRAINING_MICROBATCHES": "4"}
OUTAGE_S = 30.0
#: the figure: serving again within this long of the recovery
RECOVERY_S = 60.0


def test_a_gateway_outage_drops_everything_and_forgets_its_connections(wanlab: Any) -> None:
    from tools.wanlab import HostSpec
    from tools.wanlab.spec import LabError

    lab = wanlab(HostSpec(name="home", nat=True), HostSpec(name="dc"))
    with lab.inside("dc"):
        ls = socket.create_server((lab.addr("dc"), 0))
    port = ls.getsockname()[1]
    with lab.inside("home"):
        before = socket.create_connection((lab.addr("dc"), port), timeout=5)
    with ls, before:
        ls.settimeout(5)
        peer, _ = ls.accept()
        with pytest.raises(LabError, match="not behind a NAT"):
            lab.gateway_down("dc")
        lab.gateway_down("home")
        assert lab.gateway_is_down("home")
        with lab.inside("home"):
            with pytest.raises(OSError):
                socket.create_connection((lab.addr("dc"), port), timeout=1.0)
        lab.gateway_up("home")
        assert not lab.gateway_is_down("home")
        # the gateway forgot the mapping: what the far end sends meets a reset
        peer.settimeout(5)
        peer.sendall(b"x" * 1000)
        before.settimeout(5)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # not a timeout
            for _ in range(50):  # bounded: the reset arrives within a few round trips
                before.sendall(b"y" * 1000)
                data = before.recv(1000)
                if not data:
                    raise ConnectionResetError("closed")
                time.sleep(0.05)
        peer.close()
        with lab.inside("home"):
            after = socket.create_connection((lab.addr("dc"), port), timeout=5)
        after.close()
        lab.gateway_outage("home", 0.5)  # and back by itself
        from daemon_harness import wait_until

        wait_until(lambda: not lab.gateway_is_down("home"), 10, "the gateway to come back")
