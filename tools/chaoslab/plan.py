"""The chaos run's decisions, as values: which fault comes when and hits whom, which target
stands in for one that is already faulted, and what the report concludes.

Pure: no I/O, no clock, no global random state (``rng: random.Random`` is passed in).
:mod:`tools.chaos` applies these faults to a lab swarm (tools/wanlab) and measures.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

#: fault kinds and how long each lasts (seconds; 0: instantaneous)
KINDS: dict[str, float] = {"kill": 0.0, "stop": 30.0, "partition": 20.0, "loss": 60.0,
                           "hostile": 30.0}
#: the gap between two faults is drawn from this range (seconds)
GAP_S = (20.0, 40.0)
LOSS = 0.03
#: the loss ratio chaos/calm the issue asks for
TARGET_LOSS_RATIO = 1.10


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One fault: at ``at_s`` seconds into the chaos window, ``kind`` hits ``target`` (a lab
    host name) for ``duration_s``; ``seed`` drives what a hostile peer sends."""

    at_s: float
    kind: str
    target: str
    duration_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (kinds: {sorted(KINDS)})")
        if not self.at_s >= 0 or not self.duration_s >= 0:
            raise ValueError(f"a fault needs at_s >= 0 and duration_s >= 0: {self}")


def candidates(kind: str, stage_hosts: Sequence[str], trainer_hosts: Sequence[str]
               ) -> tuple[str, ...]:
    """Who a fault of ``kind`` may hit: stage peers are killed, stopped and attacked; any
    host of the swarm (a trainer's too) may be partitioned or lose packets."""
    if kind in ("kill", "stop", "hostile"):
        return tuple(stage_hosts)
    return tuple(stage_hosts) + tuple(trainer_hosts)


def schedule(rng: random.Random, window_s: float, stage_hosts: Sequence[str],
             trainer_hosts: Sequence[str], kinds: Sequence[str] = tuple(KINDS)) -> list[Fault]:
    """Faults every ``GAP_S`` seconds (drawn) while ``at_s < window_s``; bounded in number by
    ``window_s / GAP_S[0] + 1``. The same ``rng`` state gives the same schedule."""
    if not stage_hosts or not kinds:
        raise ValueError("a schedule needs stage hosts and fault kinds")
    faults: list[Fault] = []
    at = rng.uniform(*GAP_S)
    for _ in range(int(window_s / GAP_S[0]) + 1):
        if at >= window_s:
            break
        kind = rng.choice(list(kinds))
        target = rng.choice(candidates(kind, stage_hosts, trainer_hosts))
        faults.append(Fault(at_s=round(at, 3), kind=kind, target=target,
                            duration_s=KINDS[kind], seed=rng.randrange(2**31)))
        at += rng.uniform(*GAP_S)
    return faults


def retarget(fault: Fault, busy: Iterable[str], stage_of: Mapping[str, int],
             stage_hosts: Sequence[str], trainer_hosts: Sequence[str]) -> str | None:
    """The host ``fault`` hits now: its own target when free, else the next free candidate
    (in the candidates' order, after the target); never the last free peer of a stage for a
    fault that takes a stage peer out. None: nobody may be hit now (the fault is skipped)."""
    busy = set(busy)
    pool = candidates(fault.kind, stage_hosts, trainer_hosts)
    start = pool.index(fault.target) if fault.target in pool else 0
    for host in pool[start:] + pool[:start]:
        if host in busy:
            continue
        if host in stage_of and fault.kind in ("kill", "stop", "partition"):
            stage = stage_of[host]
            free = [h for h, s in stage_of.items() if s == stage and h not in busy]
            if len(free) <= 1:
                continue
        return host
    return None


def calm_steps(done: Sequence[Any], *, fallback: int) -> int:
    """The steps the calm run trains: the mean of the steps the chaos run's trainers did
    (those that reported a count), at least 1; ``fallback`` when none did."""
    counts = [n for n in done if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    if not counts:
        return fallback
    return max(1, round(sum(counts) / len(counts)))


def loss_ratio(chaos: Sequence[float], calm: Sequence[float]) -> float | None:
    """Mean final validation loss of the chaos run's trainers over the calm run's."""
    if not chaos or not calm:
        return None
    return (sum(chaos) / len(chaos)) / (sum(calm) / len(calm))


def verdict(report: Mapping[str, Any]) -> dict[str, bool | None]:
    """The issue's figures, each true, false, or None when not measured."""
    chaos = report.get("chaos") or {}
    trainers = chaos.get("trainers") or []
    ratio = report.get("loss_ratio_chaos_over_calm")
    return {
        "no_crashes": (not chaos.get("crashes")) if chaos else None,
        "lost_zero": all(t.get("lost") == 0 for t in trainers) if trainers else None,
        "no_hangs": (not chaos.get("hangs")) if chaos else None,
        "weights_equal": chaos.get("weights_equal") if chaos else None,
        "loss_ratio_le_1.10": None if ratio is None else ratio <= TARGET_LOSS_RATIO,
    }
