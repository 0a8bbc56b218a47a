"""``swarmd join`` as a real process: start-up report, one daemon per home, clean shutdown."""

from __future__ import annotations

import json
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from daemon_harness import ROOT, DaemonProcess, wait_until
from swarmd.local.zygote import swarmd_run

pytestmark = pytest.mark.integration


def _port(addr: str) -> int:
    return int(addr.split("/tcp/")[1].split("/")[0])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_start_report_api_file_and_clean_exit_on_signal(tmp_path: Path, sig: int) -> None:
    d = DaemonProcess(tmp_path / "home")
    try:
        info = d.wait_started()
        assert info["peer_id"].startswith("12D3KooW")
        assert all(a.endswith("/p2p/" + info["peer_id"]) and "/tcp/0/" not in a
                   for a in info["addrs"])
        assert (d.home / "api").read_text().strip() == info["http_url"]
        assert d.get("/api/v0/id")["peer_id"] == info["peer_id"]
        d.signal(sig)
        assert d.wait(10) == 0
        assert not (d.home / "api").exists()
        # nothing listens on its ports any more (SO_REUSEADDR: TIME_WAIT of closed
        # connections is fine, a listening socket is not)
        for port in (_port(info["addrs"][0]), int(info["http_url"].rsplit(":", 1)[1])):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                s.listen()
        assert "Traceback" not in d.stderr()
    finally:
        d.stop()


def test_a_second_daemon_on_the_same_home_refuses_to_start(tmp_path: Path) -> None:
    first = DaemonProcess(tmp_path / "home")
    try:
        first.wait_started()
        second = swarmd_run(["join", "--home",
                             str(tmp_path / "home"), "--listen", "/ip4/127.0.0.1/tcp/0",
                             "--http", "127.0.0.1:0"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert second.returncode == 1
        assert f"pid {first.proc.pid}" in second.stderr and "already running" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.get("/api/v0/status")["state"] == "online"  # the first is untouched
    finally:
        first.stop()


def test_http_errors_are_json_with_status_codes(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "home")
    try:
        d.wait_started()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(d.url + "/api/v0/nope", timeout=5)
        assert err.value.code == 404 and json.loads(err.value.read())["error"]["code"]
        request = urllib.request.Request(d.url + "/api/v0/stop", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=5)
        assert err.value.code == 401  # no token: nothing stops
        assert d.get("/api/v0/status")["state"] == "online"
    finally:
        d.stop()


def test_unreachable_bootstrap_is_retried_and_reported_not_fatal(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port with nobody behind it
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    dead = f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/12D3KooWEr6KXGJvxwpQJcEk9mz6RfQ9MwVyTbAtvL7pev1J6wpx"
    d = DaemonProcess(tmp_path / "home", "--bootstrap", dead)
    try:
        d.wait_started()
        wait_until(lambda: d.stderr().count("no bootstrap peer answered") >= 2, 30,
                   "two failed bootstrap rounds in the log")
        assert dead in d.stderr()  # the log says which address failed
        assert d.get("/api/v0/status")["state"] == "online"
    finally:
        d.stop()


def test_bad_config_key_stops_join_with_a_clear_message(tmp_path: Path) -> None:
    home = tmp_path / "home"
    swarmd_run(["init", "--home", str(home)], check=True,
               capture_output=True, cwd=ROOT, timeout=60)
    bad = tmp_path / "bad.toml"
    bad.write_text("[network]\nlisn = []\n")
    out = swarmd_run(["join", "--home", str(home), "--config",
                      str(bad)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "network.lisn" in out.stderr and str(bad) in out.stderr
    assert not (home / "api").exists()
