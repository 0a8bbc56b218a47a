"""The CLI faces of the daemon's commands (``swarmd status|peers|swarm|stop``), run as real
subprocesses against an HttpApi + FakeDaemon in this process, and the files that connect them:
``<home>/api`` (swarmd.api.client) and ``<home>/api_token`` (swarmd.api.token)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_http_api import ME, TRAINER, FakeDaemon, peer_id, run, serving

from swarmd.api.client import find_daemon
from swarmd.api.token import create_token, read_token
from swarmd.api.types import to_json
from swarmd.errors import HomeError
from swarmd.runfiles import remove_api_file, write_api_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    return home


def clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SWARMD_") and k.lower() != "no_proxy"}
    env["HOME"] = str(tmp_path / "user")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # a proxy in the environment must not catch the CLI's requests to 127.0.0.1
    env["http_proxy"] = env["HTTP_PROXY"] = "http://127.0.0.1:9"
    return env


async def swarmd(home: Path, *args: str) -> Done:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "swarmd", *args, "--home", str(home), cwd=REPO,
        env=clean_env(home.parent), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return Done(proc.returncode, out.decode(), err.decode())


def swarmd_sync(home: Path, *args: str) -> Done:
    return run(lambda: swarmd(home, *args), deadline=90)


def one_line_error(done: Done, status: int = 1) -> str:
    assert done.returncode == status, done
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarmd: error: "), done.stderr
    return lines[0]


# ------------------------------------------------------------------------ against a daemon

def test_status_peers_and_swarm_as_text_and_json(home: Path) -> None:
    fake = FakeDaemon()

    async def body() -> None:
        async with serving(fake) as http:
            (home / "api").write_text(http.url + "\n")

            for command, value in [("status", fake.status_value), ("peers", fake.peers_value),
                                   ("swarm", fake.swarm_value)]:
                done = await swarmd(home, command, "--json")
                assert done.returncode == 0, done
                assert json.loads(done.stdout) == to_json(value), command
                assert done.stdout.count("\n") == 1

            done = await swarmd(home, "status")
            assert done.returncode == 0, done
            lines = done.stdout.splitlines()
            assert f"peer id     {ME}" in lines
            assert "state       online" in lines and "stage       1" in lines
            assert "uptime      1h 02m 03s" in lines
            assert "throughput  7.25 samples/s" in lines
            assert "counters    protocol_errors.truncated  2" in lines
            assert any(line.split() == ["streams.opened", "41"] for line in lines)
            # one line a trainer: short id, step, loss, validation loss (its step), shard
            (trainer,) = [line for line in lines if TRAINER[-8:] in line]
            assert trainer.split()[0] == "trainers"
            assert ("step 40  loss 2.0000  val 3.9000 (step 30)  shard 1/2  epoch 0  1s ago"
                    in trainer)

            done = await swarmd(home, "peers")
            assert done.returncode == 0, done
            lines = done.stdout.splitlines()
            assert lines[0].split() == ["PEER", "ID", "STAGE", "STATE"]
            assert lines[1].split() == [peer_id(2), "0", "online"]
            assert lines[3].split() == [peer_id(9), "-", "-"]
            assert lines[-1] == "3 connected peers"

            done = await swarmd(home, "swarm")
            assert done.returncode == 0, done
            text = done.stdout
            assert text.startswith("swarm demo: 3 stages, 7 peers; bottleneck: stage 1 "
                                   "(11.2 samples/s)")
            stage_lines = [line for line in text.splitlines() if line.startswith("stage ")]
            assert len(stage_lines) == 3
            assert stage_lines[1].startswith("stage 1  11.2 samples/s  2 of 2 peers routable")
            assert stage_lines[1].endswith("<== BOTTLENECK")
            assert "BOTTLENECK" not in stage_lines[0] + stage_lines[2]
            row = next(line for line in text.splitlines() if peer_id(6) in line)
            assert "migrating" in row and "not routed: moving to stage 1" in row
            assert "excluded from routing (1):" in text
            row = next(line for line in text.splitlines() if peer_id(7) in line)
            assert "announces model gpt-small, this swarm trains gpt-tiny" in row

    run(body, deadline=120)


def test_stop_sends_the_token_and_waits_for_the_daemon_to_exit(home: Path) -> None:
    fake = FakeDaemon()
    create_token(home)

    async def body() -> None:
        async with serving(fake, token=read_token(home)) as http:
            write_api_file(home, http.url)
            # the daemon's shutdown, a moment after it answered
            fake.on_stop = lambda: asyncio.get_running_loop().call_later(
                0.2, remove_api_file, home, http.url)
            done = await swarmd(home, "stop")
            assert done.returncode == 0, done
            assert done.stdout == "stopped\n"
            assert fake.calls["stop"] == 1 and not (home / "api").exists()

            write_api_file(home, http.url)
            done = await swarmd(home, "stop", "--json")
            assert done.returncode == 0, done
            assert json.loads(done.stdout) == {"url": http.url, "stopped": True}

    run(body, deadline=120)


def test_stop_with_a_wrong_token_is_refused_clearly(home: Path) -> None:
    fake = FakeDaemon()
    (home / "api_token").write_text("w" * 43 + "\n")
    os.chmod(home / "api_token", 0o600)

    async def body() -> None:
        async with serving(fake, token="r" * 43) as http:
            write_api_file(home, http.url)
            line = one_line_error(await swarmd(home, "stop"))
            assert f"daemon at {http.url} refused the API token from {home / 'api_token'}" in line
            assert "wrong API token" in line
            assert "stop" not in fake.calls

            (home / "api_token").unlink()
            line = one_line_error(await swarmd(home, "stop"))
            assert f"no API token {home / 'api_token'}" in line
            assert f"swarmd join --home {home}" in line

    run(body, deadline=120)


def test_stop_that_does_not_finish_in_time_says_so(home: Path) -> None:
    fake = FakeDaemon()  # accepts the stop but never removes its api file

    async def body() -> None:
        async with serving(fake, token=create_token(home)) as http:
            write_api_file(home, http.url)
            line = one_line_error(await swarmd(home, "stop", "--timeout", "0.3"))
            assert "accepted the stop request but has not exited within 0.3 s" in line
            assert fake.calls["stop"] == 1

    run(body, deadline=120)


def test_a_daemon_error_reaches_the_cli_as_one_line(home: Path) -> None:
    fake = FakeDaemon()
    fake.fail["status"] = RuntimeError("boom")

    async def body() -> None:
        async with serving(fake) as http:
            write_api_file(home, http.url)
            line = one_line_error(await swarmd(home, "status"))
            assert "HTTP 500 internal_error" in line and "boom" in line
            assert "bug in swarmd" in line

    run(body, deadline=120)


# ---------------------------------------------------------------------------- no daemon

@pytest.mark.parametrize("command", ["status", "peers", "swarm", "stop"])
def test_no_daemon_running(home: Path, command: str) -> None:
    line = one_line_error(swarmd_sync(home, command))
    assert line == (f"swarmd: error: no swarmd daemon is running for home {home} (no "
                    f"{home / 'api'} file): start one with `swarmd join --home {home}`")


def test_stale_api_file(home: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (home / "api").write_text(f"http://127.0.0.1:{port}\n")
    line = one_line_error(swarmd_sync(home, "status"))
    assert f"daemon at http://127.0.0.1:{port} does not answer" in line
    assert f"if it crashed, remove {home / 'api'}" in line


def test_api_file_that_is_not_a_url(home: Path) -> None:
    (home / "api").write_text("garbage\n")
    with pytest.raises(HomeError, match="does not hold a daemon's URL"):
        find_daemon(home)


# ------------------------------------------------------------------------------- api_token

def test_create_token_is_private_atomic_and_reused(home: Path) -> None:
    token = create_token(home)
    path = home / "api_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) == 43 and path.read_text() == token + "\n"
    assert create_token(home) == token == read_token(home)
    assert sorted(p.name for p in home.iterdir()) == ["api_token"]


@pytest.mark.parametrize("content,mode", [("short\n", 0o600), ("w" * 43 + "\n", 0o644),
                                          ("bad token with spaces " * 3, 0o600),
                                          ("\xff\xfe", 0o600)])
def test_create_token_replaces_an_invalid_or_exposed_token(home: Path, content: str,
                                                           mode: int) -> None:
    path = home / "api_token"
    path.write_text(content, encoding="latin-1")
    os.chmod(path, mode)
    token = create_token(home)
    assert token != content.strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token(home) == token


def test_read_token_says_what_to_do(home: Path) -> None:
    with pytest.raises(HomeError, match=r"no API token .*swarmd join --home"):
        read_token(home)
    (home / "api_token").write_text("nope\n")
    with pytest.raises(HomeError, match="not a valid token: remove it and restart the daemon"):
        read_token(home)
