import os
import sys
from pathlib import Path
from typing import Any

import pytest

# test helpers (daemon_harness, transport_peer) are imported as plain modules
sys.path.insert(0, str(Path(__file__).parent))

# Tests train small steps: every process of a test swarm is on this machine, where a step's
# round trip costs nothing, and the default (64 microbatches a step, sized for a WAN: docs/
# pipeline.md, "Exact steps") would make every training test 16 times longer. Daemons and
# trainers started by tests inherit it; a test that sets its own value keeps it.
os.environ.setdefault("SWARMD_TRAINING_MICROBATCHES", "4")

# `swarmd join`, `train` and `demo` processes started by tests are forked from one preloaded
# interpreter (swarmd.local.zygote): real processes over the real network stack, without the
# seconds of imports each. SWARMD_LOCAL_ZYGOTE=0 starts a fresh interpreter for each instead.
os.environ.setdefault("SWARMD_LOCAL_ZYGOTE", "1")


@pytest.fixture(scope="session", autouse=True)
def _zygote() -> None:
    """Start the zygote's imports at the first test, not at the first daemon's."""
    from swarmd.local.zygote import prestart

    prestart()


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


_WANLAB_REASON: list[str | None] = []


def wanlab_unavailable() -> str | None:
    """Why the WAN lab (tools/wanlab) cannot run on this machine, None when it can; asked once."""
    if not _WANLAB_REASON:
        sys.path.insert(0, str(Path(__file__).parent.parent))
        from tools.wanlab import LabUnavailable, WanLab

        try:
            WanLab.check()
            _WANLAB_REASON.append(None)
        except LabUnavailable as exc:
            _WANLAB_REASON.append(f"WAN lab unavailable: {exc}")
    return _WANLAB_REASON[0]


@pytest.fixture
def wanlab() -> Any:
    """``wanlab(HostSpec(...), ...)`` builds a WAN lab (tools/wanlab) that is torn down after
    the test; the test is skipped, with the reason, where the lab cannot run (not root, no
    namespaces, iptables-legacy or netfilterqueue missing: tools/setup.sh --test as root installs
    them, as on CI)."""
    reason = wanlab_unavailable()
    if reason is not None:
        pytest.skip(reason)
    from tools.wanlab import WanLab

    labs: list[Any] = []

    def build(*hosts: Any, **kwargs: Any) -> Any:
        lab = WanLab(hosts=list(hosts), **kwargs)
        labs.append(lab)
        return lab.__enter__()

    yield build
    for lab in reversed(labs):
        lab.close()
