"""The swarmd command line, run as real subprocesses (``python -m swarmd``) on a temporary home."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import swarmd
from swarmd.cli import COMMANDS
from swarmd.config import render_default_toml

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A clean environment: no SWARMD_* from the caller, HOME pointing into tmp_path."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SWARMD_")}
    clean["HOME"] = str(tmp_path / "user")
    clean["PYTHONPATH"] = str(REPO) + os.pathsep + clean.get("PYTHONPATH", "")
    return clean


def swarmd_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmd", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], status: int) -> str:
    assert proc.returncode == status, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarmd: error: "), proc.stderr
    return lines[0]


def test_version(env):
    proc = swarmd_run(env, "--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"swarmd {swarmd.__version__}"
    assert swarmd.__version__ == "0.1.0.dev0"


@pytest.mark.parametrize("args", [["--help"]] + [[c.name, "--help"] for c in COMMANDS])
def test_help_everywhere(env, args):
    proc = swarmd_run(env, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: swarmd")
    if len(args) == 1:
        for command in COMMANDS:
            assert command.name in proc.stdout


def test_version_and_help_import_neither_libp2p_nor_torch(env):
    code = ("import sys; from swarmd.cli import main; "
            "assert main(['--version']) == 0; assert main(['--help']) == 0; "
            "assert main(['id', '--help']) == 0; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('libp2p', 'torch', 'multiaddr')]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_no_command_and_bad_usage_exit_2(env):
    proc = swarmd_run(env)
    assert proc.returncode == 2 and "usage: swarmd" in proc.stderr
    proc = swarmd_run(env, "id", "--bogus")
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
    proc = swarmd_run(env, "nosuchcommand")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_init_twice_keeps_identity_then_id(env, tmp_path):
    home = tmp_path / "home"
    first = swarmd_run(env, "init", "--home", str(home), "--json")
    assert first.returncode == 0, first.stderr
    created = json.loads(first.stdout)
    assert created["identity_created"] is True and created["config_created"] is True
    assert created["home"] == str(home)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "identity.key").stat().st_mode) == 0o600
    assert (home / "config.toml").read_text(encoding="utf-8") == render_default_toml()

    second = swarmd_run(env, "init", "--home", str(home))
    assert second.returncode == 0, second.stderr
    assert created["peer_id"] in second.stdout
    assert "kept existing" in second.stdout

    proc = swarmd_run(env, "id", "--home", str(home), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"peer_id": created["peer_id"], "addrs": ["/ip4/0.0.0.0/tcp/31337"]}
    assert out["peer_id"].startswith("12D3KooW")

    # text output, home from $SWARMD_HOME, listen from the environment
    proc = swarmd_run({**env, "SWARMD_HOME": str(home),
                       "SWARMD_NETWORK_LISTEN": "/ip4/127.0.0.1/tcp/1,/ip6/::1/tcp/2"}, "id")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"peer id  {created['peer_id']}",
                                        "listen   /ip4/127.0.0.1/tcp/1",
                                        "listen   /ip6/::1/tcp/2"]


def test_default_home_is_dot_swarmd(env, tmp_path):
    proc = swarmd_run(env, "init", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["home"] == str(tmp_path / "user" / ".swarmd")


def test_home_config_file_is_used_and_config_flag_wins(env, tmp_path):
    home = tmp_path / "home"
    assert swarmd_run(env, "init", "--home", str(home)).returncode == 0
    (home / "config.toml").write_text('[network]\nlisten = ["/ip4/127.0.0.1/tcp/7"]\n')
    proc = swarmd_run(env, "id", "--home", str(home), "--json")
    assert json.loads(proc.stdout)["addrs"] == ["/ip4/127.0.0.1/tcp/7"]
    other = tmp_path / "other.toml"
    other.write_text('[network]\nlisten = ["/ip4/127.0.0.1/tcp/8"]\n')
    proc = swarmd_run(env, "id", "--home", str(home), "--config", str(other), "--json")
    assert json.loads(proc.stdout)["addrs"] == ["/ip4/127.0.0.1/tcp/8"]


def test_bad_config_key_exits_2_naming_key_and_file(env, tmp_path):
    home = tmp_path / "home"
    assert swarmd_run(env, "init", "--home", str(home)).returncode == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('[network]\nlistn = ["/ip4/0.0.0.0/tcp/1"]\n')
    proc = swarmd_run(env, "id", "--home", str(home), "--config", str(bad))
    line = assert_one_line_error(proc, 2)
    assert line == (f'swarmd: error: {bad}: unknown key "network.listn" '
                    f'(did you mean "network.listen"?)')


def test_bad_env_value_exits_2(env, tmp_path):
    home = tmp_path / "home"
    proc = swarmd_run({**env, "SWARMD_WIRE_ZSTD_LEVEL": "99"}, "id", "--home", str(home))
    line = assert_one_line_error(proc, 2)
    assert "environment variable SWARMD_WIRE_ZSTD_LEVEL" in line and "wire.zstd_level" in line


def test_id_on_uninitialised_home_says_run_init(env, tmp_path):
    home = tmp_path / "never-initialised"
    proc = swarmd_run(env, "id", "--home", str(home))
    line = assert_one_line_error(proc, 1)
    assert f"run `swarmd init --home {home}`" in line
    home.mkdir()
    proc = swarmd_run(env, "id", "--home", str(home))
    line = assert_one_line_error(proc, 1)
    assert "identity.key" in line and f"run `swarmd init --home {home}`" in line


def test_world_readable_key_is_refused_with_chmod_hint(env, tmp_path):
    home = tmp_path / "home"
    assert swarmd_run(env, "init", "--home", str(home)).returncode == 0
    key = home / "identity.key"
    os.chmod(key, 0o644)
    for args in (["id", "--home", str(home)], ["init", "--home", str(home)]):
        line = assert_one_line_error(swarmd_run(env, *args), 1)
        assert f"run `chmod 600 {key}`" in line
    assert stat.S_IMODE(key.stat().st_mode) == 0o644  # never "fixed" or replaced behind our back


def test_corrupt_key_is_reported_not_replaced(env, tmp_path):
    home = tmp_path / "home"
    assert swarmd_run(env, "init", "--home", str(home)).returncode == 0
    key = home / "identity.key"
    key.write_bytes(b"garbage")
    line = assert_one_line_error(swarmd_run(env, "init", "--home", str(home)), 1)
    assert str(key) in line and "not a libp2p private key" in line
    assert key.read_bytes() == b"garbage"


def test_home_that_is_a_file(env, tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    line = assert_one_line_error(swarmd_run(env, "init", "--home", str(path)), 1)
    assert "not a directory" in line
