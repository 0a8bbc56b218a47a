"""Local swarms: real ``swarmd join`` processes on 127.0.0.1, each with its own home
(forked from a preloaded process with ``SWARMD_LOCAL_ZYGOTE=1``: ``swarmd.local.zygote``).

Used by ``swarmd demo``, the integration tests and the benchmarks."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from swarmd.local.zygote import swarmd_popen


class DaemonProcess:
    """``swarmd join`` in its own process; ``started`` holds its JSON start line."""

    def __init__(self, home: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.home = home
        if not (home / "identity.key").exists():
            from swarmd.node.home import init_home  # what `swarmd init` does, without a process

            init_home(home)
        self.stderr_path = home / "daemon.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.proc = swarmd_popen(
            ["join", "--home", str(home), "--json",
             "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, cwd=home,
            env={**os.environ, "SWARMD_LOG_LEVEL": "debug" if os.environ.get("SWARMD_TEST_DEBUG")
                 else "info", **(env or {})})
        self.started: dict[str, Any] = {}

    def wait_started(self, seconds: float = 60.0) -> dict[str, Any]:
        line = readline(self.proc, seconds)
        if not line:
            raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.stderr()}")
        self.started = json.loads(line)
        return self.started

    @property
    def addr(self) -> str:
        return self.started["addrs"][0]

    @property
    def peer_id(self) -> str:
        return self.started["peer_id"]

    @property
    def url(self) -> str:
        return self.started["http_url"]

    def get(self, path: str, timeout: float = 5.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as reply:
            return json.loads(reply.read())

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, seconds: float) -> int:
        return self.proc.wait(seconds)

    def stop(self) -> None:
        """Make sure the process is gone (tests that check shutdown do it themselves)."""
        stop_all([self])


def stop_all(daemons: Sequence[DaemonProcess], seconds: float = 15.0) -> None:
    """Ask every daemon to stop at once, then wait: a daemon still there after ``seconds``
    is killed. Their shutdowns (checkpoint, goodbye) overlap instead of queueing."""
    for d in daemons:
        d.signal(signal.SIGTERM)
    deadline = time.monotonic() + seconds
    for d in daemons:
        try:
            d.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
        d._stderr.close()


def readline(proc: subprocess.Popen[str], seconds: float) -> str:
    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        while time.monotonic() < deadline:
            if sel.select(0.2):
                return proc.stdout.readline()  # type: ignore[union-attr]
            if proc.poll() is not None:
                return proc.stdout.readline()  # type: ignore[union-attr]
    raise TimeoutError(f"no line from the process within {seconds} s")


def wait_until(condition: Any, seconds: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``condition()`` until it returns a truthy value; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + seconds
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # the condition may fail while things start up
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}"
                         + (f" (last error: {last_error!r})" if last_error else ""))


def start_swarm(root: Path, stages: Sequence[int | None], *, env: dict[str, str] | None = None,
                into: list[DaemonProcess] | None = None,
                seconds: float = 60.0) -> list[DaemonProcess]:
    """Start one daemon per entry of ``stages`` under ``root`` (homes ``peer0``, ``peer1``...):
    the first starts the swarm, the others join through it (``None``: ``--stage auto``); each
    must print its start line within ``seconds`` of the wait for it.

    Each daemon is appended to ``into`` as soon as it exists, so the caller can stop all of
    them in a ``finally`` even when a later one fails to start.
    """
    started = into if into is not None else []

    def stage_args(stage: int | None) -> tuple[str, ...]:
        return () if stage is None else ("--stage", str(stage))

    first = DaemonProcess(root / "peer0", *stage_args(stages[0]), env=env)
    started.append(first)
    first.wait_started(seconds)
    rest = []
    for i, stage in enumerate(stages[1:], start=1):
        d = DaemonProcess(root / f"peer{i}", *stage_args(stage), "--bootstrap", first.addr,
                          env=env)
        started.append(d)
        rest.append(d)
    for d in rest:
        d.wait_started(seconds)
    return [first, *rest]
