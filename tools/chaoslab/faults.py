"""Applying the chaos plan's faults (tools/chaoslab/plan.py) to a lab swarm, and undoing
them: SIGKILL and restart, SIGSTOP then SIGCONT, partition then heal, 3% loss then none, a
hostile peer (tools/chaoslab/hostile.py) for 30 s. Every fault is undone by its end or by
:meth:`Injector.undo_all`, which the run calls on every way out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from tools.chaoslab import plan
from tools.chaoslab.swarm import HOSTILE_HOST, STAGE_HOSTS, STAGE_OF, TRAINER_HOSTS, LabSwarm

REPO = Path(__file__).resolve().parents[2]
HOSTILE_GRACE_S = 15.0


class Injector:
    """``tick(now_s)`` applies the faults that are due and undoes the ones that ended;
    ``applied`` is what happened (time, kind, target, and what came of it)."""

    def __init__(self, lab: Any, swarm: LabSwarm, faults: list[plan.Fault], *, swarm_name: str,
                 model_hash: str) -> None:
        self.lab, self.swarm = lab, swarm
        self.pending = sorted(faults, key=lambda f: f.at_s)
        self.swarm_name, self.model_hash = swarm_name, model_hash
        self.applied: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self._undo: list[tuple[float, str, Callable[[], None]]] = []  # (at, host, undo)
        self._hostiles = 0

    def running(self) -> bool:
        """Whether a fault is under way (one to undo later)."""
        return bool(self._undo)

    def busy(self) -> set[str]:
        return {host for _, host, _ in self._undo} | self.swarm.restarting()

    def tick(self, now_s: float) -> None:
        for item in [u for u in self._undo if u[0] <= now_s]:
            self._undo.remove(item)
            self._run_undo(item[2])
        while self.pending and self.pending[0].at_s <= now_s:
            self._apply(self.pending.pop(0), now_s)

    def undo_all(self) -> None:
        """End every fault still running (and drop those not applied yet)."""
        self.pending.clear()
        undo, self._undo = self._undo, []
        for _, _, fn in undo:
            self._run_undo(fn)

    def _run_undo(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a failed undo is reported; the others still run
            self.applied.append({"undo_error": f"{type(exc).__name__}: {exc}"[:500]})

    def _apply(self, fault: plan.Fault, now_s: float) -> None:
        target = plan.retarget(fault, self.busy(), STAGE_OF, STAGE_HOSTS, TRAINER_HOSTS)
        if target is None:
            self.skipped.append({"planned_at_s": fault.at_s, "kind": fault.kind,
                                 "reason": "no free target"})
            return
        record: dict[str, Any] = {"at_s": round(now_s, 1), "planned_at_s": fault.at_s,
                                  "kind": fault.kind, "target": target,
                                  "duration_s": fault.duration_s}
        self.applied.append(record)
        try:
            undo = getattr(self, f"_{fault.kind}")(target, fault, record)
        except Exception as exc:  # the fault could not be applied: said so, the run goes on
            record["error"] = f"{type(exc).__name__}: {exc}"[:500]
            return
        if undo is not None:
            self._undo.append((now_s + fault.duration_s, target, undo))

    # ---- the kinds -----------------------------------------------------------------------

    def _kill(self, host: str, fault: plan.Fault, record: dict[str, Any]) -> None:
        self.swarm.kill_and_restart(host)

    def _stop(self, host: str, fault: plan.Fault, record: dict[str, Any]) -> Callable[[], None]:
        proc = self.swarm.daemons[host].proc
        proc.send_signal(signal.SIGSTOP)
        return lambda: proc.send_signal(signal.SIGCONT)

    def _partition(self, host: str, fault: plan.Fault,
                   record: dict[str, Any]) -> Callable[[], None]:
        self.lab.partition(host)
        return lambda: self.lab.heal(host)

    def _loss(self, host: str, fault: plan.Fault, record: dict[str, Any]) -> Callable[[], None]:
        self.lab.set_link(host, loss=plan.LOSS)
        record["loss"] = plan.LOSS
        return lambda: self.lab.set_link(host, loss=0.0)

    def _hostile(self, host: str, fault: plan.Fault,
                 record: dict[str, Any]) -> Callable[[], None]:
        victim = self.swarm.daemons[host]
        self._hostiles += 1
        log = open(self.swarm.root / f"hostile-{self._hostiles}.stderr", "w")
        proc = self.lab.run(HOSTILE_HOST, [
            sys.executable, "-m", "tools.chaoslab.hostile", "--peer", victim.started["peer_id"],
            "--addr", victim.addr, "--swarm", self.swarm_name, "--model-hash", self.model_hash,
            "--listen", f"/ip4/{self.lab.addr(HOSTILE_HOST)}/tcp/0", "--seed", str(fault.seed),
            "--seconds", str(fault.duration_s)],
            stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "SWARMD_MODEL_THREADS": "1"})

        def end() -> None:  # past its time (or the window's end): SIGTERM, it reports
            if proc.poll() is None:
                proc.terminate()
            try:
                out, _ = proc.communicate(timeout=HOSTILE_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                record["hostile_killed"] = True
            log.close()
            lines = (out or "").strip().splitlines()
            try:
                record["hostile"] = json.loads(lines[-1]) if lines else None
            except ValueError:
                record["hostile"] = {"unreadable": lines[-1][:500]}

        return end
