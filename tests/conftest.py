import sys
from pathlib import Path
from typing import Any

import pytest

# test helpers (daemon_harness, transport_peer) are imported as plain modules
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def daemons(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """``daemons(0, 1, 1)`` starts a local swarm (one daemon per stage listed) with the
    requesting test module's ``ENV``; every daemon is stopped after the test."""
    from daemon_harness import DaemonProcess, start_swarm, stop_all

    started: list[DaemonProcess] = []

    def start(*stages: int) -> list[DaemonProcess]:
        return start_swarm(tmp_path, stages, env=request.module.ENV, into=started)

    yield start
    stop_all(started)
