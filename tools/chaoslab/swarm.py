"""The chaos run's lab swarm: 2 stages x 3 ``swarmd join`` peers and 2 ``swarmd train``
processes, each in its own lab host (tools/wanlab), on one link profile.

Built on tools/wanlab/daemons.py (``LabDaemon``, ``train``, ``stop_all``): this module adds
what a run under faults needs: restarting a peer on its own home, telling a crash (an exit
we did not cause) from our SIGKILL, and waiting for a stage's peers to agree on their weights.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from tools.wanlab import daemons

STAGES = 2
PEERS_PER_STAGE = 3
STAGE_HOSTS = tuple(f"s{s}{chr(ord('a') + i)}" for s in range(STAGES)
                    for i in range(PEERS_PER_STAGE))
TRAINER_HOSTS = ("t0", "t1")
HOSTILE_HOST = "hx"
STAGE_OF = {h: int(h[1]) for h in STAGE_HOSTS}
START_S = 180.0
AGREE_S = 120.0
#: SIGTERM to exit, for all the daemons together (each saves a checkpoint)
STOP_S = 45.0
MAX_CRASH_RESTARTS = 3


class LabSwarm:
    """The stage daemons of one run; ``daemons[host]`` is the one running now."""

    def __init__(self, lab: Any, root: Path, env: dict[str, str]) -> None:
        self.lab, self.root, self.env = lab, root, env
        self.daemons: dict[str, daemons.LabDaemon] = {}
        self.retired: list[daemons.LabDaemon] = []  # replaced by a restart
        self.killed: set[int] = set()  # id() of the daemons we SIGKILLed
        self.crashes: list[dict[str, Any]] = []
        self.restarts: list[threading.Thread] = []
        self.restart_errors: list[str] = []

    # ---- start, restart ------------------------------------------------------------------

    def start(self) -> None:
        first = self._start(STAGE_HOSTS[0])
        first.wait_started()
        for host in STAGE_HOSTS[1:]:
            self._start(host)
        for host in STAGE_HOSTS[1:]:
            self.daemons[host].wait_started()
        from swarmd.local.swarm import wait_until

        wait_until(lambda: all(r["routable_peers"] == PEERS_PER_STAGE for r in
                               first.get("/api/v0/swarm")["stages"]), START_S,
                   f"{PEERS_PER_STAGE} routable peers in each of {STAGES} stages", interval=0.5)

    def bootstrap(self, without: str = "") -> list[str]:
        """Addresses of up to three running peers (not ``without``)."""
        return [d.addr for h, d in self.daemons.items()
                if h != without and d.started and d.proc.poll() is None][:3]

    def _start(self, host: str) -> daemons.LabDaemon:
        args = ["--stage", str(STAGE_OF[host])]
        for addr in self.bootstrap(without=host):
            args += ["--bootstrap", addr]
        d = daemons.LabDaemon(self.lab, host, self.root / host, *args, env=self.env)
        self.daemons[host] = d
        return d

    def kill_and_restart(self, host: str) -> None:
        """SIGKILL ``host``'s daemon, then start it again on the same home (its start line is
        awaited in a thread of its own, so faults go on meanwhile)."""
        old = self.daemons[host]
        self.killed.add(id(old))
        old.proc.kill()
        old.proc.wait(10)
        self._restart(host)

    def _restart(self, host: str) -> None:
        old = self.daemons[host]
        old._stderr.close()
        self.retired.append(old)
        n = len([d for d in self.retired if d.host == host])
        if old.stderr_path.exists():  # keep the earlier life's log beside the new one
            old.stderr_path.rename(old.stderr_path.with_suffix(f".stderr.{n}"))
        new = self._start(host)

        def wait() -> None:
            try:
                new.wait_started()
            except Exception as exc:
                self.restart_errors.append(f"{host}: {exc}"[:2000])

        thread = threading.Thread(target=wait, daemon=True, name=f"restart-{host}")
        thread.start()
        self.restarts.append(thread)

    def restarting(self) -> set[str]:
        return {h for h, d in self.daemons.items() if not d.started and d.proc.poll() is None}

    # ---- crashes -------------------------------------------------------------------------

    def check_crashes(self, now_s: float) -> None:
        """Record every daemon that exited without our SIGKILL, and start it again (at most
        ``MAX_CRASH_RESTARTS`` times per host)."""
        for host, d in list(self.daemons.items()):
            code = d.proc.poll()
            if code is None or id(d) in self.killed:
                continue
            self.crashes.append({"at_s": round(now_s, 1), "host": host, "returncode": code,
                                 "stderr_tail": _tail(d.stderr_path)})
            self.killed.add(id(d))  # recorded once
            if sum(c["host"] == host for c in self.crashes) <= MAX_CRASH_RESTARTS:
                self._restart(host)

    # ---- the end -------------------------------------------------------------------------

    def agreement(self, seconds: float = AGREE_S) -> dict[str, Any]:
        """Wait (up to ``seconds``) until each stage's running peers report one ``step`` and
        one ``params_digest`` on ``/api/v0/stage``; what each peer said last."""
        for t in self.restarts:
            t.join(max(0.1, seconds / 2))
        deadline = time.monotonic() + seconds
        stages: dict[str, list[dict[str, Any]]] = {}
        equal = False
        while time.monotonic() < deadline:
            stages = {str(s): [self._stage_info(h) for h in STAGE_HOSTS if STAGE_OF[h] == s
                               and self.daemons[h].proc.poll() is None]
                      for s in range(STAGES)}
            equal = all(_agree(rows) for rows in stages.values())
            if equal:
                break
            time.sleep(1.0)
        return {"weights_equal": equal, "stages": stages}

    def _stage_info(self, host: str) -> dict[str, Any]:
        d = self.daemons[host]
        try:
            info = d.get("/api/v0/stage", timeout=15)
            return {"host": host, "step": info.get("step"),
                    "params_digest": info.get("params_digest")}
        except Exception as exc:  # 503 while computing, or not started yet: asked again
            return {"host": host, "error": f"{type(exc).__name__}: {exc}"[:200]}

    def stop(self) -> list[dict[str, Any]]:
        """SIGTERM every daemon; the ones that exited non-zero (not by our SIGKILL), or had
        to be killed after ``STOP_S`` (returncode -9), are returned."""
        current = list(self.daemons.values())
        daemons.stop_all(current, STOP_S)
        bad = []
        for d in current:
            if id(d) not in self.killed and d.proc.returncode != 0:
                bad.append({"host": d.host, "returncode": d.proc.returncode,
                            "stderr_tail": _tail(d.stderr_path)})
        return bad


def _agree(rows: list[dict[str, Any]]) -> bool:
    if not rows or any("error" in r for r in rows):
        return False
    return len({r["step"] for r in rows}) == 1 and len({r["params_digest"] for r in rows}) == 1


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def read_metrics(home: Path) -> list[dict[str, Any]]:
    """The trainer's per-step metrics lines (``train-metrics.jsonl``), unreadable lines left
    out."""
    path = home / "train-metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "loss" in row:  # a step's line (an evaluation's has "val_loss")
                rows.append(row)
    return rows
