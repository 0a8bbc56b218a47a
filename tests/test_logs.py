"""Logging ([log]): JSON lines, size-rotated files, clear errors; and a real daemon's log."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from swarmd.errors import ConfigError
from swarmd.node import logs

ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logs.set_peer_id("")


def test_json_lines_carry_time_level_logger_peer_and_extra_fields() -> None:
    out = io.StringIO()
    logs.configure("info", format="json", stream=out)
    logs.set_peer_id("12D3KooWtest")
    logging.getLogger("swarmd.test").info("hop %s failed", "x", extra={"event": "hop_failed",
                                                                        "peer_of": object()})
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("swarmd.test").exception("it broke")
    logging.getLogger("swarmd.test").debug("below the level")
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert first["level"] == "info" and first["logger"] == "swarmd.test"
    assert first["peer"] == "12D3KooWtest" and first["msg"] == "hop x failed"
    assert first["event"] == "hop_failed" and first["time"].endswith("Z")
    assert isinstance(first["peer_of"], str)  # not JSON-able: as text, never a crash
    assert second["level"] == "error" and "ValueError: boom" in second["exc"]


def test_text_format_is_for_people() -> None:
    out = io.StringIO()
    logs.configure("warning", stream=out)
    logging.getLogger("swarmd.x").warning("careful")
    assert out.getvalue().rstrip().endswith("WARNING swarmd.x: careful")


def test_the_file_rotates_by_size(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "swarmd.log"
    logs.configure("info", file=str(path), max_bytes=4096, backups=2, stream=io.StringIO())
    for i in range(200):
        logging.getLogger("swarmd.rot").info("line %d %s", i, "x" * 60)
    assert path.exists() and (tmp_path / "sub" / "swarmd.log.1").exists()
    assert not (tmp_path / "sub" / "swarmd.log.3").exists()  # only 2 backups kept
    assert path.stat().st_size <= 4096


def test_an_unwritable_file_is_a_config_error_that_says_what_to_do(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"log.file = .*cannot open it.*log.file = \"\""):
        logs.configure("info", file=str(blocker / "x.log"), stream=io.StringIO())


@pytest.mark.integration
def test_a_daemon_logs_json_with_its_peer_id_to_stderr_and_the_file(tmp_path: Path) -> None:
    from daemon_harness import DaemonProcess, stop_all

    log_file = tmp_path / "logs" / "daemon.log"
    d = DaemonProcess(tmp_path / "a", "--stage", "0",
                      env={"SWARMD_LOG_FORMAT": "json", "SWARMD_LOG_FILE": str(log_file)})
    try:
        d.wait_started()
    finally:
        stop_all([d])
    lines = [json.loads(line) for line in d.stderr_path.read_text().splitlines()
             if line.startswith("{")]
    assert lines, d.stderr()
    assert {"time", "level", "logger", "peer", "msg"} <= set(lines[-1])
    assert any(line["peer"] == d.peer_id for line in lines)
    assert log_file.read_text().count("\n") >= len(lines) > 0
