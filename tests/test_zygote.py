"""``swarmd.local.zygote``: commands forked from the preloaded interpreter behave as
``python -m swarmd`` processes do (stdio, exit status, environment, working directory,
signals), and ``SWARMD_LOCAL_ZYGOTE=0`` gives real interpreters."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from daemon_harness import DaemonProcess, wait_until
from swarmd.version import __version__
from swarmd.local import zygote
from swarmd.local.zygote import Forked, swarmd_popen, swarmd_run

forked = pytest.mark.skipif(not zygote.enabled(), reason="SWARMD_LOCAL_ZYGOTE=0")


def test_without_the_zygote_a_command_is_a_fresh_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMD_LOCAL_ZYGOTE", "0")
    proc = swarmd_popen(["--version"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert isinstance(proc, subprocess.Popen) and proc.returncode == 0
    assert out.strip() == f"swarmd {__version__}"


@forked
def test_a_forked_command_has_its_own_stdio_exit_status_and_pid() -> None:
    out = swarmd_run(["--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"swarmd {__version__}", out
    bad = swarmd_run(["join", "--stage", "minus-one"], capture_output=True, text=True,
                     timeout=120)
    assert bad.returncode == 2, bad
    assert bad.stderr.strip().splitlines()[-1].startswith("swarmd: error: command line flag "
                                                          "--stage"), bad.stderr
    proc = swarmd_popen(["--version"], stdout=subprocess.DEVNULL)
    assert isinstance(proc, Forked) and proc.pid not in (os.getpid(), zygote._Owner.proc.pid)
    assert proc.wait(60) == 0 and proc.poll() == 0


@forked
def test_a_forked_command_runs_with_the_environment_and_directory_it_was_given(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = swarmd_run(["init", "--home", "home", "--json"], capture_output=True, text=True,
                     cwd=tmp_path, timeout=120,
                     env={**os.environ, "SWARMD_SWARM_NAME": "zygote-env-test"})
    assert out.returncode == 0, out.stderr
    assert (home / "identity.key").exists()  # "home" was relative to cwd
    # the environment is the one asked for, not the zygote's: a setting that does not parse
    bad = swarmd_run(["join", "--home", str(home)], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "SWARMD_LIMITS_UPLOAD_BYTES_S": "0"})
    assert bad.returncode == 2 and "SWARMD_LIMITS_UPLOAD_BYTES_S" in bad.stderr, bad.stderr


@forked
def test_signals_reach_the_forked_daemon_and_its_status_says_how_it_ended(
        tmp_path: Path) -> None:
    gentle = DaemonProcess(tmp_path / "gentle", "--stage", "0")
    killed = DaemonProcess(tmp_path / "killed", "--stage", "0")
    try:
        assert isinstance(gentle.proc, Forked) and isinstance(killed.proc, Forked)
        gentle.wait_started()
        killed.wait_started()
        with pytest.raises(subprocess.TimeoutExpired):
            killed.proc.wait(0.1)
        killed.proc.kill()
        assert killed.wait(30) == -signal.SIGKILL
        gentle.signal(signal.SIGTERM)
        assert gentle.wait(60) == 0, gentle.stderr()[-3000:]
        wait_until(lambda: not (gentle.home / "api").exists(), 10, "the api file removed")
    finally:
        gentle.stop()
        killed.stop()
