"""``swarmd service``: the systemd unit (rendered, written atomically, verified) and its CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd.node.service import ServiceError, UnitSpec, install, render_unit, uninstall

EXE = str(Path(sys.executable).with_name("swarmd"))


def test_the_unit_runs_join_on_the_home_restarts_and_stops_gracefully() -> None:
    text = render_unit(UnitSpec(exe="/opt/swarmd env/bin/swarmd", home=Path("/home/v/.swarmd"),
                                user="v"))
    assert "ExecStart='/opt/swarmd env/bin/swarmd' join --home /home/v/.swarmd" in text
    assert "Restart=on-failure" in text and "KillSignal=SIGTERM" in text
    assert "User=v" in text and "WantedBy=multi-user.target" in text
    user = render_unit(UnitSpec(exe=EXE, home=Path("/h"), user="v", user_mode=True))
    assert "User=" not in user and "WantedBy=default.target" in user


def test_install_is_atomic_and_a_bad_directory_leaves_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ServiceError, match="cannot write the unit"):
        install(UnitSpec(exe=EXE, home=tmp_path), blocker / "swarmd.service")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes anyway
            with pytest.raises(ServiceError):
                install(UnitSpec(exe=EXE, home=tmp_path), read_only / "swarmd.service")
            assert list(read_only.iterdir()) == []
    finally:
        read_only.chmod(0o700)
    path = install(UnitSpec(exe=EXE, home=tmp_path), tmp_path / "units" / "swarmd.service")
    assert path.read_text() == render_unit(UnitSpec(exe=EXE, home=tmp_path))
    assert [p.name for p in path.parent.iterdir()] == ["swarmd.service"]  # no temp file left
    assert uninstall(path) and not uninstall(path)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    import getpass

    path = install(UnitSpec(exe=EXE, home=tmp_path, user=getpass.getuser()),
                   tmp_path / "swarmd.service")
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                         timeout=60)
    complaints = [line for line in (out.stdout + out.stderr).splitlines()
                  if "Unknown key 'Restart" not in line]  # keys of systemd >= 254
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_the_cli_installs_and_uninstalls(tmp_path: Path) -> None:
    def swarmd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "swarmd", "service", *args, "--home",
                               str(tmp_path / "home"), "--unit-dir", str(tmp_path / "u")],
                              capture_output=True, text=True, timeout=60)

    out = swarmd("install", "--user", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    unit = Path(result["unit"])
    assert unit.exists() and f"--home {tmp_path / 'home'}" in unit.read_text()
    assert any("enable --now" in s for s in result["next_steps"])
    assert "removed" in swarmd("uninstall", "--user").stdout and not unit.exists()
    assert "nothing to remove" in swarmd("uninstall", "--user").stdout
    (tmp_path / "a-file").write_text("")
    bad = subprocess.run([sys.executable, "-m", "swarmd", "service", "install", "--unit-dir",
                          str(tmp_path / "a-file" / "units")], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and "cannot write the unit" in bad.stderr, bad.stderr
