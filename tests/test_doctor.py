"""``swarmd doctor`` against a real daemon: each verdict, what it says to do, the exit status."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from swarmd.local.zygote import swarmd_run

pytestmark = pytest.mark.integration
ENV: dict[str, str] = {}
DEAD = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQuErpa7G8FnZpiSzZ3TutpbLuMtSpfNWAxSUdahsrVnj"


def doctor(home: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    out = swarmd_run(["doctor", "--home", str(home), "--json",
                      *args], capture_output=True, text=True, timeout=120,
                     env={**os.environ, **(env or {})})
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]} if out.stdout else {}
    return out.returncode, checks


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from daemon_harness import DaemonProcess, stop_all

    d = DaemonProcess(tmp_path_factory.mktemp("doctor") / "d", "--stage", "0", env=ENV)
    try:
        d.wait_started()
        yield d
    finally:
        stop_all([d])


@pytest.fixture
def home(tmp_path: Path) -> Path:
    from swarmd.node.home import init_home

    init_home(tmp_path / "home")
    return tmp_path / "home"


def test_a_live_bootstrap_of_our_swarm_and_model_is_ok(daemon: Any, home: Path) -> None:
    status, checks = doctor(home, "--bootstrap", daemon.addr)
    check = checks[f"bootstrap {daemon.addr}"]
    assert check["verdict"] == "ok" and "reachable" in check["found"], check
    assert "clocks agree" in check["found"]
    assert checks["config"]["verdict"] == "ok" and checks["identity"]["verdict"] == "ok"
    assert status == 0, checks


def test_another_swarm_and_another_model_are_told_apart(daemon: Any, home: Path) -> None:
    # the swarm's manifest names each own setting that differs (a joiner would refuse)
    _, checks = doctor(home, "--bootstrap", daemon.addr, env={"SWARMD_SWARM_NAME": "other"})
    check = checks[f"bootstrap {daemon.addr}"]
    assert "swarm.name = 'other' here, 'swarmd-default' in the swarm" in check["found"], check
    status, checks = doctor(home, "--bootstrap", daemon.addr, env={"SWARMD_MODEL_SEQ_LEN": "64"})
    check = checks[f"bootstrap {daemon.addr}"]
    assert check["verdict"] == "fail" and "model.seq_len = 64 here, 128 in the swarm" in \
        check["found"], check
    assert status == 1


def test_wrong_addresses_say_why_each_failed(home: Path) -> None:
    bad_dns = "/dns4/no-such-host.invalid/tcp/4001/p2p/" + DEAD.rsplit("/", 1)[1]
    status, checks = doctor(home, "--bootstrap", DEAD, "--bootstrap", bad_dns)
    assert checks[f"bootstrap {DEAD}"]["found"].startswith("refused")
    assert "does not resolve" in checks[f"bootstrap {bad_dns}"]["found"]
    assert "swarmd id" in checks[f"bootstrap {DEAD}"]["fix"]
    assert status == 1


def test_a_missing_home_and_a_bad_config_block_joining(tmp_path: Path, home: Path) -> None:
    status, checks = doctor(tmp_path / "nowhere")
    assert checks["home"]["verdict"] == "fail" and "swarmd init" in checks["home"]["fix"]
    assert status == 1
    status, checks = doctor(home, env={"SWARMD_WIRE_CODEC": "int9"})
    assert checks["config"]["verdict"] == "fail" and "wire.codec" in checks["config"]["found"]
    assert status == 1
