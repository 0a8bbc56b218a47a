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


#: The test files that take longest, slowest first (seconds of a loaded full run's
#: `--durations`, 2026-12-04: 138 to 20). With `--dist loadfile` and `--no-loadscope-reorder`
#: (pyproject), pytest-xdist hands whole files to its workers in collection order, each worker
#: keeping a file or two ahead; these are collected first, so that the run does not end with
#: one worker on a two-minute file while the others wait. (xdist's own reorder, by number of
#: tests, put these few-test files last.) A new slow file belongs here.
SLOW_FILES = (
    "test_replay_daemons.py", "test_pipeline_daemons.py", "test_wan_deadlines.py",
    "test_nat_recovery.py", "test_averaging_daemons.py", "test_drift_daemons.py",
    "test_fuzz_protocols.py", "test_nat_lab.py", "test_models_swarm.py", "test_budgets.py",
    "test_manifest_swarm.py", "test_nat_punch.py", "test_transport_integration.py",
    "test_limits.py", "test_scale_swarm.py", "test_hedging.py", "test_balancing_daemons.py",
    "test_models_api.py", "test_preemption.py", "test_cli.py", "test_step_drains_daemons.py",
    "test_routing_caps.py", "test_export_swarm.py", "test_restart_resume.py", "test_model.py",
    "test_wanlab.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first (``SLOW_FILES``), every other file after them in its order; tests
    within a file keep theirs (the sort is stable)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


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
