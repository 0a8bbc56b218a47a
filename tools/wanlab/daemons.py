"""``swarmd join`` and ``swarmd train`` inside lab hosts, like swarmd.local.swarm does on
127.0.0.1: libp2p listens on the host's lab address, HTTP on 127.0.0.1 inside the host's
namespace (reached from here with :meth:`WanLab.inside`)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from swarmd.local.swarm import readline


class LabDaemon:
    """``swarmd join`` in lab host ``host``; ``started`` holds its JSON start line."""

    def __init__(self, lab: Any, host: str, home: Path, *args: str,
                 env: dict[str, str] | None = None) -> None:
        from swarmd.node.home import init_home

        self.lab, self.host, self.home = lab, host, home
        if not (home / "identity.key").exists():
            init_home(home)
        self.stderr_path = home / "daemon.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.t_start = time.monotonic()
        self.proc = lab.run(
            host, [sys.executable, "-m", "swarmd", "join", "--home", str(home), "--json",
                   "--listen", f"/ip4/{lab.addr(host)}/tcp/0", "--http", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, cwd=home,
            env={**os.environ, "SWARMD_LOG_LEVEL": "info", **(env or {})})
        self.started: dict[str, Any] = {}

    def wait_started(self, seconds: float = 90.0) -> dict[str, Any]:
        line = readline(self.proc, seconds)
        if not line:
            raise RuntimeError(f"daemon in {self.host} exited with {self.proc.poll()}:\n"
                               f"{self.stderr_path.read_text()[-3000:]}")
        self.started = json.loads(line)
        return self.started

    @property
    def addr(self) -> str:
        return self.started["addrs"][0]

    def get(self, path: str, timeout: float = 5.0) -> Any:
        with self.lab.inside(self.host):  # the connection is made inside the host's netns
            with urllib.request.urlopen(self.started["http_url"] + path,
                                        timeout=timeout) as reply:
                return json.loads(reply.read())

    def stop(self, seconds: float = 15.0) -> None:
        stop_all([self], seconds)


def start_swarm(lab: Any, root: Path, bootstrap: tuple[str, Sequence[str]],
                *waves: Sequence[tuple[str, Sequence[str]]], env: dict[str, str] | None = None,
                ) -> list[LabDaemon]:
    """Start ``bootstrap`` = (host, args), then each wave of (host, args) together, all with
    ``--bootstrap`` its address, homes under ``root/<host>``: the daemons of a wave start at
    once and are waited for together (a start costs seconds of imports: in parallel, not one
    after another). In start order; on a failure every started daemon is stopped."""
    host, args = bootstrap
    daemons = [LabDaemon(lab, host, root / host, *args, env=env)]
    try:
        daemons[0].wait_started()
        for wave in waves:
            started = [LabDaemon(lab, h, root / h, *a, "--bootstrap", daemons[0].addr, env=env)
                       for h, a in wave]
            daemons += started
            for d in started:
                d.wait_started()
    except BaseException:
        stop_all(daemons)
        raise
    return daemons


def stop_all(daemons: Sequence[LabDaemon], seconds: float = 15.0, *,
             trainer: subprocess.Popen[Any] | None = None) -> None:
    """SIGTERM every daemon (a ``trainer`` process first, killed if it lingers) and wait for
    them together, killing what is left after ``seconds``."""
    if trainer is not None and trainer.poll() is None:
        trainer.terminate()
        try:
            trainer.wait(seconds)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
    for d in daemons:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + seconds
    for d in daemons:
        try:
            d.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
        d._stderr.close()


#: what ``train`` runs: ``swarmd train`` (tools/chaoslab/train_until.py wraps it)
SWARMD_TRAIN = ("-m", "swarmd", "train")


def train(lab: Any, host: str, home: Path, bootstrap: str, steps: int, tokens_per_step: int,
          env: dict[str, str], seconds: float,
          program: tuple[str, ...] = SWARMD_TRAIN) -> dict[str, Any]:
    """``swarmd train --json`` in ``host`` (``program``: the Python arguments before its own);
    its JSON result plus ``steady_tokens_per_s``: the rate over the second half of the steps
    (from its metrics file), past start-up and warm-up, and ``steady_step_seconds`` (the
    median and the longest step there: a stall shows as one long step)."""
    home.mkdir(parents=True, exist_ok=True)
    metrics = home / "train-metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    with open(home / "train.stderr", "w") as err:
        proc = lab.run(host, [sys.executable, *program, "--home", str(home),
                              "--json", "--bootstrap", bootstrap, "--steps", str(steps),
                              "--listen", f"/ip4/{lab.addr(host)}/tcp/0"],
                       stdout=subprocess.PIPE, stderr=err, text=True, cwd=home,
                       env={**os.environ, "SWARMD_LOG_LEVEL": "warning", **env})
        try:
            out, _ = proc.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise RuntimeError(f"swarmd train in {host} did not finish within {seconds:.0f} s")
    if proc.returncode != 0:
        raise RuntimeError(f"swarmd train failed ({proc.returncode}):\n"
                           f"{(home / 'train.stderr').read_text()[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    lines = [x for x in lines if "loss" in x]  # the steps' lines (evaluations: "val_loss")
    if len(lines) >= 4:
        a, b = lines[len(lines) // 2], lines[-1]
        result["steady_steps"] = b["step"] - a["step"]
        result["steady_seconds"] = b["time"] - a["time"]
        result["steady_tokens_per_s"] = (result["steady_steps"] * tokens_per_step
                                         / max(1e-9, result["steady_seconds"]))
        gaps = sorted(y["time"] - x["time"] for x, y in zip(lines[len(lines) // 2:],
                                                            lines[len(lines) // 2 + 1:]))
        result["steady_step_seconds"] = {"median": gaps[len(gaps) // 2], "max": gaps[-1]}
        # where a step's time went, median of each phase (``TrainStats.step_phases``)
        half = [x.get("phases") or {} for x in lines[len(lines) // 2:]]
        result["steady_step_phases"] = {
            name: statistics.median(h[name] for h in half if name in h)
            for name in sorted({k for h in half for k in h})}
        # what the trainer kept in flight there, and the shortest round trip it measured
        for name in ("in_flight_target", "round_trip_ms"):
            seen = [x[name] for x in lines[len(lines) // 2:] if x.get(name) is not None]
            result[f"steady_{name}"] = statistics.median(seen) if seen else None
    return result
