"""log.format = "json": every line a process writes on stdout and stderr is one JSON object."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from daemon_harness import wait_until
from swarmd.cli import main
from swarmd.local.demo import DEMO_ENV
from swarmd.node.log_streams import RecordLines
from swarmd.local.zygote import swarmd_popen, swarmd_run

ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "json-logs-test",
       "SWARMD_SWARM_STAGES": "1", "SWARMD_LOG_FORMAT": "json"}


def _records(path: Path) -> list[dict[str, Any]]:
    """Every line of the file as a JSON object; fails naming the first line that is not."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            value = json.loads(line)
        except ValueError:
            raise AssertionError(f"{path.name} line {number} is not JSON: {line!r}") from None
        assert isinstance(value, dict), f"{path.name} line {number} is not an object: {line!r}"
        out.append(value)
    return out


# ------------------------------------------------------------------------- the stream wrapper

def test_stray_lines_become_records_and_json_lines_pass_through() -> None:
    below = io.StringIO()
    stream = RecordLines(below, lambda line: json.dumps({"msg": line}))
    stream.write("hello ")
    assert below.getvalue() == ""  # a line is written when it ends
    stream.write("world\n\n")
    stream.write('{"peer_id": "x"}\n')
    stream.write("10%\r20%\r")  # a progress bar's redraws
    stream.write("not ended")
    stream.close()
    lines = [json.loads(line) for line in below.getvalue().splitlines()]
    assert lines == [{"msg": "hello world"}, {"peer_id": "x"}, {"msg": "10%"}, {"msg": "20%"},
                     {"msg": "not ended"}]
    assert not stream.isatty()


def test_a_process_in_json_mode_writes_only_json(tmp_path: Path) -> None:
    """What reaches stdout and stderr outside logging: prints, warnings, an uncaught error."""
    script = ("import sys, warnings\n"
              "from swarmd.node import logs\n"
              "logs.configure('info', format='json')\n"
              "print('a print'); print('to stderr', file=sys.stderr)\n"
              "warnings.warn('a library warns')\n"
              "raise RuntimeError('a bug')\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 1
    (tmp_path / "out").write_text(run.stdout)
    (tmp_path / "err").write_text(run.stderr)
    out, err = _records(tmp_path / "out"), _records(tmp_path / "err")
    assert [r["msg"] for r in out] == ["a print"]
    assert [r["logger"] for r in err] == ["stderr", "py.warnings", "swarmd"]
    assert "a library warns" in err[1]["msg"]
    assert err[2]["level"] == "critical" and "RuntimeError: a bug" in err[2]["exc"]


# ----------------------------------------------------------------------- errors, in one line

def test_an_unknown_log_format_is_one_line_naming_the_key(tmp_path: Path, capsys: Any,
                                                          monkeypatch: Any) -> None:
    monkeypatch.setenv("SWARMD_LOG_FORMAT", "jsonl")
    assert main(["join", "--home", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "SWARMD_LOG_FORMAT" in err and "log.format" in err and '"json"' in err


def test_a_config_error_in_json_mode_is_a_json_record(tmp_path: Path, capsys: Any,
                                                      monkeypatch: Any) -> None:
    monkeypatch.setenv("SWARMD_LOG_FORMAT", "json")
    monkeypatch.setenv("SWARMD_HTTP_LISTEN", "nowhere")
    assert main(["join", "--home", str(tmp_path / "h")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and record["code"] == "config"
    assert "SWARMD_HTTP_LISTEN" in record["msg"]


def test_the_config_files_json_mode_counts_before_it_loads(tmp_path: Path, capsys: Any,
                                                           monkeypatch: Any) -> None:
    monkeypatch.delenv("SWARMD_LOG_FORMAT", raising=False)
    config = tmp_path / "c.toml"
    config.write_text('[log]\nformat = "json"\n[http]\nlisten = "nowhere"\n')
    assert main(["join", "--home", str(tmp_path / "h"), "--config", str(config)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "http.listen" in json.loads(line)["msg"]


# ------------------------------------------------------ a daemon and a trainer, start to stop

@pytest.mark.integration
@pytest.mark.timeout(300)
def test_join_and_train_in_json_mode_write_only_json_lines(tmp_path: Path) -> None:
    from swarmd.node.home import init_home

    env = {**os.environ, **ENV}
    files = {name: tmp_path / name for name in ("join.out", "join.err", "train.out",
                                                "train.err")}
    opened = {name: open(path, "w") for name, path in files.items()}
    init_home(tmp_path / "peer")
    daemon = swarmd_popen(
        ["join", "--home", str(tmp_path / "peer"), "--listen",
         "/ip4/127.0.0.1/tcp/0", "--http", "127.0.0.1:0", "--stage", "0"],
        stdout=opened["join.out"], stderr=opened["join.err"], env=env, text=True)
    try:
        def started() -> dict[str, Any] | None:
            assert daemon.poll() is None, files["join.err"].read_text()[-3000:]
            return next((r for r in _records(files["join.err"])
                         if r.get("event") == "started"), None)

        banner = wait_until(started, 60, "the daemon's started record")
        assert banner["peer_id"].startswith("12D3KooW")
        assert banner["addrs"] and all(a.endswith("/p2p/" + banner["peer_id"])
                                       for a in banner["addrs"])
        assert banner["http"].startswith("http://127.0.0.1:")
        trainer = swarmd_run(
            ["train", "--home", str(tmp_path / "trainer"),
             "--bootstrap", banner["addrs"][0], "--steps", "3"],
            stdout=opened["train.out"], stderr=opened["train.err"], env=env, text=True,
            timeout=240)
        assert trainer.returncode == 0, files["train.err"].read_text()[-3000:]
        with urllib.request.urlopen(banner["http"] + "/api/v0/status", timeout=10) as reply:
            counters = json.loads(reply.read())["counters"]
        assert counters["stage.forward"] > 0 and counters["stage.backward"] > 0  # the trainer's
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        for f in opened.values():
            f.close()
    records = {name: _records(path) for name, path in files.items()}
    assert records["join.err"] and records["train.err"]
    results = [r for r in records["join.err"] if r.get("event") == "join_result"]
    assert [r["msg"] for r in results] == ["stopped"]
    (trained,) = [r for r in records["train.err"] if r.get("event") == "train_result"]
    assert trained["result"]["steps"] == 3
    assert any(r.get("event") == "progress" for r in records["train.err"])
