"""CPU accounting for benchmarks: is somebody else using the machine?

Ratios between runs minutes apart only mean something when nothing else loaded the machine
in one of them (2 shared cores here: a test run beside a benchmark costs it a fifth). Linux
only (``/proc``); elsewhere every figure is 0.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

TICK = os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / TICK


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state is [0], ppid [1])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` used (utime + stime); 0 once it is gone."""
    rest = _stat(pid)
    try:
        return 0.0 if rest is None else (int(rest[11]) + int(rest[12])) / TICK
    except (IndexError, ValueError):
        return 0.0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` used with those of its children it reaped (cutime + cstime)."""
    rest = _stat(pid)
    try:
        return 0.0 if rest is None else sum(int(v) for v in rest[11:15]) / TICK
    except (IndexError, ValueError):
        return 0.0


def os_threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(root: int) -> set[int]:
    """The live processes below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return set()
    for pid in pids:
        rest = _stat(pid)
        if rest is not None and len(rest) > 1 and rest[1].isdigit():
            children.setdefault(int(rest[1]), []).append(pid)
    out: set[int] = set()
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _ours_s() -> tuple[float, dict[int, float]]:
    """This process's CPU seconds with its reaped children's, and each live descendant's."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
    return own, {p: tree_cpu_s(p) for p in descendants(os.getpid())}


@dataclass
class OthersShare:
    """How much of the machine processes outside this one's tree used between ``start()``
    and ``stop()``: the machine's busy CPU seconds less this process's, its children's
    (reaped ones included: a trainer that ran and exited) and every live descendant's with
    the children it reaped (a descendant gone before ``stop()`` whose parent is gone too is
    missed)."""

    t0: float = 0.0
    busy0: float = 0.0
    own0: float = 0.0
    live0: dict[int, float] | None = None

    def start(self) -> OthersShare:
        self.t0, self.busy0 = time.monotonic(), busy_s()
        self.own0, self.live0 = _ours_s()
        return self

    def stop(self) -> dict[str, float]:
        """``seconds``, ``machine_busy_share``, ``ours_share``, ``others_share`` (shares of
        all cores over the window)."""
        t, busy = time.monotonic(), busy_s()
        own, live = _ours_s()
        before = self.live0 or {}
        ours = (own - self.own0) + sum(cpu - before.get(p, 0.0) for p, cpu in live.items())
        capacity = max(1e-9, (t - self.t0) * (os.cpu_count() or 1))
        return {"seconds": t - self.t0, "machine_busy_share": (busy - self.busy0) / capacity,
                "ours_share": ours / capacity,
                "others_share": max(0.0, (busy - self.busy0) - ours) / capacity}
